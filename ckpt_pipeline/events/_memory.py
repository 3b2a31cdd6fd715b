"""The events of the memory tier (``memory=``): a step committed in shared memory, a
write-through to disk skipped because the disk was busy, memory steps dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._base import Event

__all__ = ("MemoryCommitted", "MemoryPruned", "WriteThroughSkipped")


@dataclass(frozen=True, slots=True)
class MemoryCommitted(Event):
    """Every rank's shard of the step is sealed in the memory tier and this rank's commit
    record is written there: restorable after a crash of the process. ``write_through``: the
    step goes to disk too. ``shm_used`` / ``shm_free``: bytes of this rank's buffers, and
    free on the memory file system."""

    log_name: ClassVar[str] = "ckpt.memory.committed"
    log_level: ClassVar[str] = "info"
    save_id: str
    path: str
    bytes: int
    seconds: float
    write_through: bool
    shm_used: int
    shm_free: int


@dataclass(frozen=True, slots=True)
class WriteThroughSkipped(Event):
    """A memory step due for disk was not written through: a write-through of an earlier
    step still ran on ``busy_ranks``. Training and memory commits go on; ``skipped`` counts
    this pipeline's skips so far."""

    log_name: ClassVar[str] = "ckpt.memory.write_through_skipped"
    log_level: ClassVar[str] = "warning"
    save_id: str
    busy_ranks: tuple[int, ...]
    skipped: int


@dataclass(frozen=True, slots=True)
class MemoryPruned(Event):
    """A memory step's files of this rank were dropped (its buffer is free again)."""

    log_name: ClassVar[str] = "ckpt.memory.pruned"
    path: str
