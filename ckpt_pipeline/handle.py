"""What ``save()`` and ``restore_latest()`` hand back."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ._threads import in_thread
from .train_state import TrainState

__all__ = ("CommitInfo", "Missing", "RejectedStep", "Reshard", "RestoreResult", "SaveHandle")

Missing = Literal["refuse", "keep"]
"""What a restore does with top-level entries of the live state that the step does not hold:
refuse the restore (the default), or leave them as they are and restore the rest."""


@dataclass(frozen=True, slots=True)
class Reshard:
    """What a restore onto another number of ranks does with the state that has no layout to
    be resharded by: the RNG streams and the values saved per rank.

    A DTensor (and a plain tensor, replicated) is resharded by its layout. A plain value that
    differs between the saved ranks (a data loader's position, ``TrainState.extra``, the
    sample counts) has no such map: the restore refuses it, on every rank and before anything
    is applied, unless ``exclude`` names its top-level entry or ``per_rank`` says what each
    rank restores. A restore onto the same number of ranks, on meshes of the saved shapes with
    other placements, maps rank to rank (each rank restores its own saved values and RNG
    states) and needs none of this; on a mesh of another shape it needs it as on another
    number of ranks (a rank's place in the data-parallel dimension may have changed).
    """

    rng: Literal["live", "rank0"] = "live"
    """``"live"`` (the default): the RNG states are not restored; each rank keeps the streams
    the job seeded it with (a restart seeds per rank as a fresh job would). ``"rank0"``: every
    rank restores saved rank 0's states (the same streams on every rank: dropout masks that
    agree across ranks, as tensor parallelism needs)."""
    exclude: tuple[str, ...] = ()
    """Top-level entries of the state that are not restored: they keep their live values
    (``RestoreResult.excluded``). For per-rank state such as a data loader's."""
    per_rank: Callable[[str, tuple[Any, ...]], Any] | None = None
    """Called on every live rank for each plain value that differs between the saved ranks,
    with its path (``"loader/position"``, ``"train_state.extra/epoch"``,
    ``"train_state.consumed_train_samples"``) and every saved rank's value in rank order;
    returns the value this rank restores (for example their sum, or the value of the saved
    rank this rank takes over from). A value holding tensors cannot be mapped so."""


@dataclass(frozen=True, slots=True)
class CommitInfo:
    """A committed save: restorable. ``tier`` says where it was committed: ``"disk"`` (the
    node's root: durable), or ``"memory"`` (the memory tier: restorable after a crash of the
    process, not of the node; ``SaveHandle.durable`` waits for the disk)."""

    step: int
    rank: int
    save_id: str
    path: str
    bytes: int
    seconds: float
    """From ``save()`` to the commit record fsynced (time to durable)."""
    replica_holders: tuple[int, ...] = ()
    """Ranks that hold a durable copy of this rank's shard of the step (``replicas``)."""
    missing_replicas: tuple[tuple[int, int], ...] = ()
    """(source rank, holder rank) of every copy of the step, on any rank, that could not be
    made: the step committed with less redundancy than asked for. Empty when whole."""
    tier: Literal["disk", "memory"] = "disk"

    @property
    def degraded(self) -> bool:
        """Some copy of the step is missing (see ``missing_replicas``)."""
        return bool(self.missing_replicas)


@dataclass(frozen=True, slots=True)
class RejectedStep:
    """A step that recovery found unusable, and why."""

    step: int
    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """The step that was loaded into the live state."""

    step: int
    save_id: str
    path: str
    train_state: TrainState
    bytes: int
    seconds: float
    rejected: tuple[RejectedStep, ...] = ()
    """Newer steps that were found corrupt or incomplete and skipped (each was also reported)."""
    valid_by_rank: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """What each rank reported: the steps it held complete and valid, newest first."""
    fetched: Mapping[int, int] = field(default_factory=dict)
    """{rank: holder rank} for each rank whose shard was missing or corrupt in its own root and
    was fetched from a copy (replication); every other rank loaded its own shard."""
    downloaded: tuple[int, ...] = ()
    """The ranks whose shard came from the persistent tier (``persistent``), downloaded into
    their roots; every other rank loaded its own shard or a copy."""
    foreign: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """{rank: save ids} of the ranks whose files of the step were of other saves (another
    run's root came back): set aside, never loaded (``ForeignFilesSetAside``); their shard
    came from a copy or the persistent tier."""
    from_memory: tuple[int, ...] = ()
    """The ranks whose shard was read from the memory tier (``memory=``); the others read
    theirs from disk, a copy or the persistent tier."""
    resending: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """{holder rank: source ranks} of the copies of the restored step that their holders
    lacked (a replaced node, files set aside): each source sends its copy again in the
    background, after the restore returned (``ReplicaRestored`` or ``ReplicaRestoreFailed``
    on the source rank when it is done). The same on every rank."""
    resharded_from: int | None = None
    """How many ranks saved the step, when the restore resharded it: each rank read the parts
    of every saved rank's shard its live tensors need (None: not resharded; a mesh change at
    the same world size gives this job's number)."""
    excluded: tuple[str, ...] = ()
    """Top-level entries a reshard left as they were (``Reshard.exclude``)."""
    not_restored: tuple[str, ...] = ()
    """Saved top-level entries that the live state passed to the restore does not have: a
    subset was restored (also logged at INFO, ``ckpt.recovery.partial``)."""
    not_in_checkpoint: tuple[str, ...] = ()
    """Top-level entries of the live state that the step does not hold, left as they were
    (only with ``missing="keep"``; by default that refuses the restore)."""


class _CallerRelease(Protocol):
    """What ``wait_snapshot`` needs of a save's snapshot: to order the caller after its copies.

    A protocol, so that this module (below the save path) knows nothing of snapshots."""

    def release_by_caller(self, *, block_cpu: bool) -> None: ...


class SaveHandle:
    """The pending result of one ``save()``. Thread-safe; usable from any thread.

    Only the pipeline settles it, through the control it was created with
    (``ckpt_pipeline._save.control.HandleControl``); a handle only reads its outcome.
    """

    def __init__(self, step: int, save_id: str,
                 outcome: concurrent.futures.Future[CommitInfo],
                 snapshot: _CallerRelease | None = None,
                 durable: concurrent.futures.Future[CommitInfo | None] | None = None) -> None:
        self.step = step
        self.save_id = save_id
        self._snapshot = snapshot
        self._future = outcome
        self._durable = durable

    def wait_snapshot(self, *, block_cpu: bool = False) -> None:
        """Order the caller's CUDA streams after this save's copies; check nothing was mutated.

        Call it before the next in-place update of the saved tensors (``optimizer.step()``).
        It blocks the CPU only when ``block_cpu`` is set; otherwise the GPU waits.
        """
        if self._snapshot is not None:
            self._snapshot.release_by_caller(block_cpu=block_cpu)

    def done(self) -> bool:
        """True once the save was committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> CommitInfo:
        """Wait for the commit; raise the save's CheckpointError if it failed."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"save of step {self.step} not finished after {timeout} s") \
                from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def __await__(self) -> Generator[object, None, CommitInfo]:
        """``await handle`` in the async face: ``result()`` without blocking the event loop
        (cancelling the awaiting task leaves the save as it is)."""
        return self._awaited().__await__()

    async def _awaited(self) -> CommitInfo:
        if self._future.done():
            return self.result(0)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # another event loop library: wait in a worker thread
            return await in_thread(None, self.result, abandon_on_cancel=True)
        return await asyncio.shield(asyncio.wrap_future(self._future))

    def durable(self, timeout: float | None = None) -> CommitInfo | None:
        """Wait until the save is durable on disk, or known not to become so.

        Without the memory tier this is ``result()``. With it: the CommitInfo of the step
        committed on disk (a write-through), or None when this save was committed in memory
        only (not due, or skipped while the disk was busy); raises the save's error, or the
        write-through's (the step then stays committed in memory).
        """
        if self._durable is None:
            return self.result(timeout)
        try:
            return self._durable.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"save of step {self.step} not durable after {timeout} s") \
                from None

    def __repr__(self) -> str:
        state = "pending"
        if self._future.done():
            state = ("failed" if self._future.exception() else "committed"
                     if self._future.result().tier == "disk" else "committed in memory")
        return f"SaveHandle(step={self.step}, {state})"
