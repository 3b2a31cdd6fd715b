"""The one way the pipeline runs blocking work (file I/O, checksums, CUDA waits) off the loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
from typing_extensions import TypeVarTuple, Unpack

__all__ = ("in_thread",)

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


async def in_thread(limiter: anyio.CapacityLimiter | None,
                    fn: Callable[[Unpack[_Ts]], _T], *args: Unpack[_Ts],
                    abandon_on_cancel: bool = False) -> _T:
    """``fn(*args)`` in a worker thread under ``limiter`` (the pipeline's ``io_threads``).

    ``limiter=None`` takes anyio's default limiter: for a thread that only waits (for CUDA
    events, for other threads of the pipeline) and must never hold an I/O slot that the
    threads it waits for need. ``abandon_on_cancel`` lets a cancellation return at once,
    leaving the thread to finish alone: only for a wait whose result nobody needs then.
    """
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter,
                                          abandon_on_cancel=abandon_on_cancel)
