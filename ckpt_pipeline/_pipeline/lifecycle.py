"""The pipeline's lifecycle: open, run the stages, restore, close.

``AsyncCheckpointPipeline`` runs inside the caller's event loop; ``CheckpointPipeline``
(``blocking.py``) runs the same object in a background thread for synchronous training loops,
through the internal API at the end of the class. The parts it puts together:
``Admission`` (the training-thread part of ``save()``), ``StageRunner`` (the stages, in one
task group), ``Recovery`` (the restore path), a ``Ledger`` they share and an ``Emitter``.

Entering the ``async with`` block checks the root, takes the root lock, scrubs what crashed
saves left, agrees on the run id with the other ranks (``opening.py``) and starts the stages;
leaving it finishes the saves in flight (see ``StageRunner.running``), or abandons them when
cancelled.
"""

from __future__ import annotations

import enum
import os
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from .._lineage import Timeline
from .._logging import log
from .._restore.recovery import AppliedState, Loaded, Recovery
from .._restore.rollback import undone_on_error
from .._save.buffers import DeviceStaging, HostPool
from .._save.job import SaveJob
from .._save.shm_pool import MemoryPool
from .._threads import in_thread
from .._tiers.persistent.promote import Promoter
from .._tiers.persistent.urls import is_url
from .._tiers.replica.replication import Replication
from ..config import PipelineConfig
from ..coordination import Coordinator, DistributedCoordinator, LocalCoordinator
from ..coordination._control_plane import close_coordinator
from ..coordination._hierarchy import job_coordinator
from ..errors import (
    CheckpointError,
    ConfigError,
    PipelineClosedError,
    StepOrderError,
)
from ..handle import Missing, Reshard, RestoreResult, SaveHandle
from ..storage import LocalStorage, Storage
from ..train_state import TrainState
from .admission import Admission
from .emitter import Emitter, Subscriber
from .ledger import Ledger
from .memory_stage import MemoryStage
from .opening import OpenSequence, persist_at_close
from .pool_prep import PoolPrep
from .runner import StageRunner
from .stages import Stages

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..config import PipelineOptions

__all__ = ("AsyncCheckpointPipeline", "PipelineState", "default_coordinator")


class PipelineState(enum.Enum):
    """Where a pipeline is in its life: new, open (saves accepted), closing, closed."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


def memory_channel(coordinator: Coordinator) -> Coordinator:
    """A control channel of its own for the memory tier's commits, beside ``coordinator``'s
    (a write-through's votes and the next memory commit's run at the same time): a second
    gloo group for a DistributedCoordinator (made here, on every rank at the same point), the
    coordinator itself for a single process, ``coordinator.channel("memory")`` for one of
    your own."""
    if isinstance(coordinator, LocalCoordinator):
        return coordinator
    if isinstance(coordinator, DistributedCoordinator):
        return DistributedCoordinator(timeout_s=coordinator.timeout_s)
    channel = getattr(coordinator, "channel", None)
    if channel is None:
        raise ConfigError(
            f"the memory tier needs a second control channel, and {type(coordinator).__name__} "
            "has no channel(name) method", hint="give the coordinator a channel(name) method "
            "returning an independent coordinator of the same ranks, or use memory=None")
    made = channel("memory")
    assert isinstance(made, Coordinator)
    return made


def _cuda_device() -> int | None:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else None


def default_coordinator(config: PipelineConfig) -> Coordinator:
    """When torch.distributed is initialized, a HierarchicalCoordinator if LOCAL_WORLD_SIZE
    makes more than one node, else a DistributedCoordinator; otherwise a local one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return job_coordinator(timeout_s=config.coordination_timeout_s)
    return LocalCoordinator()


class AsyncCheckpointPipeline(anyio.AsyncContextManagerMixin):
    """Asynchronous checkpoint pipeline inside the caller's event loop.

    Use ``async with AsyncCheckpointPipeline(root) as pipe:``; ``save`` returns a
    :class:`SaveHandle` once the tensors are copied (CPU) or their copies are queued (CUDA).
    Options: the keyword options of :class:`PipelineConfig` (applied over ``config=`` when
    both are given).
    """

    def __init__(self, root: str | os.PathLike[str], *, config: PipelineConfig | None = None,
                 storage: Storage | None = None, coordinator: Coordinator | None = None,
                 **options: Unpack[PipelineOptions]) -> None:
        self.config = (config if config is not None else PipelineConfig()).merged(options)
        if storage is None and isinstance(root, str) and is_url(root):
            raise ConfigError(
                f"the checkpoint root {root.split('://', 1)[0]}://... is a URL; the root is a "
                "local directory (node-local disk)",
                hint="give a local directory as the root and the URL as the persistent tier: "
                     "CheckpointPipeline('/local/ckpt', persistent='s3://bucket/run')")
        self.storage: Storage = storage if storage is not None else LocalStorage(root)
        self.coordinator: Coordinator = (
            coordinator if coordinator is not None else default_coordinator(self.config))
        self.rank = self.coordinator.rank  # the job's shape is the coordinator's, never config's
        world_size = self.coordinator.world_size
        self.emitter = Emitter()
        config, root_path, emit = self.config, str(self.storage.root), self.emitter.emit
        self.ledger = Ledger(config.failures, self.rank, root_path)
        self._pool: HostPool | MemoryPool = HostPool(config.buffer_slots)
        self._limiter = anyio.CapacityLimiter(config.io_threads)
        self.timeline = Timeline()
        self.memory: MemoryStage | None = None
        """The memory tier (``memory=``), None without one."""
        if config.memory is not None:
            self._pool = MemoryPool(config.memory.path, self.rank, config.memory.slots)
            self.memory = MemoryStage(
                config.memory, LocalStorage(config.memory.path), self._pool,
                memory_channel(self.coordinator), config.write, self.ledger, emit,
                anyio.CapacityLimiter(config.io_threads),  # its own: a memory commit never
                self.timeline, world_size=world_size)      # queues behind a disk write
        made = [] if coordinator is not None else [self.coordinator]  # closed with the pipeline
        if self.memory is not None and self.memory.coordinator is not self.coordinator:
            made.append(self.memory.coordinator)
        self._made_coordinators = made
        self._staging = DeviceStaging() if config.device_staging else None
        # Without device_staging: a bridge for the saves that find no host buffer made yet.
        self._bridge = (DeviceStaging(transient=True) if config.device_staging is None
                        else None)
        self._pool_state: Mapping[str, Any] | None = None  # a restore's, for _pool_prep
        self._pool_prep = PoolPrep(self._pool, self.rank, config.host_buffer_bytes,
                                   made_by_tier=config.memory is not None
                                   and config.memory.slot_bytes is not None)
        self.admission = Admission(config.snapshot, self.rank, world_size, root_path,
                                   self.ledger, self._pool, self._staging, emit,
                                   bridge=self._bridge)
        self.replication = Replication(self.storage, config.replication, emit, rank=self.rank,
                                       world_size=world_size)
        self.promoter = (None if config.persistent is None
                         else Promoter(self.storage, config.persistent, emit, rank=self.rank,
                                       world_size=world_size, io_threads=config.io_threads))
        self.runner = StageRunner(
            Stages(config.write, config.retention_policy, self.storage, self.coordinator,
                   self.ledger, self._pool, emit, self._limiter, self.replication,
                   self.promoter, self.timeline, self.memory),
            self.ledger, emit, config.queue_depth)
        self._recovery = Recovery(self.storage, self.coordinator, config.restore, emit,
                                  self.replication, self.promoter, self.timeline)
        self.state = PipelineState.NEW

    # ------------------------------------------------------------------ lifecycle

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[AsyncCheckpointPipeline]:
        """Open; on leaving, finish the saves in flight (cancelled: abandon them).

        Left by an exception other than a cancellation, the saves finish first and the
        exception then propagates unchanged: an error of the close itself is logged
        (``ckpt.close.failed``), not raised over it.
        """
        if self.state is not PipelineState.NEW:
            raise PipelineClosedError("a pipeline can be opened once", rank=self.rank)
        self.state = PipelineState.CLOSING  # until the stages run: nothing may be saved
        lock = await OpenSequence(self.storage, self.coordinator, self._limiter,
                                  self.emitter.emit, self.admission, self.ledger,
                                  self.replication, self.promoter, self.timeline).run()
        raised: BaseException | None = None
        try:
            if self.memory is not None:
                await self.memory.open(_cuda_device())
                self._recovery.use_memory(self.memory.storage)
            async with self.runner.running():
                self.state = PipelineState.OPEN
                try:
                    yield self
                except BaseException as exc:
                    raised = exc
                    raise
                finally:
                    self.state = PipelineState.CLOSING
            if self.promoter is not None:
                await persist_at_close(self.promoter, self.coordinator,
                                       self.promoter.config.timeout_s)
        except Exception as error:  # the close itself failed
            if raised is None or error is raised:
                raise
            log.error("ckpt.close.failed", rank=self.rank,
                      error=f"{type(error).__name__}: {error}",
                      hint=f"the {type(raised).__name__} raised in the async with block "
                           "propagates")
        else:
            return
        finally:
            if self.promoter is not None:
                self.promoter.close()
            self.replication.close()
            with anyio.CancelScope(shield=True):
                await in_thread(None, self._pool_prep.wait)
                if self.memory is not None:
                    await self.memory.close(self.storage)
            for made in self._made_coordinators:  # their gloo groups; never raises
                close_coordinator(made)
            self._pool.close()
            for staging in (self._staging, self._bridge):
                if staging is not None:
                    staging.close()
            lock.release()
            self.state = PipelineState.CLOSED
        assert raised is not None
        raise raised  # the block's own exception, after the close failed

    # ------------------------------------------------------------------ saving

    async def save(self, step: int, state: Mapping[str, Any],
                   train_state: TrainState | None = None) -> SaveHandle:
        """Snapshot ``state`` at ``step`` and queue it; the handle resolves at commit."""
        self.check_open("save()", step)
        plan = self.admission.plan(step, state, train_state)
        slot = self.admission.acquire(plan, block=False)
        if slot is None and self.config.when_busy == "block":  # wait off the event loop
            slot = await in_thread(None, self.admission.acquire, plan, True)
        job = self.admission.start(plan, slot)
        await self.runner.submit(job, wait=slot is not None)
        return job.handle

    async def wait_snapshot(self, *, block_cpu: bool = False) -> None:
        """Make the caller's streams wait for every pending snapshot copy; check for mutation.

        Call it before the next in-place update of saved tensors (``optimizer.step()``).
        Returns at once when nothing is being copied.
        """
        self.admission.check_process()
        self.admission.wait_snapshot(block_cpu=block_cpu)

    async def wait(self, timeout: float | None = None) -> None:
        """Wait until every pending save is committed and retention after it is done.

        Then raise the first failure (by step) of the saves that failed since the last
        ``wait()`` returned or raised, whether it settled before this call or during it; the
        next ``wait()`` does not raise it again (nor a failure that ``save()`` already raised
        under ``max_failures_in_row``). Raises TimeoutError if a save is still pending after
        ``timeout`` seconds (its failure, if any, is then raised by a later ``wait()``). Under
        ``strict``, a save committed without all its copies raises too.
        """
        self.admission.check_process()
        await self.runner.wait_pending(timeout, raise_errors=False)
        first = self.ledger.take_failures()
        if first is not None:
            self.ledger.reported()
            raise first
        if self.config.strict:
            self.ledger.raise_if_failures_due(None)

    def pending_steps(self) -> list[int]:
        """Steps still in the pipeline (not yet committed and retained, or failed)."""
        return [h.step for h in self.ledger.pending_handles()]

    async def latest_step(self) -> int | None:
        """The newest step committed by this rank (None when there is none)."""
        self.admission.check_process()
        return self.ledger.latest_committed

    @property
    def host_memory_bytes(self) -> int:
        """Bytes held by the host buffer pool (allocated on the first save, then reused)."""
        return self._pool.allocated_bytes

    @property
    def host_memory_pinned(self) -> bool:
        return self._pool.pinned

    @property
    def device_memory_bytes(self) -> int:
        """Bytes of GPU memory held by the device staging buffers (``device_staging``), and
        by a transient one a save holds while its host buffer is made."""
        return sum(s.allocated_bytes for s in (self._staging, self._bridge) if s is not None)

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(event)`` for every event (from the thread that emits it).

        Returns a function that unsubscribes. A callback that raises is logged once and kept.
        """
        return self.emitter.subscribe(callback)

    # ------------------------------------------------------------------ restoring

    async def restore_latest(self, state: MutableMapping[str, Any], *,
                             restore_rng: bool | None = None,
                             missing: Missing = "refuse",
                             reshard: Reshard | None = None) -> RestoreResult | None:
        """Load the newest step that every rank holds and verifies into ``state`` in place.

        A corrupt, truncated or incomplete step is reported (``CheckpointRejected``) and the
        next older one is tried. Returns None when there is nothing to restore; raises
        RestoreError when checkpoints exist but none can be loaded. A restore that raises
        leaves ``state`` (and the RNG states) as they were, on every rank. ``restore_rng``:
        load the saved RNG states too (None: the pipeline's ``restore_rng``). Saved entries
        that ``state`` lacks are not restored (``RestoreResult.not_restored``); entries of
        ``state`` the step lacks refuse the restore, unless ``missing="keep"`` (they keep their
        values: ``RestoreResult.not_in_checkpoint``). A step saved by another number of ranks,
        or on another mesh, is resharded onto the live layout; ``reshard`` says what happens
        to the RNG streams and the values saved per rank then (see ``Reshard``; None: its
        defaults).
        """
        return await self.restore(state, None, restore_rng=restore_rng, missing=missing,
                                  reshard=reshard)

    async def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                      restore_rng: bool | None = None,
                      missing: Missing = "refuse",
                      reshard: Reshard | None = None) -> RestoreResult | None:
        """``restore_latest``, or with ``step`` that step and no other: RestoreError when it
        is not held and valid on every rank, or does not load (nothing else is tried).

        Steps newer than the restored one are moved aside (kept, invisible to later scans),
        as the run goes on from the restored step.
        """
        loaded = await self.load_for_restore(state, step, restore_rng=restore_rng,
                                             missing=missing, reshard=reshard)
        if loaded is None:
            return None
        applied, apply_error = self.apply_restore(loaded, state)
        with undone_on_error(applied):  # every rank rolls back when any rank failed
            return await self.finish_restore(loaded, apply_error)

    # ------------------------------------------------------------------ internal API
    # Used by the blocking face (``blocking.py``), not part of the public interface.

    def check_open(self, what: str, step: int | None = None) -> None:
        """Raise unless the pipeline is open and this is the process that opened it."""
        self.admission.check_process()
        if self.state is not PipelineState.OPEN:
            raise PipelineClosedError(f"{what} on a pipeline that is not open", step=step,
                                      rank=self.rank, hint="open a new pipeline")

    async def load_for_restore(self, state: Mapping[str, Any], step: int | None = None, *,
                               restore_rng: bool | None = None,
                               missing: Missing = "refuse",
                               reshard: Reshard | None = None) -> Loaded | None:
        """Begin a restore: wait for the saves in flight, then read the newest good step.

        From here until ``finish_restore`` (or until this returns None or raises), saves are
        refused with PipelineBusyError, so that nothing the restore scanned changes under it
        and it never moves aside a step that a save of this pipeline is writing.
        """
        self.check_open("restore()" if step is not None else "restore_latest()", step)
        if step is not None and (type(step) is not int or step < 0):
            raise StepOrderError(f"step must be a non-negative int, got {step!r}",
                                 rank=self.rank)
        await in_thread(None, self.ledger.begin_restore)
        try:
            await self.runner.wait_pending(None, raise_errors=False)
            loaded = await self._recovery.load_latest(state, self._limiter, step=step,
                                                      restore_rng=restore_rng,
                                                      missing=missing, reshard=reshard)
        except BaseException:
            self.ledger.end_restore()
            raise
        if loaded is None:
            self._pool_prep.from_state(state)  # a fresh job's first size (see pool_prep)
            self.ledger.end_restore()
        else:  # once the restore is done: making it would compete with the apply
            self._pool_state = state
        return loaded

    def apply_restore(self, loaded: Loaded, state: MutableMapping[str, Any]
                      ) -> tuple[AppliedState | None, CheckpointError | None]:
        """Load into the live state on the caller's thread: (what can undo it, None), or
        (None, the error) once a failed apply is undone. Whoever gets an AppliedState undoes
        it (on the caller's thread) if ``finish_restore`` raises, else releases it."""
        try:
            return self._recovery.apply(loaded, state), None
        except CheckpointError as exc:
            return None, exc

    async def finish_restore(self, loaded: Loaded,
                             apply_error: CheckpointError | None) -> RestoreResult:
        """Every rank votes on its apply; raises if any failed (each caller then undoes)."""
        restored: int | None = None
        try:
            result = await self._recovery.finish(loaded, apply_error, self._limiter)
            restored = loaded.step
            if self.memory is not None:
                await self.memory.after_restore(loaded.step)
        finally:
            self.ledger.end_restore(restored)
            state, self._pool_state = self._pool_state, None
            if state is not None:  # the first save's size (see pool_prep)
                self._pool_prep.from_state(state)
        return result

    def abandon(self, job: SaveJob, error: CheckpointError) -> None:
        """Fail a job that could not be handed to the stages (the loop stopped)."""
        self.runner.abandon(job, error)

