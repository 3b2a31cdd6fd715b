"""Work split across worker threads: balanced groups of byte ranges, run all at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio

from ._threads import in_thread

__all__ = ("first_leaf", "run_groups", "split_balanced", "tensor_chunks")

R = TypeVar("R", bound=tuple[int, ...])
G = TypeVar("G")


def split_balanced(ranges: list[R], parts: int) -> list[list[R]]:
    """Split ranges (start, end, ...) into at most ``parts`` contiguous groups of similar bytes."""
    if not ranges:
        return []
    total = sum(r[1] - r[0] for r in ranges)
    target = max(1, total // max(1, parts))
    groups: list[list[R]] = [[]]
    acc = 0
    for r in ranges:
        if acc >= target and len(groups) < parts:
            groups.append([])
            acc = 0
        groups[-1].append(r)
        acc += r[1] - r[0]
    return groups


def tensor_chunks(offsets: list[int], sizes: tuple[int, ...] | list[int],
                  chunk_bytes: int) -> list[tuple[int, int, int, int]]:
    """(start, end, tensor index, chunk index) of every checksum chunk; empty tensors get one."""
    out: list[tuple[int, int, int, int]] = []
    for i, (offset, nbytes) in enumerate(zip(offsets, sizes)):
        if nbytes == 0:
            out.append((offset, offset, i, 0))
        for k, start in enumerate(range(offset, offset + nbytes, chunk_bytes)):
            out.append((start, min(start + chunk_bytes, offset + nbytes), i, k))
    return out


async def run_groups(fn: Callable[[list[G]], None], groups: list[list[G]],
                     limiter: anyio.CapacityLimiter) -> None:
    """Run ``fn`` on each group in its own worker thread, all at once, under ``limiter``.

    The first error of a group is raised as it is (not wrapped in an exception group).
    """
    try:
        async with anyio.create_task_group() as tg:
            for group in groups:
                tg.start_soon(in_thread, limiter, fn, group)
    except Exception as exc:
        raise first_leaf(exc) from None


def first_leaf(exc: BaseException) -> BaseException:
    inner = getattr(exc, "exceptions", None)
    while inner:
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc

