"""Stage 2, serialize: checksum the host copy chunk by chunk and encode the shard header."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio

from ._format import PREAMBLE_SIZE, ShardHeader, TensorRecord, checksum, encode_header
from ._hostmem import byte_view
from ._job import SaveJob

__all__ = ("run_groups", "serialize", "split_balanced", "tensor_chunks")


R = TypeVar("R", bound=tuple[int, ...])


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


async def serialize(job: SaveJob, *, chunk_bytes: int, threads: int,
                    limiter: anyio.CapacityLimiter) -> None:
    """Fill ``job.checksums`` (one xxh3 per chunk of each tensor) and ``job.header``."""
    assert job.slot is not None
    buffer = job.slot.buffer
    chunks = tensor_chunks(job.offsets, job.sizes, chunk_bytes)
    per_tensor: list[list[int]] = [[0] * max(1, -(-n // chunk_bytes)) for n in job.sizes]

    def run(group: list[tuple[int, int, int, int]]) -> None:
        for start, end, i, k in group:
            per_tensor[i][k] = checksum(byte_view(buffer, start, end))

    await run_groups(run, split_balanced(chunks, threads), limiter)
    job.checksums = [tuple(c) for c in per_tensor]
    records = tuple(
        TensorRecord(path, dtype, shape, PREAMBLE_SIZE + offset, nbytes, sums, device, layout)
        for path, dtype, shape, offset, nbytes, sums, device, layout in zip(
            job.paths, job.dtypes, job.shapes, job.offsets, job.sizes, job.checksums,
            job.devices, job.layouts)
    )
    job.header = encode_header(ShardHeader(
        step=job.step, rank=job.rank, world_size=job.world_size, save_id=job.save_id,
        created_unix=time.time(), chunk_bytes=chunk_bytes, data_offset=PREAMBLE_SIZE,
        data_length=job.data_length, tensors=records, tree=job.tree,
        train_state=job.train_state,
    ))


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


async def run_groups(fn: Callable[[list[R]], None], groups: list[list[R]],
                     limiter: anyio.CapacityLimiter) -> None:
    """Run ``fn`` on each group in its own worker thread, all at once, under ``limiter``.

    The first error of a group is raised as it is (not wrapped in an exception group).
    """
    try:
        async with anyio.create_task_group() as tg:
            for group in groups:
                tg.start_soon(_run_sync, fn, group, limiter)
    except Exception as exc:
        raise _first_leaf(exc) from None


def _first_leaf(exc: BaseException) -> BaseException:
    inner = getattr(exc, "exceptions", None)
    while inner:
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc


async def _run_sync(fn: Callable[[list[R]], None], group: list[R],
                    limiter: anyio.CapacityLimiter) -> None:
    await anyio.to_thread.run_sync(fn, group, limiter=limiter)
