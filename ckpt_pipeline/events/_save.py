"""The events of the save path, one or more per stage (copy, write_data, seal, commit, retain)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from ._base import Event

__all__ = (
    "CheckpointCommitted",
    "CheckpointPruned",
    "FailedAt",
    "RetentionFailed",
    "SaveFailed",
    "SaveRequested",
    "SaveSkipped",
    "SaveStage",
    "ShardDataWritten",
    "ShardSealed",
    "SnapshotTaken",
)

SaveStage = Literal["copy", "memory", "write_data", "seal", "commit", "retain"]
"""The stages of a save, in order (``memory``: only with the memory tier, which commits there
and sends on only the saves it writes through to disk): the one name of each in functions, crash labels, events and
log lines (``write_data.done``, ``ShardDataWritten``, ``ckpt.write_data.done``)."""

FailedAt = Literal[SaveStage, "submit", "close"]
"""Where a save failed (``SaveFailed.stage``): a stage, or ``submit`` (the pipeline was closed
when the save was handed to it), or ``close`` (abandoned when the pipeline closed)."""

_FAILED_AT: frozenset[str] = frozenset(get_args(SaveStage)) | {"submit", "close"}


@dataclass(frozen=True, slots=True)
class SaveRequested(Event):
    """``save()`` accepted a request; its tensors are being copied."""

    log_name: ClassVar[str] = "ckpt.save.requested"
    save_id: str
    tensors: int
    bytes: int
    blocking_seconds: float


@dataclass(frozen=True, slots=True)
class SaveSkipped(Event):
    """A save was dropped because every host buffer was busy and the policy is ``skip``."""

    log_name: ClassVar[str] = "ckpt.save.skipped"
    log_level: ClassVar[str] = "warning"
    reason: str


@dataclass(frozen=True, slots=True)
class SnapshotTaken(Event):
    """Every tensor of the save is in host memory."""

    log_name: ClassVar[str] = "ckpt.snapshot.done"
    save_id: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ShardDataWritten(Event):
    """The write_data stage is done: the tensor bytes are hashed and in the temporary shard,
    the shard header encoded."""

    log_name: ClassVar[str] = "ckpt.write_data.done"
    save_id: str
    bytes: int
    header_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ShardSealed(Event):
    """The seal stage is done: the shard and manifest of this rank are durable under their
    final names."""

    log_name: ClassVar[str] = "ckpt.seal.done"
    save_id: str
    path: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class CheckpointCommitted(Event):
    """The commit record is durable: the step is complete and restorable."""

    log_name: ClassVar[str] = "ckpt.commit.done"
    log_level: ClassVar[str] = "info"
    save_id: str
    path: str
    bytes: int
    seconds: float
    """From ``save()`` to the commit record fsynced (time to durable)."""


@dataclass(frozen=True, slots=True)
class CheckpointPruned(Event):
    """An older committed step was removed by retention."""

    log_name: ClassVar[str] = "ckpt.retain.pruned"
    path: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class RetentionFailed(Event):
    """Retention could not remove an older step (it stays on disk; the save is committed).

    ``step`` is the step that could not be pruned, ``committed_step`` the save whose
    retention ran. ``ckpt-pipeline ls`` marks the step until a later prune removes it.
    """

    log_name: ClassVar[str] = "ckpt.retain.failed"
    log_level: ClassVar[str] = "warning"
    committed_step: int
    path: str
    error: str


@dataclass(frozen=True, slots=True)
class SaveFailed(Event):
    """A save failed; nothing of it was committed and the previous checkpoint is intact."""

    log_name: ClassVar[str] = "ckpt.save.failed"
    log_level: ClassVar[str] = "error"
    save_id: str
    stage: FailedAt
    error: str

    def __post_init__(self) -> None:
        if self.stage not in _FAILED_AT:
            raise ValueError(f"SaveFailed.stage is {self.stage!r}, not one of "
                             f"{', '.join(sorted(_FAILED_AT))}")

