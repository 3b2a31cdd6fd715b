"""A save on its way through the stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._format.header import DistLayout
from .._format.layout import EMPTY_LAYOUT, DataLayout
from .._format.publish import PendingFiles
from .._tiers.replica.push import Push
from .._tree import MeshNames
from ..errors import CheckpointError, SaveError
from ..events import SaveStage
from ..handle import SaveHandle
from .buffers import Slot
from .control import HandleControl
from .copy import Snapshot

__all__ = ("DataWritten", "SaveJob", "Sealed", "stage_error")


@dataclass(frozen=True, slots=True)
class DataWritten:
    """What ``write_data`` produced: every byte in the temporary shard, and its header."""

    header: bytes
    copy_seconds: float | None
    """Until the last device copy was done (a save with device copies), else None."""


@dataclass(frozen=True, slots=True)
class Sealed:
    """What ``seal`` produced: the shard and the manifest durable under their final names."""

    shard_size: int
    preamble: bytes = b""
    manifest: bytes = b""


@dataclass(slots=True)
class SaveJob:
    """Everything the stages need for one save; each stage fills in its part."""

    step: int
    rank: int
    world_size: int
    save_id: str
    control: HandleControl
    """Settles the save's handle (the stages resolve or fail it, retention settles it)."""
    slot: Slot | None
    snapshot: Snapshot | None
    paths: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    layouts: tuple[DistLayout | None, ...]
    data: DataLayout
    """Where each stored item and tensor goes in the data region."""
    tree: bytes
    train_state: dict[str, Any]
    requested_at: float
    meshes: tuple[MeshNames, ...] = ()
    """The DeviceMeshes of the state's DTensors (shape, dimension names), for the header."""
    # the files the save owns (created by write_data, published by seal and commit)
    files: PendingFiles = field(default_factory=PendingFiles)
    push: Push | None = None
    """The copies of the shard on their way to other ranks (``replicas``), from write_data
    until commit."""
    host_buffer: tuple[int, bool] | None = None
    """(bytes, pinned) of the host buffer a save started without (device staging holds its
    CUDA tensors): the copy stage takes it from the pool and binds it, then clears this."""
    # each stage's result, set when it succeeded
    written: DataWritten | None = None
    sealed: Sealed | None = None
    committed: bool = False
    # the memory tier's part (``memory=``): its files in the memory root, whether the memory
    # commit carried, whether the step is also written through to disk (every rank agreed)
    memory_files: PendingFiles | None = None
    memory_committed: bool = False
    write_through: bool = False
    leaves: bool = False
    """Set by a stage when the job goes no further (a memory save not written through)."""
    # set by the first stage that fails; the job still reaches commit to take part in the vote
    error: CheckpointError | None = None
    failed_stage: SaveStage | None = None

    @property
    def handle(self) -> SaveHandle:
        """What ``save()`` returned to the caller for this save."""
        return self.control.handle

    @property
    def data_bytes(self) -> int:
        """Bytes of the stored items: the state's unique tensor bytes."""
        return self.data.stored_bytes

    @property
    def data_length(self) -> int:
        return self.data.data_length

    @property
    def shard_size(self) -> int:
        return 0 if self.sealed is None else self.sealed.shard_size

    @classmethod
    def placeholder(cls, step: int, rank: int, world_size: int, save_id: str,
                    control: HandleControl, error: CheckpointError,
                    stage: SaveStage) -> SaveJob:
        """A save that failed before it had data: it only takes part in the commit vote."""
        return cls(step=step, rank=rank, world_size=world_size, save_id=save_id,
                   control=control, slot=None, snapshot=None, paths=(), dtypes=(), shapes=(),
                   layouts=(), data=EMPTY_LAYOUT, tree=b"",
                   train_state={}, requested_at=0.0, error=error, failed_stage=stage)


def stage_error(job: SaveJob, stage: str, exc: Exception, root: str) -> CheckpointError:
    """What a stage that raised ``exc`` fails the save with: a CheckpointError with the step
    and rank filled in, or a SaveError naming the stage and the unexpected exception."""
    if isinstance(exc, CheckpointError):
        if exc.step is None:
            exc.step = job.step
        if exc.rank is None:
            exc.rank = job.rank
        return exc
    error = SaveError(f"{stage} failed: {type(exc).__name__}: {exc}", step=job.step,
                      rank=job.rank, path=root)
    error.__cause__ = exc
    return error
