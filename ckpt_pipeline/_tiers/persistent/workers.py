"""Threads of the persistent tier that never keep the process alive.

A request to a store that never answers blocks its thread until the request's deadline, or
for good where a client has none. ``concurrent.futures`` joins its threads when the
interpreter exits, so one such request was enough for a process never to exit after
``close()``. Every thread of the tier is a daemon instead: ``DaemonPool`` for uploads,
commit objects and the parts of a transfer, ``bounded`` for one call that a caller waits on
only so long. What such a thread did not finish is never reported as done: the promoter
reports and commits only what ended before its deadlines.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ("DaemonPool", "bounded")

_T = TypeVar("_T")
_Item = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class DaemonPool:
    """At most ``threads`` daemon threads running what is submitted, in order. The part of
    ``concurrent.futures.ThreadPoolExecutor`` the tier uses (``submit``, ``shutdown``), with
    threads that the interpreter does not wait for at exit."""

    def __init__(self, threads: int, name: str) -> None:
        self._max = threads
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads = 0
        self._shut = False

    def submit(self, fn: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T]:
        """Run ``fn(*args)`` in a thread of the pool; RuntimeError once it is shut down."""
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._name}: submit after shutdown")
            future: concurrent.futures.Future[_T] = concurrent.futures.Future()
            self._queue.put((future, fn, args))
            if not self._idle.acquire(blocking=False) and self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._threads}",
                                 daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del item, future
            with self._lock:
                if self._shut:
                    return
            self._idle.release()

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Stop taking work; cancel what has not started (``cancel_futures``). Never waits
        for a running call (``wait`` is accepted for the executor's signature and must be
        False): its thread ends with it, or with the process."""
        assert not wait, "a DaemonPool never waits for its threads"
        with self._lock:
            self._shut = True
            threads = self._threads
        while cancel_futures:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            self._queue.put(None)


def bounded(fn: Callable[[], _T], timeout: float, name: str) -> _T:
    """``fn()`` in a daemon thread of its own, waited for at most ``timeout`` seconds: its
    result or its exception, or TimeoutError while it still runs (it is left to end alone)."""
    future: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"{name} did not end within {timeout} s") from None
