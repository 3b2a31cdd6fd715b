"""The pipeline's lifecycle: open, run the stages, restore, close.

``AsyncCheckpointPipeline`` runs inside the caller's event loop; ``CheckpointPipeline``
(``blocking.py``) runs the same object in a background thread for synchronous training loops,
through the internal API at the end of the class. The parts it puts together:
``Admission`` (the training-thread part of ``save()``), ``StageRunner`` (the stages, in one
task group), ``Recovery`` (the restore path), a ``Ledger`` they share and an ``Emitter``.

Entering the ``async with`` block checks the root, takes the root lock, scrubs what crashed
saves left, agrees on the run id with the other ranks and starts the stages; leaving it
finishes the saves in flight (see ``StageRunner.running``), or abandons them when cancelled.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio

from .._format import scan as _scan
from .._lineage import Timeline, local_timeline, read_rewinds
from .._logging import log
from .._restore.recovery import AppliedState, Loaded, Recovery
from .._restore.rollback import undone_on_error
from .._save.buffers import DeviceStaging, HostPool
from .._save.job import SaveJob
from .._threads import in_thread
from .._tiers.persistent.promote import Promoter
from .._tiers.persistent.remote import is_url
from .._tiers.replica.replication import Replication
from ..config import PipelineConfig
from ..coordination import Coordinator, DistributedCoordinator, LocalCoordinator
from ..coordination._agree import agree_open, gather_parts, gather_shared
from ..errors import (
    CheckpointError,
    ConfigError,
    PersistentInUseError,
    PipelineClosedError,
    StepOrderError,
)
from ..events import TemporariesScrubbed
from ..handle import RestoreResult, SaveHandle
from ..storage import LocalStorage, Storage
from ..train_state import TrainState
from .admission import Admission
from .emitter import Emitter, Subscriber
from .ledger import Ledger
from .rootlock import RootLock
from .runner import StageRunner
from .stages import Stages

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..config import PipelineOptions

__all__ = ("AsyncCheckpointPipeline", "PipelineState", "default_coordinator", "make_config")


class PipelineState(enum.Enum):
    """Where a pipeline is in its life: new, open (saves accepted), closing, closed."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


def default_coordinator(config: PipelineConfig) -> Coordinator:
    """A DistributedCoordinator when torch.distributed is initialized, else a local one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return DistributedCoordinator(timeout_s=config.coordination_timeout_s)
    return LocalCoordinator()


def make_config(config: PipelineConfig | None, options: Mapping[str, Any]) -> PipelineConfig:
    """Merge keyword options into a config; unknown names fail with the valid ones listed."""
    base = config if config is not None else PipelineConfig()
    fields = set(PipelineConfig.__dataclass_fields__)
    unknown = set(options) - fields
    if unknown:
        raise ConfigError(f"unknown option(s) {sorted(unknown)}",
                          hint=f"valid options: {sorted(fields)}")
    return replace(base, **options) if options else base


class AsyncCheckpointPipeline(anyio.AsyncContextManagerMixin):
    """Asynchronous checkpoint pipeline inside the caller's event loop.

    Use ``async with AsyncCheckpointPipeline(root) as pipe:``; ``save`` returns a
    :class:`SaveHandle` once the tensors are copied (CPU) or their copies are queued (CUDA).
    Options: keyword arguments named like the fields of :class:`PipelineConfig`, or
    ``config=``.
    """

    def __init__(self, root: str | os.PathLike[str], *, config: PipelineConfig | None = None,
                 storage: Storage | None = None, coordinator: Coordinator | None = None,
                 **options: Unpack[PipelineOptions]) -> None:
        self.config = make_config(config, options)
        if storage is None and isinstance(root, str) and is_url(root):
            raise ConfigError(
                f"the checkpoint root {root.split('://', 1)[0]}://... is a URL; the root is a "
                "local directory (node-local disk)",
                hint="give a local directory as the root and the URL as the persistent tier: "
                     "CheckpointPipeline('/local/ckpt', persistent='s3://bucket/run')")
        self.storage: Storage = storage if storage is not None else LocalStorage(root)
        self.coordinator: Coordinator = (
            coordinator if coordinator is not None else default_coordinator(self.config))
        if (self.coordinator.rank, self.coordinator.world_size) != (
            self.config.rank, self.config.world_size
        ):
            self.config = replace(self.config, rank=self.coordinator.rank,
                                  world_size=self.coordinator.world_size)
        self.rank = self.config.rank
        root_path = str(self.storage.root)
        self.emitter = Emitter()
        self.ledger = Ledger(self.config, self.rank, root_path)
        self._pool = HostPool(self.config.buffer_slots)
        self._staging = DeviceStaging() if self.config.device_staging else None
        self.admission = Admission(self.config, root_path, self.ledger, self._pool,
                                   self._staging, self.emitter.emit)
        self._limiter = anyio.CapacityLimiter(self.config.io_threads)
        self.replication = Replication(self.storage, self.config, self.emitter.emit)
        self.promoter = (None if self.config.persistent is None
                         else Promoter(self.storage, self.config, self.emitter.emit))
        self.timeline = Timeline()
        self.runner = StageRunner(
            Stages(self.config, self.storage, self.coordinator, self.ledger, self._pool,
                   self.emitter.emit, self._limiter, self.replication, self.promoter,
                   self.timeline),
            self.ledger, self.emitter.emit, self.config.queue_depth)
        self._recovery = Recovery(self.storage, self.coordinator, self.config,
                                  self.emitter.emit, self.replication, self.promoter,
                                  self.timeline)
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
        lock = await self._prepare()
        raised: BaseException | None = None
        try:
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
                await self._persist_at_close()
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
            self._pool.close()
            if self._staging is not None:
                self._staging.close()
            lock.release()
            self.state = PipelineState.CLOSED
        assert raised is not None
        raise raised  # the block's own exception, after the close failed

    async def _persist_at_close(self) -> None:
        """After a clean close: promote the newest committed step (``persist_on_close``), wait
        for the uploads, let every rank report, so that rank 0 commits what every rank
        finished, and wait for those commit objects: all of it within ``persist_timeout_s``
        (and the exchange's ``coordination_timeout_s``). What did not end by then is never
        committed, and is reported by ``Promoter.close``. Failures are logged: the local tier
        holds every committed step whatever happens here."""
        promoter = self.promoter
        assert promoter is not None
        promoter.closing()
        try:
            timeout = self.config.persist_timeout_s
            deadline = anyio.current_time() + timeout
            finished = await anyio.to_thread.run_sync(promoter.wait, timeout,
                                                      abandon_on_cancel=True)
            reports = await gather_parts(self.coordinator, promoter.key, promoter.ballot(),
                                         what="persist at close")
            promoter.on_reports(reports)
            left = max(0.0, deadline - anyio.current_time())
            finished = await anyio.to_thread.run_sync(
                functools.partial(promoter.wait, left, uploads=False),
                abandon_on_cancel=True) and finished
            if not finished:
                log.warning("ckpt.persist.close_timeout", rank=self.rank, url=promoter.url,
                            timeout_s=timeout)
            if finished:  # a commit object still in flight keeps the URL held: no release
                await anyio.to_thread.run_sync(promoter.release, abandon_on_cancel=True)
        except CheckpointError as exc:
            log.error("ckpt.persist.close_failed", rank=self.rank, url=promoter.url,
                      error=exc.message)

    async def _open_persistent(self, promoter: Promoter) -> None:
        """Open the persistent tier on every rank (rank 0 takes the URL: its owner object).
        A refusal (``PersistentInUseError``) is raised on every rank, so that none waits for
        rank 0 in the next agreement."""
        refused: PersistentInUseError | None = None
        try:
            await in_thread(self._limiter, promoter.open)
        except PersistentInUseError as exc:
            refused = exc
        answers = await gather_shared(self.coordinator,
                                      None if refused is None else refused.message,
                                      what="persistent owner")
        if refused is not None:
            raise refused
        if answers and isinstance(answers[0], str):
            raise PersistentInUseError(answers[0], rank=self.rank,
                                       hint="rank 0 was refused the persistent URL; see its "
                                            "error")

    async def _prepare(self) -> RootLock:
        """Check the root, take the root lock, scrub, agree on the run id; return the lock."""
        await in_thread(self._limiter, self.storage.ensure_root)
        # One job per root and rank: a second live opener is refused (RootInUseError).
        lock = await in_thread(self._limiter, RootLock.acquire, self.storage.root, self.rank)
        try:
            for path, size in await in_thread(self._limiter, _scan.scrub, self.storage,
                                              self.rank):
                self.emitter.emit(TemporariesScrubbed(step=-1, rank=self.rank, path=path,
                                                      bytes=size))
            # After the scrub: the agreement is also a barrier, so that no rank's first save
            # can create a step directory that another rank's scrub (of a shared root) removes.
            # It also tells every rank where the others' copy servers are (replication).
            if self.promoter is not None:
                await self._open_persistent(self.promoter)
            opening = await agree_open(self.coordinator, self.replication.node,
                                       await self.replication.serve(self._limiter))
            self.replication.start(opening)
            self.admission.run_id = opening.run_id
            await self._open_timeline()
            committed = await in_thread(self._limiter, _scan.committed_steps, self.storage,
                                        self.rank)
            self.ledger.resume_at(max(committed, default=None))
        except BaseException:
            if self.promoter is not None:
                self.promoter.close()  # its heartbeat stops: the URL is not held any more
            self.replication.close()
            lock.release()
            raise
        return lock

    async def _open_timeline(self) -> None:
        """Agree on the timeline the commits carry until a restore (the newest any rank's
        records name); rank 0 records in the persistent tier any rewind its root records
        that the tier lacks (one left pending by an outage)."""
        rewinds = await in_thread(self._limiter, read_rewinds, self.storage)
        mine = await in_thread(self._limiter, local_timeline, self.storage, self.rank)
        answers = await gather_shared(self.coordinator, mine, what="open timeline")
        self.timeline.timeline = max((a for a in answers if type(a) is int), default=0)
        if self.promoter is not None and rewinds:
            await in_thread(self._limiter, self.promoter.rewound, rewinds)

    # ------------------------------------------------------------------ saving

    async def save(self, step: int, state: Mapping[str, Any],
                   train_state: TrainState | None = None) -> SaveHandle:
        """Snapshot ``state`` at ``step`` and queue it; the handle resolves at commit."""
        self.check_open("save()", step)
        plan = self.admission.plan(step, state, train_state)
        slot = self.admission.acquire(plan, block=False)
        if slot is None and self.config.when_busy == "block":  # wait off the event loop
            slot = await anyio.to_thread.run_sync(self.admission.acquire, plan, True)
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
        """Bytes of GPU memory held by the device staging buffers (``device_staging``)."""
        return 0 if self._staging is None else self._staging.allocated_bytes

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(event)`` for every event (from the thread that emits it).

        Returns a function that unsubscribes. A callback that raises is logged once and kept.
        """
        return self.emitter.subscribe(callback)

    # ------------------------------------------------------------------ restoring

    async def restore_latest(self, state: MutableMapping[str, Any], *,
                             restore_rng: bool | None = None) -> RestoreResult | None:
        """Load the newest step that every rank holds and verifies into ``state`` in place.

        A corrupt, truncated or incomplete step is reported (``CheckpointRejected``) and the
        next older one is tried. Returns None when there is nothing to restore; raises
        RestoreError when checkpoints exist but none can be loaded. A restore that raises
        leaves ``state`` (and the RNG states) as they were, on every rank. ``restore_rng``:
        load the saved RNG states too (None: the pipeline's ``restore_rng``).
        """
        return await self.restore(state, None, restore_rng=restore_rng)

    async def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                      restore_rng: bool | None = None) -> RestoreResult | None:
        """``restore_latest``, or with ``step`` that step and no other: RestoreError when it
        is not held and valid on every rank, or does not load (nothing else is tried).

        Steps newer than the restored one are moved aside (kept, invisible to later scans),
        as the run goes on from the restored step.
        """
        loaded = await self.load_for_restore(state, step, restore_rng=restore_rng)
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
                               restore_rng: bool | None = None) -> Loaded | None:
        """Begin a restore: wait for the saves in flight, then read the newest good step.

        From here until ``finish_restore`` (or until this returns None or raises), saves are
        refused with PipelineBusyError, so that nothing the restore scanned changes under it
        and it never moves aside a step that a save of this pipeline is writing.
        """
        self.check_open("restore()" if step is not None else "restore_latest()", step)
        if step is not None and (type(step) is not int or step < 0):
            raise StepOrderError(f"step must be a non-negative int, got {step!r}",
                                 rank=self.rank)
        await anyio.to_thread.run_sync(self.ledger.begin_restore)
        try:
            await self.runner.wait_pending(None, raise_errors=False)
            loaded = await self._recovery.load_latest(state, self._limiter, step=step,
                                                      restore_rng=restore_rng)
        except BaseException:
            self.ledger.end_restore()
            raise
        if loaded is None:
            self.ledger.end_restore()
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
        finally:
            self.ledger.end_restore(restored)
        return result

    def abandon(self, job: SaveJob, error: CheckpointError) -> None:
        """Fail a job that could not be handed to the stages (the loop stopped)."""
        self.runner.abandon(job, error)

