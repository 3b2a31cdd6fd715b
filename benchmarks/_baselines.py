"""The floors: a test state, and the same bytes written durably the plain ways.

Each writer makes its file durable the same way (fsync of the file, rename to its final name,
fsync of the directory), so that any of them can stand against a checkpoint of the same state.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

__all__ = (
    "aiofiles_write_fsync",
    "byte_views",
    "chunked",
    "iter_tensors",
    "make_state",
    "plain_write_fsync",
    "pwrite_threads_fsync",
    "torch_save",
)



def make_state(total_bytes: int, tensors: int, seed: int = 0) -> dict[str, Any]:
    """A nested dict of float32 CPU tensors of random values, about ``total_bytes`` in all."""
    numel = max(1, total_bytes // tensors // 4)
    gen = torch.Generator().manual_seed(seed)
    half = tensors // 2
    model = {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(half)}
    optim = {f"exp_avg.{i}": torch.randn(numel, generator=gen) for i in range(tensors - half)}
    return {"model": model, "optim": optim}


def iter_tensors(state: Any) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from iter_tensors(value)


def byte_views(state: Any) -> list[memoryview]:
    return [memoryview(t.numpy()).cast("B") for t in iter_tensors(state)]


def chunked(views: list[memoryview], chunk_bytes: int) -> list[tuple[int, memoryview]]:
    """(file offset, bytes) pieces of at most ``chunk_bytes``, the views laid end to end."""
    pieces = []
    offset = 0
    for view in views:
        for start in range(0, view.nbytes, chunk_bytes):
            piece = view[start:start + chunk_bytes]
            pieces.append((offset, piece))
            offset += piece.nbytes
    return pieces


# --- durable writes ---------------------------------------------------------------------------


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def plain_write_fsync(pieces: list[tuple[int, memoryview]], final: Path) -> None:
    tmp = final.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset, piece in pieces:
            _pwrite_all(fd, piece, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    _publish(tmp, final)


def pwrite_threads_fsync(
    pieces: list[tuple[int, memoryview]], final: Path, pool: ThreadPoolExecutor, *,
    direct: bool = False,
) -> None:
    """The pieces written from the pool's threads into disjoint ranges, fsync, publish.

    With ``direct`` through an ``O_DIRECT`` descriptor (no page cache): every piece must then
    start at a 4 KiB-aligned address and offset and be a multiple of 4 KiB long (the caller
    checks); raises OSError where the file system refuses direct I/O.
    """
    tmp = final.with_suffix(".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        futures = [pool.submit(_pwrite_all, fd, piece, offset) for offset, piece in pieces]
        for future in futures:
            future.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    _publish(tmp, final)


async def _aiofiles_write(pieces: list[tuple[int, memoryview]], final: Path) -> None:
    import aiofiles
    import aiofiles.os

    tmp = final.with_suffix(".tmp")
    async with aiofiles.open(tmp, "wb") as f:
        for _, piece in pieces:
            await f.write(piece)
        await f.flush()
        await asyncio.to_thread(os.fsync, f.fileno())
    await aiofiles.os.rename(tmp, final)
    await asyncio.to_thread(_fsync_dir, final.parent)


def aiofiles_write_fsync(pieces: list[tuple[int, memoryview]], final: Path) -> None:
    asyncio.run(_aiofiles_write(pieces, final))


def torch_save(state: dict[str, Any], final: Path) -> None:
    tmp = final.with_suffix(".tmp")
    torch.save(state, tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _publish(tmp, final)
