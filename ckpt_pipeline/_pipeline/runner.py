"""The stage runner: the five save stages as consumers on bounded streams, in one task group.

Call order of one save, once ``submit`` has queued its job (``Stages`` does each step's work):

1. ``copy`` -> 2. ``write_data`` -> 3. ``seal`` -> 4. ``commit`` -> 5. ``retain``.

Each stage takes the job from its input stream, does its work, and sends the job on. A job
that failed in an earlier stage skips the work of the stages before ``commit`` but still
reaches ``commit``, where every rank votes; there it leaves the pipeline as failed: its files
are removed and its handle fails. ``retain`` settles every job that got through ``commit``.

``running()`` owns the task group (entered with ``async with``) for as long as the pipeline is
open. Leaving it finishes the saves in flight; a cancellation (of the block, or of that wait)
abandons them instead: the stages stop once the I/O call in progress returns (a commit already
started completes, shielded), and each abandoned save's files are removed.
"""

from __future__ import annotations

import collections
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._crash import crash_point
from .._format.tidy import scrub
from .._logging import log, warn_unless_shown
from .._save.job import SaveJob, stage_error
from .._threads import in_thread
from ..errors import CheckpointError, CheckpointWarning, PipelineClosedError
from ..events import Event, FailedAt, SaveFailed, SaveStage, TemporariesScrubbed
from .ledger import Ledger
from .stages import STAGES, Stages

__all__ = ("StageRunner",)

_Work = Callable[[SaveJob], Awaitable[None]]


class StageRunner:
    """Runs the stages of one pipeline (see the module docstring for the call order)."""

    def __init__(self, stages: Stages, ledger: Ledger, emit: Callable[[Event], None],
                 queue_depth: int) -> None:
        self.stages = stages
        self.ledger = ledger
        self.rank = stages.rank
        self.storage = stages.storage
        self._emit = emit
        self._depth = queue_depth
        self._tg: TaskGroup | None = None
        self._send: MemoryObjectSendStream[SaveJob] | None = None
        self._queued: MemoryObjectReceiveStream[SaveJob] | None = None
        self._working: dict[int, SaveJob] = {}
        self._scopes: list[anyio.CancelScope] = []
        self._backlog: collections.deque[tuple[SaveJob, anyio.Event]] = collections.deque()
        self._feeding = False
        self.accepting = False

    # ------------------------------------------------------------------ lifecycle

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Start the stages; on leaving, finish the saves in flight, or abandon them when the
        block (or the wait for them) is cancelled. The block's exception propagates."""
        send, receive = anyio.create_memory_object_stream[SaveJob](self._depth)
        self._send, self._queued = send, receive.clone()
        cancelled = anyio.get_cancelled_exc_class()
        raised: BaseException | None = None
        why = "the stages stopped"
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await self._start_stages(tg, receive)
                self.accepting = True
                try:
                    yield
                except BaseException as exc:  # raised in the block: let it out once we are done
                    raised = exc
                self.accepting = False
                if isinstance(raised, cancelled):
                    why = "cancelled"
                    self._stop(tg)
                else:
                    try:
                        await self.wait_pending(None, raise_errors=False)
                    except BaseException as exc:  # cancelled or interrupted: abandon the rest
                        why = ("cancelled" if isinstance(exc, cancelled)
                               else f"interrupted by {type(exc).__name__}")
                        raised = exc  # a cancellation must propagate, over the block's own
                        self._stop(tg)
                    send.close()
        finally:
            self.accepting = False
            with anyio.CancelScope(shield=True):
                await self._clean_up_abandoned(why)
        if raised is not None:
            raise raised

    async def _start_stages(self, tg: TaskGroup, receive: MemoryObjectReceiveStream[SaveJob]
                            ) -> None:
        work: dict[SaveStage, _Work] = {
            "copy": self.stages.copy, "memory": self.stages.memory,
            "write_data": self.stages.write_data, "seal": self.stages.seal,
            "commit": self.stages.commit, "retain": self.stages.retain,
        }
        names = [n for n in STAGES if n != "memory" or self.stages.memory_tier is not None]
        for index, name in enumerate(names):
            last = index == len(names) - 1
            next_send, next_receive = (None, None) if last else (
                anyio.create_memory_object_stream[SaveJob](self._depth))
            await tg.start(self._shielded, name, receive, next_send,
                           self._tracked(work[name], last))
            if next_receive is not None:
                receive = next_receive

    def _tracked(self, work: _Work, last: bool) -> _Work:
        """Remember the jobs a stage holds (an open file, temporaries) until they settle."""
        working = self._working

        async def run(job: SaveJob) -> None:
            for key in [k for k, j in working.items() if j.control.settled]:
                del working[key]
            working[id(job)] = job
            try:
                await work(job)
            finally:
                if last:  # retention settles the job, whatever happens
                    working.pop(id(job), None)

        return run

    async def _shielded(self, name: SaveStage, receive: MemoryObjectReceiveStream[SaveJob],
                        send: MemoryObjectSendStream[SaveJob] | None, work: _Work, *,
                        task_status: TaskStatus[None]) -> None:
        """A stage runs shielded: only ``_stop`` cuts it short, never a cancellation around."""
        with anyio.CancelScope(shield=True) as scope:
            self._scopes.append(scope)
            await self._consume(name, receive, send, work, task_status=task_status)

    def _stop(self, tg: TaskGroup) -> None:
        tg.cancel_scope.cancel()
        for scope in self._scopes:
            scope.cancel()

    async def _consume(self, name: SaveStage, receive: MemoryObjectReceiveStream[SaveJob],
                       send: MemoryObjectSendStream[SaveJob] | None, work: _Work, *,
                       task_status: TaskStatus[None]) -> None:
        """Take jobs in order; a failed job skips to the next stage that votes (``commit``,
        or ``memory`` for a memory save not yet committed there) and leaves there. A job
        the stage is done with (``leaves``) goes no further."""
        async with receive:
            task_status.started()
            try:
                async for job in receive:
                    deciding = name == "commit" or (name == "memory"
                                                    and not job.memory_committed)
                    if job.error is None or deciding:
                        try:
                            await work(job)
                        except Exception as exc:
                            if job.error is None:
                                job.error = stage_error(job, name, exc,
                                                        str(self.storage.root))
                                job.failed_stage = name
                            else:
                                log.error("ckpt.commit.vote_failed", step=job.step,
                                          rank=self.rank, error=str(exc))
                    if job.error is not None:
                        self.stages.release_slot(job)
                        if deciding:
                            await self._fail(job)
                            continue
                    if job.leaves:
                        continue
                    if send is not None:
                        await send.send(job)
                tier = self.stages.memory_tier
                flushed = None if name != "memory" or tier is None else tier.flush()
                if flushed is not None and send is not None:  # at close: the newest to disk
                    await send.send(flushed)
            finally:
                if send is not None:
                    await send.aclose()

    # ------------------------------------------------------------------ submitting

    async def submit(self, job: SaveJob, *, wait: bool = True) -> None:
        """Hand a job to the first stage, in the order of the calls.

        When the stage's queue is full, the job waits in a backlog that one task feeds in
        order; ``wait=False`` (a skipped save, which must vote in its place but must never
        block the caller) returns at once, the others once their job is queued.
        """
        if self._send is None or not self.accepting:
            self.abandon(job, PipelineClosedError("the pipeline is closed", step=job.step,
                                                  rank=self.rank))
            return
        if not self._backlog:
            try:
                self._send.send_nowait(job)
            except anyio.WouldBlock:
                pass
            else:
                crash_point("save.requested")
                return
        queued = anyio.Event()
        self._backlog.append((job, queued))
        if not self._feeding:
            assert self._tg is not None
            self._feeding = True
            self._tg.start_soon(self._feed_backlog)
        if wait:
            await queued.wait()
            crash_point("save.requested")

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

    # ------------------------------------------------------------------ outcomes

    async def _fail(self, job: SaveJob) -> None:
        """Remove what the failed save left on disk, then fail its handle."""
        assert job.error is not None
        if job.memory_committed and not job.committed:  # its write-through to disk failed
            await self._fail_write_through(job)
            return
        if job.committed:  # a committed step is never removed by a later failure
            log.error("ckpt.pipeline.bug", step=job.step, rank=self.rank,
                      stage=job.failed_stage, error=str(job.error))
            self.ledger.settle(job.control)
            return
        assert job.failed_stage is not None  # set with the error
        with anyio.CancelScope(shield=True):
            try:
                await in_thread(self.stages.limiter, job.files.remove, self.storage)
                await self.stages.undo_memory(job)
            finally:
                self.abandon(job, job.error, job.failed_stage)

    async def _fail_write_through(self, job: SaveJob) -> None:
        """A memory save's write-through failed: its disk files go, the step stays committed
        in memory; the failure is reported and counted as any failed save's."""
        error, stage = job.error, job.failed_stage
        assert error is not None and stage is not None
        with anyio.CancelScope(shield=True):
            try:
                await in_thread(self.stages.limiter, job.files.remove, self.storage)
            finally:
                job.error = None
                self._report_failure(job, error, stage, "the write-through to disk of step",
                                     "The step stays committed in memory. ")
                job.control.fail_durable(error)
                tier = self.stages.memory_tier
                if tier is not None:
                    tier.written_through(job)
                self.ledger.settle(job.control)

    def abandon(self, job: SaveJob, error: CheckpointError, stage: FailedAt = "submit") -> None:
        """Fail the job's handle (once) and take it out of the pipeline."""
        self.stages.release_slot(job)
        if job.handle.done():  # failed already (a skipped save): no second report
            self.ledger.settle(job.control)
            return
        self._report_failure(job, error, stage)
        job.control.fail(error)
        self.ledger.settle(job.control)

    def _report_failure(self, job: SaveJob, error: CheckpointError, stage: FailedAt,
                        what: str = "the save of step", outcome: str = "") -> None:
        """Count a failure for the policy, emit ``SaveFailed``, and warn where no logging
        handler would show it."""
        self.ledger.failed(error, job.step)
        self._emit(SaveFailed(step=job.step, rank=self.rank, save_id=job.save_id, stage=stage,
                              error=str(error)))
        warn_unless_shown(
            f"ckpt_pipeline: {what} {job.step} failed on rank {self.rank} "
            f"(stage {stage}, root {self.storage.root}): {error}. {outcome}"
            f"{self.ledger.policy_note()}. (This warning stands in for the ckpt.save.failed "
            "ERROR log line, which no logging handler shows: configure logging, or filter "
            "ckpt_pipeline.CheckpointWarning.)", CheckpointWarning)

    async def wait_pending(self, timeout: float | None, *, raise_errors: bool) -> None:
        """Wait for every save in flight to settle; raise the first failure if asked."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first: BaseException | None = None
        for control in self.ledger.pending_controls():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            settled = await in_thread(None, control.wait_settled, left, abandon_on_cancel=True)
            if not settled:
                raise TimeoutError(f"save of step {control.step} not finished after "
                                   f"{timeout} s")
            error = control.handle.exception(0)
            if first is None and isinstance(error, CheckpointError):
                first = error
        if first is not None and raise_errors:
            raise first

    async def _clean_up_abandoned(self, why: str) -> None:
        """After the stages ended: what did not settle was abandoned mid-way; remove it."""
        jobs = list(self._working.values())
        jobs.extend(job for job, _ in self._backlog)
        self._backlog.clear()
        if self._queued is not None:
            while True:
                try:
                    jobs.append(self._queued.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
            self._queued.close()
        self._working.clear()
        left = [job for job in jobs if not job.control.settled]
        if left:
            log.warning("ckpt.close.cancelled", rank=self.rank,
                        steps=sorted(job.step for job in left if not job.committed),
                        reason=why, hint="these saves were abandoned and their files "
                                         "removed; the previous checkpoint is intact")
        for job in left:
            if job.committed:  # committed before retention ran: it stays
                self.ledger.settle(job.control)
                continue
            try:
                await in_thread(self.stages.limiter, job.files.remove, self.storage)
            except Exception as exc:
                log.error("ckpt.close.cleanup_failed", step=job.step, rank=self.rank,
                          error=f"{type(exc).__name__}: {exc}")
            self.abandon(job, job.error or PipelineClosedError(
                f"save abandoned: the pipeline closed ({why}) before step {job.step} was "
                "committed", step=job.step, rank=self.rank, path=str(self.storage.root),
                hint="nothing of it was published; the previous checkpoint is intact"), "close")
        if left:  # a file created just as a stage was cancelled is not in its job
            try:
                scrubbed = await in_thread(self.stages.limiter, scrub, self.storage,
                                           self.rank)
            except Exception as exc:
                log.error("ckpt.close.cleanup_failed", rank=self.rank,
                          error=f"{type(exc).__name__}: {exc}")
                scrubbed = []
            for path, size in scrubbed:
                self._emit(TemporariesScrubbed(step=-1, rank=self.rank, path=path, bytes=size))
        for control in self.ledger.pending_controls():  # not expected: every job is tracked
            control.fail(PipelineClosedError(f"save abandoned: the pipeline closed ({why})",
                                             step=control.step, rank=self.rank))
            self.ledger.settle(control)
