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
                    fn: Callable[[Unpack[_Ts]], _T], *args: Unpack[_Ts]) -> _T:
    """``fn(*args)`` in a worker thread under ``limiter`` (the pipeline's ``io_threads``)."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)
