"""The background thread of ``CheckpointPipeline``: its event loop, its open and its close.

The loop runs ``AsyncCheckpointPipeline`` in one named daemon thread behind an anyio blocking
portal. Closing sets an event the loop waits on, so that leaving the pipeline's block finishes
the saves in flight; if the wait is interrupted or times out, a cancel scope around the block
is cancelled, which abandons them (nothing partial is published). An ``atexit`` hook closes a
pipeline the application never closed, bounded by ``exit_timeout_s``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal

from .._logging import log
from ..errors import PipelineClosedError
from ..handle import SaveHandle
from .lifecycle import AsyncCheckpointPipeline

__all__ = ("LoopThread", "close_at_exit", "describe")

_log = log


class LoopThread:
    """The thread that runs one pipeline's event loop; opened once, closed once."""

    def __init__(self, pipe: AsyncCheckpointPipeline, name: str,
                 exit_timeout_s: float | None) -> None:
        self.pipe = pipe
        self.name = name
        self.exit_timeout_s = exit_timeout_s
        """How long the interpreter's exit waits for saves in flight (None: no bound)."""
        self.thread: threading.Thread | None = None
        self.portal: BlockingPortal | None = None
        self.closed = False
        self._closing: anyio.Event | None = None
        self._abandon_scope: anyio.CancelScope | None = None
        self._close_error: BaseException | None = None
        self._at_exit: Callable[[], None] | None = None

    def open(self) -> None:
        """Start the thread and the pipeline in it (scrubbing leftovers first)."""
        if self.thread is not None:
            raise PipelineClosedError("a pipeline can be opened once")
        ready: queue.Queue[BlockingPortal | BaseException] = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(ready,),
                                        name=self.name, daemon=True)
        self.thread.start()
        item = ready.get()
        if isinstance(item, BaseException):
            self.thread.join()
            self.closed = True
            raise item
        self.portal = item
        # The thread is a daemon (a forgotten pipeline must not keep the process alive), so
        # the interpreter would stop it wherever it is at exit: finish the saves first.
        self._at_exit = functools.partial(close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    def _run(self, ready: queue.Queue[BlockingPortal | BaseException]) -> None:
        async def main() -> None:
            async with BlockingPortal() as portal:
                self._closing = anyio.Event()
                opened = False
                # Cancelled when close() stops waiting (interrupted, or its timeout): leaving
                # the pipeline's block then abandons what is pending instead of finishing it.
                with anyio.CancelScope() as abandon:
                    self._abandon_scope = abandon
                    try:
                        async with self.pipe:
                            opened = True
                            ready.put(portal)
                            await self._closing.wait()
                    except Exception as exc:
                        if opened:
                            self._close_error = exc
                        else:
                            ready.put(exc)

        try:
            anyio.run(main)
        except BaseException as exc:  # the loop itself failed to start
            ready.put(exc)

    def close(self, timeout: float | None, why: BaseException | str | None) -> None:
        """Finish the saves in flight (or abandon them: interrupted, or past ``timeout``) and
        stop the thread; ``why``: what closes it, for the log lines. Idempotent."""
        self.pipe.admission.check_process()
        self._unregister_at_exit()
        thread, portal, closing = self.thread, self.portal, self._closing
        if self.closed or thread is None or portal is None or closing is None:
            self.closed = True
            return
        started = time.monotonic()
        self.closed = True
        handles: list[SaveHandle] = []
        try:  # from here an interrupt anywhere abandons the wait
            handles = self._pending_handles()
            if handles:
                fields: dict[str, Any] = {"rank": self.pipe.rank,
                                          "steps": [h.step for h in handles],
                                          "reason": describe(why)}
                if why is None:
                    _log.info("ckpt.close.waiting", **fields)
                else:
                    again = " again" if isinstance(why, KeyboardInterrupt) else ""
                    _log.warning("ckpt.close.waiting", **fields,
                                 hint=f"they finish before the process goes on; interrupt "
                                      f"(Ctrl-C){again} to abandon them: nothing partial is "
                                      "published")
            if thread.is_alive():
                with contextlib.suppress(RuntimeError):  # the loop already stopped
                    portal.start_task_soon(closing.set)
            thread.join(timeout)
        except BaseException as exc:  # KeyboardInterrupt (Ctrl-C while waiting), SystemExit
            self._abandon(f"interrupted by {type(exc).__name__}")
            raise
        if thread.is_alive():
            left = self._abandon(f"not finished within {timeout} s")
            raise TimeoutError(f"close() gave up after {timeout} s; steps {left} were "
                               "abandoned (nothing partial is published)")
        if handles:
            failed = [h.step for h in handles if h.done() and h.exception(0) is not None]
            _log.info("ckpt.close.done", rank=self.pipe.rank,
                      committed=[h.step for h in handles if h.step not in failed],
                      failed=failed, seconds=round(time.monotonic() - started, 3))
        if self._close_error is not None:
            raise self._close_error

    def _pending_handles(self) -> list[SaveHandle]:
        return self.pipe.ledger.pending_handles()

    def _abandon(self, reason: str) -> list[int]:
        """Stop waiting: log what is left, and tell the loop to abandon it (no wait)."""
        left = [h.step for h in self._pending_handles() if not h.done()]
        _log.warning("ckpt.close.abandoned", rank=self.pipe.rank, steps=left, reason=reason,
                     latest_committed=self.pipe.ledger.latest_committed,
                     hint="nothing of these steps is published as complete; the next "
                          "pipeline opened on this root removes their temporaries")
        scope, portal = self._abandon_scope, self.portal
        if scope is not None and portal is not None:
            with contextlib.suppress(Exception):  # the loop stopped meanwhile: nothing to do
                portal.start_task_soon(scope.cancel)
        return left

    def _unregister_at_exit(self) -> None:
        hook, self._at_exit = self._at_exit, None
        if hook is not None:
            atexit.unregister(hook)


def describe(why: BaseException | str | None) -> str:
    """What closes a pipeline, in words, for the ``ckpt.close.waiting`` line."""
    if why is None:
        return "close"
    if isinstance(why, str):
        return why
    if isinstance(why, KeyboardInterrupt):
        return "KeyboardInterrupt (Ctrl-C) in the with block"
    return f"{type(why).__name__} raised in the with block"


def close_at_exit(ref: weakref.ref[LoopThread]) -> None:
    """atexit hook of an open pipeline: finish its saves in flight, within exit_timeout_s."""
    loop = ref()
    if loop is None or loop.closed or os.getpid() != loop.pipe.admission.pid:
        return  # closed already, or a forked child that holds a copy without the thread
    try:
        loop.close(loop.exit_timeout_s, "interpreter exit: close() was not called")
    except (TimeoutError, KeyboardInterrupt):
        pass  # logged as ckpt.close.abandoned
    except Exception as exc:
        _log.error("ckpt.close.failed", rank=loop.pipe.rank,
                   error=f"{type(exc).__name__}: {exc}", hint="at interpreter exit")
