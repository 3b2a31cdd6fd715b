"""``CheckpointPipeline``: the pipeline for synchronous training loops.

The event loop runs in one named background thread behind an anyio blocking portal; the
training thread only validates, copies (CPU) or queues copies (CUDA), and hands the save over.

Shutdown (see ``close``, and ``loop_thread.py`` for the thread): leaving the ``with`` block, normally or by an exception (Ctrl-C
during training included), finishes the saves in flight before the block is left; the
interpreter exiting without ``close()`` finishes them from an ``atexit`` hook, bounded by
``exit_timeout_s``; an interrupt (Ctrl-C) *while* ``close()`` waits, or its timeout, abandons
them. Whatever happens, a step is complete on disk only once its commit record is published,
and that is only ever done after the step's data are durable: an abandoned save leaves at most
temporaries and uncommitted files, which the next pipeline opened on the root removes.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, MutableMapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .._logging import log
from .._restore.rollback import undone_on_error
from .._save.buffers import Slot
from ..config import PipelineConfig
from ..coordination import Coordinator
from ..errors import ConfigError, PipelineClosedError
from ..handle import Missing, Reshard, RestoreResult, SaveHandle
from ..storage import Storage
from ..train_state import TrainState
from .emitter import Subscriber
from .lifecycle import AsyncCheckpointPipeline
from .loop_thread import LoopThread
from .signals import SigtermGuard, SigtermPolicy, signals_held

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..config import PipelineOptions

__all__ = ("CheckpointPipeline",)

_log = log

DEFAULT_EXIT_TIMEOUT_S = 300.0
"""How long the interpreter's exit waits for saves in flight when ``close()`` was not called."""


class CheckpointPipeline:
    """Checkpoint pipeline for a synchronous training loop; a context manager.

    ``save()`` returns a :class:`SaveHandle` at once; ``wait_snapshot()`` goes before the next
    in-place update; ``restore_latest()`` loads the newest complete checkpoint in place.

    ``exit_timeout_s`` bounds how long the interpreter's exit waits for saves in flight when
    the pipeline was never closed (``None``: no bound), and how long a SIGTERM waits for them.

    ``sigterm`` (what schedulers and torchrun send to stop a job), inside the ``with`` block,
    on the main thread, when SIGTERM has its default disposition:

    - ``"finish"`` (default): the signal ends the block (``SystemExit``) like Ctrl-C does;
      the saves in flight finish (within ``exit_timeout_s``), then the process ends by
      SIGTERM, as the signal asked.
    - ``"flag"``: save on preemption. ``preempted`` becomes True and the loop goes on, so
      that it can save its current step and leave the block; the process then ends by
      SIGTERM once the saves are committed. A second SIGTERM acts as in ``"finish"``.
    - ``"off"``: SIGTERM is left alone (it kills the process at once, losing the saves in
      flight, unless the application handles it).

    A handler of the application's own is never replaced. Either way, a signal that
    arrives inside ``save()`` is held until the save is handed to the pipeline.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        config: PipelineConfig | None = None,
        storage: Storage | None = None,
        coordinator: Coordinator | None = None,
        thread_name: str = "ckpt-pipeline",
        exit_timeout_s: float | None = DEFAULT_EXIT_TIMEOUT_S,
        sigterm: SigtermPolicy = "finish",
        **options: Unpack[PipelineOptions],
    ) -> None:
        if sigterm not in ("finish", "flag", "off"):
            raise ConfigError(f"sigterm={sigterm!r} is not a policy",
                              hint='use "finish" (default), "flag" or "off"')
        if exit_timeout_s is not None and (
            isinstance(exit_timeout_s, bool) or not isinstance(exit_timeout_s, (int, float))
            or not math.isfinite(exit_timeout_s) or exit_timeout_s <= 0
        ):
            raise ConfigError(f"exit_timeout_s must be a positive number of seconds or None, "
                              f"got {exit_timeout_s!r}",
                              hint="e.g. exit_timeout_s=300, or None to wait without bound")
        self._pipe = AsyncCheckpointPipeline(root, config=config, storage=storage,
                                             coordinator=coordinator, **options)
        self.config = self._pipe.config
        self._loop = LoopThread(self._pipe, thread_name, exit_timeout_s)
        self._sigterm_policy: SigtermPolicy = sigterm
        self._sigterm: SigtermGuard | None = None

    @property
    def root(self) -> str:
        return str(self._pipe.storage.root)

    @property
    def exit_timeout_s(self) -> float | None:
        """How long the interpreter's exit, or a SIGTERM, waits for saves in flight."""
        return self._loop.exit_timeout_s

    @exit_timeout_s.setter
    def exit_timeout_s(self, value: float | None) -> None:
        self._loop.exit_timeout_s = value

    def __enter__(self) -> CheckpointPipeline:
        """Open (unless ``open()`` was already called) and watch SIGTERM (see ``sigterm``)."""
        if self._loop.thread is None or self._loop.closed:
            self.open()  # a closed pipeline raises here: it cannot be opened again
        if self._sigterm_policy != "off":
            self._sigterm = SigtermGuard.install(self._sigterm_policy, self._pipe.rank)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close: pending saves finish first, whether the block ended normally or not.

        An exception leaving the block (KeyboardInterrupt from Ctrl-C included) propagates
        unchanged once they are done; an error of the close itself is then logged
        (``ckpt.close.failed``), not raised over it. An interrupt while waiting (a second
        Ctrl-C or SIGTERM) abandons the wait and propagates. After a SIGTERM (see
        ``sigterm``), the wait is bounded by ``exit_timeout_s`` and the process then ends by
        SIGTERM.
        """
        guard, self._sigterm = self._sigterm, None
        if guard is not None:
            guard.closing = True  # from now, the first SIGTERM only shortens the wait
        try:
            terminated = guard is not None and guard.count > 0
            timeout = self.exit_timeout_s if terminated else None
            if exc is None:
                try:
                    self._loop.close(timeout, "SIGTERM" if terminated else None)
                except TimeoutError:
                    if not terminated:
                        raise
                return
            try:
                self._loop.close(timeout, exc)
            except Exception as error:
                _log.error("ckpt.close.failed", rank=self._pipe.rank,
                           error=f"{type(error).__name__}: {error}",
                           hint=f"the {type(exc).__name__} raised in the with block "
                                "propagates")
        finally:
            if guard is not None:
                guard.uninstall()

    @property
    def preempted(self) -> bool:
        """A SIGTERM arrived in the ``with`` block (see ``sigterm="flag"``)."""
        guard = self._sigterm
        return guard is not None and guard.count > 0

    def open(self) -> CheckpointPipeline:
        """Start the background thread and the pipeline in it (scrubbing leftovers first);
        returns the pipeline, for the form without ``with``: ``pipe = CheckpointPipeline(root)
        .open()`` ... ``pipe.close()``."""
        self._loop.open()
        return self

    def _not_usable(self, what: str, step: int | None = None) -> PipelineClosedError:
        """The error of a call on a pipeline that is not open: never opened, or closed."""
        if self._loop.thread is None and not self._loop.closed:
            return PipelineClosedError(
                f"{what} on a pipeline that was not opened yet", step=step,
                hint="call open() first (pipe = CheckpointPipeline(root).open()), or use it "
                     "inside `with CheckpointPipeline(...) as pipe:`")
        return PipelineClosedError(f"{what} after close()", step=step,
                                   hint="open a new pipeline")

    def close(self, timeout: float | None = None) -> None:
        """Finish every pending save, stop the background thread. Idempotent.

        Waits for the saves in flight (logged as ``ckpt.close.waiting`` with their steps) and
        raises an error of the close itself, if any. Failed saves do not raise here: their
        handles do. If the wait is interrupted (KeyboardInterrupt: Ctrl-C while ``close()``
        waits) or lasts longer than ``timeout`` seconds (then TimeoutError), the pending saves
        are abandoned (``ckpt.close.abandoned``): nothing of them is published as complete,
        the newest committed step stays the newest, and the next pipeline opened on the root
        removes their temporaries.
        """
        self._loop.close(timeout, None)

    def _check_process(self) -> None:
        """Refuse use from a forked child: the pipeline's thread exists only in its parent."""
        self._pipe.admission.check_process()

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._check_process()
        portal = self._loop.portal
        if self._loop.closed or portal is None:
            raise self._not_usable(f"{getattr(fn, '__name__', 'the call')}()")
        return portal.call(fn, *args)

    def save(self, step: int, state: Mapping[str, Any],
             train_state: TrainState | None = None) -> SaveHandle:
        """Snapshot ``state`` at ``step`` and queue it; returns at once with a handle.

        CPU tensors are copied before this returns; CUDA tensors are copied on a side stream
        (call ``wait_snapshot()`` before mutating them). Bad input raises CheckpointError here,
        before anything is written. A signal (Ctrl-C, SIGTERM) that arrives while the save is
        being handed to the pipeline is delivered once it is handed over, so the save is in
        flight (and ``close()`` finishes it) rather than half registered.
        """
        self._check_process()
        portal = self._loop.portal
        if self._loop.closed or portal is None:
            raise self._not_usable("save()", step)
        pipe = self._pipe
        pipe.check_open("save()", step)
        plan = pipe.admission.plan(step, state, train_state)
        slot = pipe.admission.acquire(plan, True)
        handed_over = False
        try:
            with signals_held():
                handed_over = True  # from here start() gives the slot back if it raises
                job = pipe.admission.start(plan, slot)
                try:
                    if slot is None:  # skipped: queued behind the saves in flight, no wait
                        portal.call(functools.partial(pipe.runner.submit, job, wait=False))
                        return job.handle
                    submitted = portal.start_task_soon(pipe.runner.submit, job)
                except RuntimeError as exc:  # the loop stopped: closed from another thread
                    error = PipelineClosedError("save() while the pipeline closes", step=step,
                                                hint="open a new pipeline")
                    pipe.abandon(job, error)
                    raise error from exc
        except BaseException:
            if not handed_over and isinstance(slot, Slot):  # interrupted before hand-over
                pipe.admission.pool.release(slot)
            raise
        submitted.result()
        return job.handle

    def wait_snapshot(self, *, block_cpu: bool = False) -> None:
        """Order the caller's CUDA streams after pending snapshot copies (see the async face)."""
        self._check_process()
        self._pipe.admission.wait_snapshot(block_cpu=block_cpu)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed and retained; then raise the first
        failure (by step) since the last ``wait()``, once (see the async face)."""
        self._call(self._pipe.wait, timeout)

    def restore_latest(self, state: MutableMapping[str, Any], *,
                       restore_rng: bool | None = None,
                       missing: Missing = "refuse",
                       reshard: Reshard | None = None) -> RestoreResult | None:
        """Load the newest complete, verified checkpoint into ``state`` in place.

        A restore that raises leaves ``state`` (and the RNG states) as they were.
        ``restore_rng``: load the saved RNG states too (None: the pipeline's ``restore_rng``).
        ``missing``: what to do with entries of ``state`` the step lacks (see the async face).
        ``reshard``: what a restore onto another number of ranks does with RNG streams and
        per-rank values (see ``Reshard``; None: its defaults).
        """
        return self.restore(state, None, restore_rng=restore_rng, missing=missing,
                            reshard=reshard)

    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                restore_rng: bool | None = None,
                missing: Missing = "refuse",
                reshard: Reshard | None = None) -> RestoreResult | None:
        """``restore_latest``, or with ``step`` that step and no other (RestoreError when it
        is not held and valid on every rank, or does not load). Steps newer than the restored
        one are moved aside (kept, invisible to later scans): the run goes on from it."""
        loaded = self._call(functools.partial(self._pipe.load_for_restore, state, step,
                                              restore_rng=restore_rng, missing=missing,
                                              reshard=reshard))
        if loaded is None:
            return None
        applied, apply_error = self._pipe.apply_restore(loaded, state)
        with undone_on_error(applied):  # on this thread (its CUDA streams), on every rank
            result: RestoreResult = self._call(self._pipe.finish_restore, loaded, apply_error)
        return result

    def latest_step(self) -> int | None:
        """The newest step committed by this rank, or None."""
        step: int | None = self._call(self._pipe.latest_step)
        return step

    def pending_steps(self) -> list[int]:
        """Steps still in the pipeline (not yet committed and retained, or failed)."""
        self._check_process()
        return self._pipe.pending_steps()

    @property
    def host_memory_bytes(self) -> int:
        """Bytes held by the host buffer pool (allocated on the first save, then reused)."""
        return self._pipe.host_memory_bytes

    @property
    def host_memory_pinned(self) -> bool:
        return self._pipe.host_memory_pinned

    @property
    def device_memory_bytes(self) -> int:
        """Bytes of GPU memory held by the device staging buffers (``device_staging``)."""
        return self._pipe.device_memory_bytes

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Receive every pipeline event (called from the pipeline's thread)."""
        return self._pipe.subscribe(callback)
