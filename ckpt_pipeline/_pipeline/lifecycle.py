"""The pipeline: stages connected by bounded streams, owned by one task group.

``AsyncCheckpointPipeline`` runs inside the caller's event loop. ``CheckpointPipeline``
(``blocking.py``) runs the same object in a background thread for synchronous training loops.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._crash import crash_point
from .._format.codec import DTYPE_NAMES, encode_tree
from .._logging import log
from .._restore import scan as _recovery
from .._restore.apply import undone_on_error
from .._restore.recovery import AppliedState, Loaded, Recovery
from .._save.commit import commit
from .._save.copy import (
    DeviceStaging,
    HostPool,
    Slot,
    begin_streamed_snapshot,
    plan_layout,
    take_snapshot,
)
from .._save.job import SaveJob
from .._save.retain import Pruned, PruneFailed, clear_marker, prune, write_marker
from .._save.seal import remove_published, write_shard
from .._save.write_data import serialize
from .._tree import FlatState, flatten_state
from ..config import PipelineConfig
from ..coordination import Coordinator, DistributedCoordinator, LocalCoordinator
from ..coordination._agree import agree_run_id
from ..errors import (
    CheckpointError,
    ConfigError,
    ForkedProcessError,
    PipelineBusyError,
    PipelineClosedError,
    PoolBusyError,
    SaveError,
    StateError,
    StepOrderError,
)
from ..events import (
    CheckpointCommitted,
    CheckpointPruned,
    Event,
    RetentionFailed,
    SaveFailed,
    SaveRequested,
    SaveSkipped,
    ShardSerialized,
    ShardWritten,
    SnapshotTaken,
    TemporariesScrubbed,
)
from ..handle import CommitInfo, RestoreResult, SaveHandle
from ..storage import LocalStorage, Storage
from ..train_state import RNGState, TrainState
from .rootlock import RootLock

__all__ = ("AsyncCheckpointPipeline",)

_log = log
Subscriber = Callable[[Event], None]


@dataclass(frozen=True, slots=True)
class _Plan:
    """A validated save, before it has a host slot."""

    step: int
    started: float
    flat: FlatState
    tree: bytes
    train_state: dict[str, Any]
    offsets: list[int]
    data_length: int
    pinned: bool
    streamed: bool


def _check_streamable(flat: FlatState, step: int, rank: int) -> None:
    """A streamed save copies byte ranges of each tensor: they must be contiguous."""
    for tensor, path in zip(flat.tensors, flat.paths):
        if not tensor.is_contiguous():
            raise StateError(
                f"tensor {path} is not contiguous; a state larger than host_buffer_bytes is "
                "copied in byte ranges", step=step, rank=rank, path=path,
                hint="make it contiguous, or set host_buffer_bytes=None (a buffer as large "
                     "as the state)")


def default_coordinator(config: PipelineConfig) -> Coordinator:
    """A DistributedCoordinator when torch.distributed is initialized, else a local one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return DistributedCoordinator(timeout_s=config.coordination_timeout_s)
    return LocalCoordinator()


def make_config(keep_last: int | None, config: PipelineConfig | None,
                options: Mapping[str, Any]) -> PipelineConfig:
    """Merge keyword options into a config; unknown names fail with the valid ones listed."""
    base = config if config is not None else PipelineConfig()
    fields = set(PipelineConfig.__dataclass_fields__)
    unknown = set(options) - fields
    if unknown:
        raise ConfigError(f"unknown option(s) {sorted(unknown)}",
                          hint=f"valid options: {sorted(fields)}")
    merged = dict(options)
    if keep_last is not None:
        merged["keep_last"] = keep_last
    return replace(base, **merged) if merged else base


class AsyncCheckpointPipeline:
    """Asynchronous checkpoint pipeline inside the caller's event loop.

    Use ``async with AsyncCheckpointPipeline(root) as pipe:``; ``save`` returns a
    :class:`SaveHandle` once the tensors are copied (CPU) or their copies are queued (CUDA).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        config: PipelineConfig | None = None,
        storage: Storage | None = None,
        coordinator: Coordinator | None = None,
        **options: Any,
    ) -> None:
        self.config = make_config(keep_last, config, options)
        self.storage: Storage = storage if storage is not None else LocalStorage(root)
        self.coordinator: Coordinator = (
            coordinator if coordinator is not None else default_coordinator(self.config))
        if (self.coordinator.rank, self.coordinator.world_size) != (
            self.config.rank, self.config.world_size
        ):
            self.config = replace(self.config, rank=self.coordinator.rank,
                                  world_size=self.coordinator.world_size)
        self.rank = self.config.rank
        self._pool = HostPool(self.config.buffer_slots)
        self._staging = DeviceStaging() if self.config.device_staging else None
        self._recovery = Recovery(self.storage, self.coordinator, self.config, self._emit)
        self._subscribers: tuple[Subscriber, ...] = ()
        self._subscriber_failures: dict[int, int] = {}
        self._lock = threading.Lock()
        self._admission = threading.Lock()  # save admission vs the start of a restore
        self._pending: dict[int, SaveHandle] = {}
        self._snapshots: list[SaveHandle] = []
        self._last_step: int | None = None
        self._failures_in_row = 0
        self._unreported: CheckpointError | None = None  # the latest failure, for the policy
        self._latest_committed: int | None = None
        self._run_id = ""
        self._state = "new"
        self._tg: TaskGroup | None = None
        self._send: MemoryObjectSendStream[SaveJob] | None = None
        self._backlog: collections.deque[tuple[SaveJob, anyio.Event]] = collections.deque()
        self._feeding = False
        self._restoring = False
        self._pid = os.getpid()
        self._limiter: anyio.CapacityLimiter | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> AsyncCheckpointPipeline:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        """Close on leaving the block (see ``aclose``).

        Left by a cancellation, the pending saves are abandoned, as if ``aclose()`` itself
        were cancelled (a native asyncio cancellation is delivered once, so the block's exit
        would not see it again). Left by another exception, they finish first and the
        exception then propagates unchanged: an error of the close itself is logged
        (``ckpt.close.failed``), not raised over it.
        """
        if (exc is not None and self._state == "open" and self._tg is not None
                and isinstance(exc, anyio.get_cancelled_exc_class())):
            self._tg.cancel_scope.cancel()  # the wait in aclose() then ends at once
        try:
            await self.aclose()
        except Exception as error:
            if exc is None:
                raise
            _log.error("ckpt.close.failed", rank=self.rank,
                       error=f"{type(error).__name__}: {error}",
                       hint=f"the {type(exc).__name__} raised in the async with block "
                            "propagates")

    async def open(self) -> None:
        """Check the root, scrub leftovers of crashed saves, and start the stages."""
        if self._state != "new":
            raise PipelineClosedError("a pipeline can be opened once", rank=self.rank)
        self._limiter = anyio.CapacityLimiter(self.config.io_threads)
        await self._thread(self.storage.ensure_root)
        # One job per root and rank: a second live opener is refused (RootInUseError).
        self._root_lock = await self._thread(RootLock.acquire, self.storage.root, self.rank)
        try:
            await self._start()
        except BaseException:
            self._root_lock.release()
            raise

    async def _start(self) -> None:
        for path, size in await self._thread(_recovery.scrub, self.storage, self.rank):
            self._emit(TemporariesScrubbed(step=-1, rank=self.rank, path=path, bytes=size))
        # After the scrub: the agreement is also a barrier, so that no rank's first save can
        # create a step directory that another rank's scrub (of a shared root) then removes.
        self._run_id = await agree_run_id(self.coordinator)
        committed = await self._thread(_recovery.committed_steps, self.storage, self.rank)
        self._latest_committed = max(committed, default=None)
        self._last_step = self._latest_committed
        depth = self.config.queue_depth
        send, receive = anyio.create_memory_object_stream[SaveJob](depth)
        self._send = send
        # What a cancelled aclose() must abandon and clean up: the jobs queued for the first
        # stage (read back through this clone of its input) and those a stage has taken
        # (tracked until they settle: a job holds an open file and temporaries on its way).
        self._queued: MemoryObjectReceiveStream[SaveJob] = receive.clone()
        working: dict[int, SaveJob] = {}
        self._working = working

        def tracked(work: Callable[[SaveJob], Awaitable[None]],
                    last: bool) -> Callable[[SaveJob], Awaitable[None]]:
            async def run(job: SaveJob) -> None:
                for key in [k for k, j in working.items() if j.handle._settled.is_set()]:
                    del working[key]
                working[id(job)] = job
                try:
                    await work(job)
                finally:
                    if last:  # retention settles the job, whatever happens
                        working.pop(id(job), None)

            return run

        stages: list[tuple[str, Callable[[SaveJob], Awaitable[None]]]] = [
            ("snapshot", self._snapshot_stage),
            ("serialize", self._serialize_stage),
            ("write", self._write_stage),
            ("commit", self._commit_stage),
            ("retain", self._retain_stage),
        ]
        # The stages run shielded: a cancellation around the pipeline does not cut a save
        # short by itself; aclose() decides (it finishes the saves, or, cancelled itself,
        # cancels these scopes and abandons them). The caller may wait for them first.
        scopes: list[anyio.CancelScope] = []
        self._stage_scopes = scopes

        async def shielded(name: str, receive: MemoryObjectReceiveStream[SaveJob],
                           send: MemoryObjectSendStream[SaveJob] | None,
                           work: Callable[[SaveJob], Awaitable[None]], *,
                           task_status: anyio.abc.TaskStatus[None]) -> None:
            with anyio.CancelScope(shield=True) as scope:
                scopes.append(scope)
                await self._run_stage(name, receive, send, work, task_status=task_status)

        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            for index, (name, work) in enumerate(stages):
                if index < len(stages) - 1:
                    next_send, next_receive = anyio.create_memory_object_stream[SaveJob](depth)
                else:
                    next_send, next_receive = None, None
                await tg.start(shielded, name, receive, next_send,
                               tracked(work, index == len(stages) - 1))
                if next_receive is not None:
                    receive = next_receive
        except BaseException:  # cancelled while starting: stop what started, leave no task
            tg.cancel_scope.cancel()
            for scope in scopes:
                scope.cancel()
            send.close()
            self._queued.close()
            await tg.__aexit__(None, None, None)
            raise
        self._tg = tg
        self._state = "open"

    async def aclose(self) -> None:
        """Finish every pending save, then stop the stages. Idempotent.

        Cancelled while it waits (or called as a cancelled ``async with`` block is left), it
        abandons the pending saves instead: the stages stop once the I/O call in progress
        returns (a commit already started completes, shielded), each abandoned save's files
        are removed (temporaries and anything published: no commit record was) and its
        handle raises PipelineClosedError (``SaveFailed`` with stage ``"close"``). Nothing
        partial is published either way; the cancellation then propagates.
        """
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closing"
        assert self._send is not None and self._tg is not None
        tg, cancelled = self._tg, anyio.get_cancelled_exc_class()
        stopped: BaseException | None = None
        try:
            await self._wait_pending(None, raise_errors=False)
        except BaseException as exc:  # cancelled (or interrupted): abandon what is pending
            stopped = exc
            tg.cancel_scope.cancel()
            for scope in self._stage_scopes:
                scope.cancel()
        why = ("cancelled" if isinstance(stopped, cancelled)
               else "the stages stopped" if stopped is None
               else f"interrupted by {type(stopped).__name__}")
        try:
            self._send.close()
            if isinstance(stopped, cancelled):
                if await tg.__aexit__(type(stopped), stopped, stopped.__traceback__):
                    stopped = None  # the pipeline's own cancellation (__aexit__): consumed
            else:
                await tg.__aexit__(None, None, None)
        finally:
            # Every stage has ended: whatever did not settle was abandoned mid-way.
            jobs = list(self._working.values())
            jobs.extend(job for job, _ in self._backlog)
            self._backlog.clear()
            while True:
                try:
                    jobs.append(self._queued.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
            self._queued.close()
            self._working.clear()
            left = [job for job in jobs if not job.handle._settled.is_set()]
            if left:
                _log.warning("ckpt.close.cancelled", rank=self.rank,
                             steps=sorted(job.step for job in left if not job.committed),
                             reason=why, hint="these saves were abandoned and their files "
                                              "removed; the previous checkpoint is intact")
            with anyio.CancelScope(shield=True):
                for job in left:
                    if job.committed:  # committed before retention ran: it stays
                        self._settle(job)
                        continue
                    try:
                        await self._thread(remove_published, job, self.storage)
                    except Exception as exc:
                        _log.error("ckpt.close.cleanup_failed", step=job.step,
                                   rank=self.rank, error=f"{type(exc).__name__}: {exc}")
                    self._abandon(job, job.error or PipelineClosedError(
                        f"save abandoned: the pipeline closed ({why}) before step "
                        f"{job.step} was committed", step=job.step, rank=self.rank,
                        path=str(self.storage.root),
                        hint="nothing of it was published; the previous checkpoint is "
                             "intact"), "close")
                if left:  # a file created just as a stage was cancelled is not in its job
                    try:
                        scrubbed = await self._thread(_recovery.scrub, self.storage,
                                                      self.rank)
                    except Exception as exc:
                        _log.error("ckpt.close.cleanup_failed", rank=self.rank,
                                   error=f"{type(exc).__name__}: {exc}")
                        scrubbed = []
                    for path, size in scrubbed:
                        self._emit(TemporariesScrubbed(step=-1, rank=self.rank, path=path,
                                                       bytes=size))
            with self._lock:
                orphans = list(self._pending.values())
            for handle in orphans:  # not expected: every job is queued or tracked
                handle._fail(PipelineClosedError(
                    f"save abandoned: the pipeline closed ({why})", step=handle.step,
                    rank=self.rank))
                with self._lock:
                    self._pending.pop(handle.step, None)
                handle._settled.set()
            self._pool.close()
            if self._staging is not None:
                self._staging.close()
            self._root_lock.release()
            self._state = "closed"
        if stopped is not None:
            raise stopped

    # ------------------------------------------------------------------ save

    async def save(self, step: int, state: Mapping[str, Any],
                   train_state: TrainState | None = None) -> SaveHandle:
        """Snapshot ``state`` at ``step`` and queue it; the handle resolves at commit."""
        plan = self._plan_save(step, state, train_state)
        slot = self._acquire(plan, block=False)
        if slot is None and self.config.when_busy == "block":  # wait off the event loop
            slot = await anyio.to_thread.run_sync(self._acquire, plan, True)
        return await self._submit(self._start_save(plan, slot))

    async def _submit(self, job: SaveJob, *, wait: bool = True) -> SaveHandle:
        """Hand a job to the first stage, in the order of the calls.

        When the stage's queue is full, the job waits in a backlog that one task feeds in
        order; ``wait=False`` (a skipped save, which must vote in its place but must never
        block the caller) returns at once, the others once their job is queued.
        """
        if self._send is None or self._state != "open":
            self._abandon(job, PipelineClosedError("the pipeline is closed", step=job.step,
                                                   rank=self.rank))
            return job.handle
        if not self._backlog:
            try:
                self._send.send_nowait(job)
            except anyio.WouldBlock:
                pass
            else:
                crash_point("save.requested")
                return job.handle
        queued = anyio.Event()
        self._backlog.append((job, queued))
        if not self._feeding:
            assert self._tg is not None
            self._feeding = True
            self._tg.start_soon(self._feed_backlog)
        if wait:
            await queued.wait()
            crash_point("save.requested")
        return job.handle

    async def _feed_backlog(self) -> None:
        assert self._send is not None
        try:
            while self._backlog:
                job, queued = self._backlog[0]
                await self._send.send(job)
                self._backlog.popleft()
                queued.set()
        finally:
            self._feeding = False

    def _check_step_order(self, step: int) -> None:
        """Raise unless ``step`` is greater than the last one saved; call under ``_lock``."""
        last = self._last_step
        if last is not None and step <= last:
            raise StepOrderError(
                f"step {step} is not greater than the last saved step {last}", step=step,
                rank=self.rank, path=str(self.storage.root),
                hint="save increasing steps; to start over, use a new root")

    def _plan_save(self, step: int, state: Mapping[str, Any],
                   train_state: TrainState | None) -> _Plan:
        """Training-thread part one: validate, capture RNG, flatten and encode, lay out.

        Bad input raises here, before anything is copied or written.
        """
        started = time.perf_counter()
        self._check_process()
        if self._state != "open":
            raise PipelineClosedError("save() after close()", step=step, rank=self.rank,
                                      hint="open a new pipeline")
        self._check_not_restoring("save()", step)
        self._apply_failure_policy(step)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StepOrderError(f"step must be a non-negative int, got {step!r}",
                                 rank=self.rank)
        with self._lock:
            self._check_step_order(step)
        ts = train_state if train_state is not None else TrainState(step=step)
        if not isinstance(ts, TrainState):
            raise StateError(f"train_state must be a TrainState, got {type(ts).__name__}",
                             step=step, rank=self.rank)
        if ts.step != step:
            raise StateError(f"train_state.step is {ts.step} but the save is for step {step}",
                             step=step, rank=self.rank,
                             hint="advance the TrainState to this step before saving")
        if self.config.capture_rng:
            ts = ts.with_rng(RNGState.capture())
        from .._format.limits import check_byte_copyable, check_save

        try:
            flat = flatten_state(state, step=step)
        except StateError as exc:
            if exc.rank is None:
                exc.rank = self.rank
            raise
        ts_plain = ts.to_plain()
        try:
            tree = encode_tree(flat.skeleton)
        except (TypeError, ValueError, OverflowError) as exc:
            raise StateError(f"a value cannot be encoded: {exc}", step=step, rank=self.rank,
                             hint="non-tensor leaves must be plain values") from exc
        offsets, data_length = plan_layout(flat.tensors)
        # Every limit a reader enforces (the table in _limits), before anything is written.
        check_save(flat, tree, ts_plain, step=step, rank=self.rank,
                   world_size=self.config.world_size, save_id=f"{self._run_id}-{step}",
                   chunk_bytes=self.config.chunk_bytes, offsets=offsets,
                   data_length=data_length)
        cap = self.config.host_buffer_bytes
        streamed = cap is not None and data_length > cap
        if streamed:
            _check_streamable(flat, step, self.rank)
            check_byte_copyable(flat, step=step, rank=self.rank)
        return _Plan(step, started, flat, tree, ts_plain, offsets, data_length,
                     pinned=any(t.device.type == "cuda" for t in flat.tensors),
                     streamed=streamed)

    def _check_process(self) -> None:
        """Refuse use from a forked child: the pipeline's thread and loop stayed in its parent."""
        if os.getpid() != self._pid:
            raise ForkedProcessError(
                f"this pipeline was created by process {self._pid}; process {os.getpid()} is "
                "a fork of it and cannot use it", rank=self.rank, path=str(self.storage.root),
                hint="open a pipeline in the child (on another root or rank), or use it from "
                     "the parent only")

    def _check_not_restoring(self, what: str, step: int | None = None) -> None:
        """Saves and restores exclude each other: a restore rewrites what a save would copy."""
        with self._lock:
            self._check_not_restoring_locked(what, step)

    def _check_not_restoring_locked(self, what: str, step: int | None) -> None:
        if self._restoring:
            raise PipelineBusyError(
                f"{what} while restore_latest() runs on this pipeline", step=step,
                rank=self.rank, path=str(self.storage.root),
                hint="call it after restore_latest() has returned")

    def _acquire(self, plan: _Plan, block: bool) -> Slot | None:
        """A host slot for the plan; None when none is free and this call may not wait."""
        wait = block and self.config.when_busy == "block"
        size = self.config.host_buffer_bytes if plan.streamed else plan.data_length
        assert size is not None
        return self._pool.acquire(max(size, 1), pinned=plan.pinned, block=wait)

    def _start_save(self, plan: _Plan, slot: Slot | None) -> SaveJob:
        """Training-thread part two: claim the step, start the copies, build the job.

        Without a slot the save is skipped (``when_busy="skip"``). Runs under the admission
        lock: a restore that begins meanwhile waits until the save is registered as pending
        (and then waits for it), or the save sees the restore and is refused.
        """
        try:
            with self._admission:
                return self._admit(plan, slot)
        except BaseException:
            if slot is not None:
                self._pool.release(slot)
            raise

    def _admit(self, plan: _Plan, slot: Slot | None) -> SaveJob:
        step, flat = plan.step, plan.flat
        if slot is None:
            return self._skip(step)
        with self._lock:
            self._check_step_order(step)  # another thread may have saved it meanwhile
            self._check_not_restoring_locked("save()", step)
            self._last_step = step
        if plan.streamed:
            snap = begin_streamed_snapshot(flat.tensors, flat.paths, step=step, rank=self.rank)
        else:
            snap = take_snapshot(flat.tensors, flat.paths, plan.offsets, slot.buffer,
                                 step=step, rank=self.rank,
                                 ordered=self.config.snapshot_mode == "ordered",
                                 staging=self._staging)
        save_id = f"{self._run_id}-{step}"
        handle = SaveHandle(step, save_id, snap)
        job = SaveJob(
            step=step, rank=self.rank, world_size=self.config.world_size, save_id=save_id,
            handle=handle, slot=slot, snapshot=snap, paths=flat.paths,
            dtypes=tuple(DTYPE_NAMES[t.dtype] for t in flat.tensors),
            shapes=tuple(tuple(t.shape) for t in flat.tensors),
            devices=tuple(str(t.device) for t in flat.tensors), layouts=flat.layouts,
            offsets=plan.offsets,
            sizes=tuple(t.numel() * t.element_size() for t in flat.tensors),
            data_length=plan.data_length, tree=plan.tree, train_state=plan.train_state,
            requested_at=plan.started,
        )
        with self._lock:
            self._pending[step] = handle
            if snap.needs_release:
                self._snapshots.append(handle)
        self._emit(SaveRequested(step=step, rank=self.rank, save_id=save_id,
                                 tensors=len(flat.tensors), bytes=job.data_bytes,
                                 blocking_seconds=time.perf_counter() - plan.started))
        return job

    def _apply_failure_policy(self, step: int | None) -> None:
        """Raise here when the failure policy says earlier failures must not pass unnoticed."""
        with self._lock:
            error = self._unreported
            count = self._failures_in_row
            due = error is not None and (self.config.strict
                                         or count >= self.config.max_failures_in_row)
            if due:
                self._unreported = None
                self._failures_in_row = 0
        if due:
            assert error is not None
            what = (f"{count} saves in a row failed" if count >= self.config.max_failures_in_row
                    else "a previous save failed")
            raise SaveError(f"{what}; the last one: {error}", step=step, rank=self.rank,
                            path=str(self.storage.root),
                            hint="fix the cause (disk, permissions, state); the newest committed "
                                 "checkpoint is intact, and the next save() tries again")

    def _skip(self, step: int) -> SaveJob:
        """A save dropped by the ``skip`` policy: it fails now, and still votes at commit."""
        save_id = f"{self._run_id}-{step}"
        handle = SaveHandle(step, save_id)
        reason = "every host buffer is busy with an earlier save"
        error = PoolBusyError(f"save skipped: {reason}", step=step, rank=self.rank,
                              hint="save less often, or use buffer_slots=2 or "
                                   "when_busy='block'")
        handle._fail(error)
        with self._lock:
            self._last_step = step
        self._emit(SaveSkipped(step=step, rank=self.rank, reason=reason))
        return SaveJob.placeholder(step, self.rank, self.config.world_size, save_id, handle,
                                   error, "snapshot")

    async def wait_snapshot(self, *, block_cpu: bool = False) -> None:
        """Make the caller's streams wait for every pending snapshot copy; check for mutation.

        Call it before the next in-place update of saved tensors (``optimizer.step()``).
        Returns at once when nothing is being copied.
        """
        self._wait_snapshot(block_cpu=block_cpu)

    def _wait_snapshot(self, *, block_cpu: bool) -> None:
        """Runs on the caller's thread: its current CUDA streams are the ones to order."""
        with self._lock:
            handles, self._snapshots = self._snapshots, []
        for handle in handles:
            handle.wait_snapshot(block_cpu=block_cpu)

    # ------------------------------------------------------------------ stages

    async def _run_stage(
        self,
        name: str,
        receive: MemoryObjectReceiveStream[SaveJob],
        send: MemoryObjectSendStream[SaveJob] | None,
        work: Callable[[SaveJob], Awaitable[None]],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Consume jobs in order.

        A job that failed in an earlier stage skips the work of the stages before commit but
        still reaches commit, where every rank votes; there it leaves the pipeline as failed.
        """
        deciding = name == "commit"
        async with receive:
            task_status.started()
            try:
                async for job in receive:
                    if job.error is None or deciding:
                        try:
                            await work(job)
                        except Exception as exc:
                            if job.error is None:
                                job.error = self._as_error(job, name, exc)
                                job.failed_stage = name
                            else:
                                _log.error("ckpt.commit.vote_failed", step=job.step,
                                           rank=self.rank, error=str(exc))
                    if job.error is not None:
                        self._release_slot(job)
                        if deciding:
                            await self._fail(job)
                            continue
                    if send is not None:
                        await send.send(job)
            finally:
                if send is not None:
                    await send.aclose()

    def _release_slot(self, job: SaveJob) -> None:
        if job.snapshot is not None:
            job.snapshot.enqueued.set()  # a streamed copy that never ran: wait_snapshot returns
            job.snapshot.discard_host_copies()  # staging buffers of a save that failed
        if job.slot is not None:
            self._pool.release(job.slot)
            job.slot = None

    async def _snapshot_stage(self, job: SaveJob) -> None:
        started = time.perf_counter()
        snap = job.snapshot
        assert snap is not None
        if snap.deferred:  # copies to the host from device staging buffers: off the caller
            await self._thread(snap.launch_host_copies)
        if snap.streaming or snap.has_device_copies:
            # The serialize stage writes each piece once its copy is done, checks the versions
            # and reports the snapshot (a streamed one is copied there, a buffer at a time).
            return
        self._emit(SnapshotTaken(step=job.step, rank=self.rank, save_id=job.save_id,
                                 bytes=job.data_bytes,
                                 seconds=time.perf_counter() - started))

    async def _serialize_stage(self, job: SaveJob) -> None:
        started = time.perf_counter()
        assert self._limiter is not None
        copied = await serialize(job, self.storage, chunk_bytes=self.config.chunk_bytes,
                                 threads=self.config.io_threads, limiter=self._limiter,
                                 direct_io=self.config.direct_io)
        self._release_slot(job)  # the bytes are in the file now: the next save may copy
        if copied is not None:
            self._emit(SnapshotTaken(step=job.step, rank=self.rank, save_id=job.save_id,
                                     bytes=job.data_bytes, seconds=copied))
        self._emit(ShardSerialized(step=job.step, rank=self.rank, save_id=job.save_id,
                                   bytes=job.data_bytes, header_bytes=len(job.header),
                                   seconds=time.perf_counter() - started))

    async def _write_stage(self, job: SaveJob) -> None:
        started = time.perf_counter()
        assert self._limiter is not None
        await write_shard(job, self.storage, limiter=self._limiter)
        self._emit(ShardWritten(step=job.step, rank=self.rank, save_id=job.save_id,
                                path=os.path.join(str(self.storage.root), job.dir_name),
                                bytes=job.shard_size, seconds=time.perf_counter() - started))

    async def _commit_stage(self, job: SaveJob) -> None:
        assert self._limiter is not None
        await commit(job, self.storage, self.coordinator, limiter=self._limiter)
        if job.error is not None:
            return
        seconds = time.perf_counter() - job.requested_at
        path = os.path.join(str(self.storage.root), job.dir_name)
        job.committed = True
        with self._lock:
            self._failures_in_row = 0
            if not self.config.strict:
                self._unreported = None
            if self._latest_committed is None or job.step > self._latest_committed:
                self._latest_committed = job.step
        info = CommitInfo(step=job.step, rank=self.rank, save_id=job.save_id, path=path,
                          bytes=job.shard_size, seconds=seconds)
        self._emit(CheckpointCommitted(step=job.step, rank=self.rank, save_id=job.save_id,
                                       path=path, bytes=job.shard_size, seconds=seconds))
        job.handle._resolve(info)

    async def _retain_stage(self, job: SaveJob) -> None:
        """Prune older steps. Never fails the save: it is committed already.

        A step that cannot be removed is reported (``RetentionFailed``, and a marker in the
        root that ``ckpt-pipeline ls`` shows); a step pruned later loses its marker.
        """
        started = time.perf_counter()
        try:
            pruned: list[Pruned] = []
            failed: list[PruneFailed] = []
            try:
                pruned, failed = await self._thread(prune, self.storage, self.rank,
                                                    self.config.keep_last, job.step)
            except Exception as exc:  # the root could not even be listed
                failed = [PruneFailed(-1, str(self.storage.root),
                                      f"{type(exc).__name__}: {exc}")]
            for item in failed:
                self._emit(RetentionFailed(step=item.step, rank=self.rank,
                                           committed_step=job.step, path=item.path,
                                           error=item.error))
            await self._record_prunes(pruned, failed)
        finally:
            self._settle(job)
        for done in pruned:
            self._emit(CheckpointPruned(step=done.step, rank=self.rank, path=done.path,
                                        bytes=done.bytes,
                                        seconds=time.perf_counter() - started))

    async def _record_prunes(self, pruned: list[Pruned], failed: list[PruneFailed]) -> None:
        """Leave a marker for each step that could not be pruned, drop those of pruned ones."""
        for item in failed:
            if item.step < 0:
                continue
            try:
                await self._thread(write_marker, self.storage, self.rank, item)
            except Exception as exc:
                _log.error("ckpt.retain.marker_failed", step=item.step, rank=self.rank,
                           error=f"{type(exc).__name__}: {exc}")
        for done in pruned:
            try:
                await self._thread(clear_marker, self.storage, self.rank, done.step)
            except Exception as exc:
                _log.error("ckpt.retain.marker_failed", step=done.step, rank=self.rank,
                           error=f"{type(exc).__name__}: {exc}")

    def _settle(self, job: SaveJob) -> None:
        """The job has left the pipeline (retained after its commit, or failed)."""
        with self._lock:
            self._pending.pop(job.step, None)
        job.handle._settled.set()

    def _as_error(self, job: SaveJob, stage: str, exc: Exception) -> CheckpointError:
        if isinstance(exc, CheckpointError):
            if exc.step is None:
                exc.step = job.step
            if exc.rank is None:
                exc.rank = self.rank
            return exc
        error = SaveError(f"{stage} failed: {type(exc).__name__}: {exc}", step=job.step,
                          rank=self.rank, path=str(self.storage.root))
        error.__cause__ = exc
        return error

    async def _fail(self, job: SaveJob) -> None:
        """Remove what the failed save left on disk, then fail its handle."""
        assert job.error is not None
        if job.committed:  # a committed step is never removed by a later failure
            _log.error("ckpt.pipeline.bug", step=job.step, rank=self.rank,
                       stage=job.failed_stage, error=str(job.error))
            self._settle(job)
            return
        with anyio.CancelScope(shield=True):
            try:
                await self._thread(remove_published, job, self.storage)
            finally:
                self._abandon(job, job.error, job.failed_stage)

    def _abandon(self, job: SaveJob, error: CheckpointError, stage: str = "submit") -> None:
        self._release_slot(job)
        if job.handle.done():  # failed already (a skipped save): no second report
            self._settle(job)
            return
        with self._lock:
            self._failures_in_row += 1
            self._unreported = error
        self._emit(SaveFailed(step=job.step, rank=self.rank, save_id=job.save_id, stage=stage,
                              error=str(error)))
        job.handle._fail(error)
        self._settle(job)

    # ------------------------------------------------------------------ waiting

    async def wait(self, timeout: float | None = None) -> None:
        """Wait until every pending save is committed and retention after it is done.

        Raises the first failure among those saves, or TimeoutError.
        """
        try:
            await self._wait_pending(timeout, raise_errors=True)
        except CheckpointError:
            with self._lock:
                self._unreported = None  # reported now
            raise
        if self.config.strict:
            self._apply_failure_policy(None)

    async def _wait_pending(self, timeout: float | None, *, raise_errors: bool) -> None:
        with self._lock:
            handles = list(self._pending.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        first: BaseException | None = None
        for handle in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            settled = await anyio.to_thread.run_sync(handle._settled.wait, left,
                                                     abandon_on_cancel=True)
            if not settled:
                raise TimeoutError(f"save of step {handle.step} not finished after {timeout} s")
            error = handle.exception(0)
            if first is None and isinstance(error, CheckpointError):
                first = error
        if first is not None and raise_errors:
            raise first

    def pending_steps(self) -> list[int]:
        """Steps still in the pipeline (not yet committed and retained, or failed)."""
        with self._lock:
            return sorted(self._pending)

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

    async def latest_step(self) -> int | None:
        """The newest step committed by this rank (None when there is none)."""
        with self._lock:
            return self._latest_committed

    # ------------------------------------------------------------------ restore

    async def restore_latest(self, state: MutableMapping[str, Any]) -> RestoreResult | None:
        """Load the newest step that every rank holds and verifies into ``state`` in place.

        A corrupt, truncated or incomplete step is reported (``CheckpointRejected``) and the
        next older one is tried. Returns None when there is nothing to restore; raises
        RestoreError when checkpoints exist but none can be loaded. A restore that raises
        leaves ``state`` (and the RNG states) as they were, on every rank.
        """
        loaded = await self._load_latest(state)
        if loaded is None:
            return None
        applied, apply_error = self._apply(loaded, state)
        with undone_on_error(applied):  # every rank rolls back when any rank failed
            return await self._finish_restore(loaded, apply_error)

    async def _load_latest(self, state: Mapping[str, Any]) -> Loaded | None:
        """Begin a restore: wait for the saves in flight, then read the newest good step.

        From here until ``_finish_restore`` (or until this returns None or raises), saves are
        refused with PipelineBusyError, so that nothing the restore scanned changes under it
        and it never moves aside a step that a save of this pipeline is writing.
        """
        self._check_process()
        if self._state != "open":
            raise PipelineClosedError("restore_latest() on a pipeline that is not open",
                                      rank=self.rank)
        await anyio.to_thread.run_sync(self._begin_restore)
        try:
            await self._wait_pending(None, raise_errors=False)
            assert self._limiter is not None
            loaded = await self._recovery.load_latest(state, self._limiter)
        except BaseException:
            self._end_restore()
            raise
        if loaded is None:
            self._end_restore()
        return loaded

    def _begin_restore(self) -> None:
        """Mark the restore under the admission lock (worker thread: it may wait for a save
        being admitted on the training thread; that save is then pending, and waited for)."""
        with self._admission, self._lock:
            if self._restoring:
                raise PipelineBusyError("restore_latest() while another restore_latest() "
                                        "runs on this pipeline", rank=self.rank,
                                        path=str(self.storage.root),
                                        hint="restore from one thread at a time")
            self._restoring = True

    def _end_restore(self) -> None:
        with self._lock:
            self._restoring = False

    def _apply(self, loaded: Loaded, state: MutableMapping[str, Any]
               ) -> tuple[AppliedState | None, CheckpointError | None]:
        """Load into the live state on the caller's thread: (what can undo it, None), or
        (None, the error) once a failed apply is undone. Whoever gets an AppliedState undoes
        it (on the caller's thread) if ``_finish_restore`` raises, else releases it."""
        try:
            return self._recovery.apply(loaded, state), None
        except CheckpointError as exc:
            return None, exc

    async def _finish_restore(self, loaded: Loaded,
                              apply_error: CheckpointError | None) -> RestoreResult:
        """Vote on every rank's apply and finish; raises if any rank's apply failed (the caller
        then undoes its own apply)."""
        assert self._limiter is not None
        try:
            result = await self._recovery.finish(loaded, apply_error, self._limiter)
            with self._lock:
                self._latest_committed = loaded.step
                self._last_step = loaded.step
        finally:
            self._end_restore()
        return result

    # ------------------------------------------------------------------ events

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(event)`` for every event (from the thread that emits it).

        Returns a function that unsubscribes. A callback that raises is logged and kept.
        """
        with self._lock:
            self._subscribers = (*self._subscribers, callback)

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = tuple(s for s in self._subscribers if s is not callback)

        return unsubscribe

    def _emit(self, event: Event) -> None:
        """Log the event and hand it to every subscriber; never raises (best-effort)."""
        _log.at(event.log_level, event.log_name, **event.fields())
        for callback in self._subscribers:
            try:
                callback(event)
            except Exception as exc:
                self._subscriber_failed(callback, event, exc)

    def _subscriber_failed(self, callback: Subscriber, event: Event, exc: Exception) -> None:
        """Report a subscriber's first failure; it stays subscribed, later ones are counted."""
        key = id(callback)
        with self._lock:
            count = self._subscriber_failures.get(key, 0) + 1
            self._subscriber_failures[key] = count
        if count == 1:
            _log.error("ckpt.subscriber.failed", step=event.step, rank=event.rank,
                       on=event.log_name, subscriber=getattr(callback, "__qualname__",
                                                                repr(callback)),
                       error=f"{type(exc).__name__}: {exc}",
                       hint="the subscriber stays subscribed; its further failures are not "
                            "logged")

    async def _thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
