"""The floors: a test state, and the same bytes written durably and read back the plain ways.

Each writer makes its file durable the same way (fsync of the file, rename to its final name,
fsync of the directory), so that any of them can stand against a checkpoint of the same state.
The reader reads a file with ``os.preadv`` from a pool of threads; ``drop_page_cache`` makes its
next read cold (``POSIX_FADV_DONTNEED`` after fsync, which needs no privileges for clean pages)
and ``resident_fraction`` says how much of a file the page cache holds (``mincore``).
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
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
    "coalesced",
    "drop_page_cache",
    "drop_page_cache_tree",
    "iter_tensors",
    "make_state",
    "plain_read_threads",
    "plain_write_fsync",
    "pread_all",
    "pwrite_threads_fsync",
    "resident_fraction",
    "torch_save",
    "warm_page_cache",
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
    elif isinstance(state, (list, tuple)):
        for value in state:
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


def coalesced(views: list[memoryview], min_bytes: int) -> list[memoryview]:
    """The same bytes in the same order, each run of views smaller than ``min_bytes`` joined
    into one buffer: what a writer gathers before it writes many small tensors."""
    out: list[memoryview] = []
    run: list[memoryview] = []
    for view in views:
        if view.nbytes >= min_bytes:
            if run:
                out.append(memoryview(b"".join(run)))
                run = []
            out.append(view)
        else:
            run.append(view)
    if run:
        out.append(memoryview(b"".join(run)))
    return out


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


# --- reads and the page cache ----------------------------------------------------------------


def pread_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"short read at offset {offset}")
        view = view[n:]
        offset += n


def plain_read_threads(path: Path, buffer: memoryview, pool: ThreadPoolExecutor,
                       piece_bytes: int) -> int:
    """Read the whole file into ``buffer`` (at least the file's size), ``piece_bytes`` at a
    time into disjoint ranges from the pool's threads; the number of bytes read."""
    size = path.stat().st_size
    if size > buffer.nbytes:
        raise ValueError(f"{path} holds {size} bytes, more than the {buffer.nbytes} of the buffer")
    fd = os.open(path, os.O_RDONLY)
    try:
        futures = [pool.submit(pread_all, fd, buffer[start:min(start + piece_bytes, size)], start)
                   for start in range(0, size, piece_bytes)]
        for future in futures:
            future.result()
    finally:
        os.close(fd)
    return size


def drop_page_cache(path: Path) -> bool:
    """Ask the kernel to drop a file's (clean) pages from the page cache; False if it can't."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def drop_page_cache_tree(root: Path) -> int:
    """``drop_page_cache`` for every regular file under ``root``; the number of files dropped."""
    dropped = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            dropped += drop_page_cache(Path(dirpath) / name)
    return dropped


def warm_page_cache(path: Path, piece_bytes: int = 8 << 20) -> int:
    """Read a file through once, so that the page cache holds it; the bytes read."""
    buffer = bytearray(piece_bytes)
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [buffer]):
            total += n
    finally:
        os.close(fd)
    return total


def resident_fraction(path: Path) -> float | None:
    """The fraction of a file's pages in the page cache (``mincore``); None where unknown."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vector) != 0:
                return None
            return sum(1 for byte in bytes(vector) if byte & 1) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
