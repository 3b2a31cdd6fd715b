"""Stage 2, serialize: the host copy into a temporary shard file, hashed as it is written."""

from __future__ import annotations

import contextlib
import errno
import time

import anyio

from ._crash import crash_point
from ._format import (
    ALIGN,
    PREAMBLE_SIZE,
    ShardHeader,
    TensorRecord,
    align_up,
    checksum,
    chunk_count,
    encode_header,
    encode_tree,
    shard_name,
    step_dir_name,
)
from ._hostmem import byte_view
from ._job import SaveJob
from ._parallel import run_groups, split_balanced, tensor_chunks
from .errors import StorageError
from .storage import Storage

__all__ = ("required_bytes", "serialize")


def required_bytes(job: SaveJob, chunk_bytes: int) -> int:
    """Bytes a save needs on disk (an upper bound): shard data, header, preamble, small files."""
    chunks = sum(chunk_count(n, chunk_bytes) for n in job.sizes)
    header = (len(job.tree) + 4 * ALIGN + sum(len(p) + 128 for p in job.paths) + 9 * chunks
              + len(encode_tree(job.train_state)))
    return align_up(PREAMBLE_SIZE + job.data_length) + header + 3 * ALIGN


async def serialize(job: SaveJob, storage: Storage, *, chunk_bytes: int, threads: int,
                    limiter: anyio.CapacityLimiter, direct_io: bool = True) -> None:
    """Stream the host copy into a new temporary shard file, then encode the shard header.

    One pass over host memory: each chunk is hashed (xxh3) right before it is written at its
    offset, by several threads at once. With ``direct_io`` the bytes go through a second
    descriptor opened with ``O_DIRECT`` (no page cache, no copy into it), each tensor's last
    chunk padded with zeros to the next aligned offset; where the file system refuses direct
    I/O the same writes go through the page cache. Fills ``job.fd`` (left open for the write
    stage) and ``job.header``.
    """
    job.dir_name = step_dir_name(job.step)
    need = required_bytes(job, chunk_bytes)
    free = await anyio.to_thread.run_sync(storage.free_bytes, limiter=limiter)
    if free < need:
        raise StorageError(
            f"not enough free space: the save needs {need} bytes, {free} are free",
            step=job.step, rank=job.rank, path=str(storage.root),
            hint="free disk space, lower keep_last, or use a larger disk")
    await anyio.to_thread.run_sync(storage.make_dir, job.dir_name, limiter=limiter)
    fd, temp = await anyio.to_thread.run_sync(storage.create_temp, job.dir_name,
                                              shard_name(job.rank), limiter=limiter)
    job.temp_names.append(temp)
    job.fd = fd
    assert job.slot is not None
    buffer = job.slot.buffer
    chunks = tensor_chunks(job.offsets, job.sizes, chunk_bytes)
    per_tensor: list[list[int]] = [[0] * chunk_count(n, chunk_bytes) for n in job.sizes]
    direct: int | None = None
    if direct_io and buffer.data_ptr() % ALIGN == 0 and job.data_length > 0:
        direct = await anyio.to_thread.run_sync(storage.open_direct, job.dir_name, temp,
                                                limiter=limiter)
    refused: list[bool] = []  # set when a direct write is refused: buffered writes from then

    def write(start: int, end: int) -> None:
        offset = PREAMBLE_SIZE + start
        if direct is not None and not refused:
            padded = align_up(end)
            if padded > end:
                buffer[end:padded].zero_()  # the gap up to the next tensor reads as zeros
            try:
                storage.pwrite(direct, byte_view(buffer, start, padded), offset)
                return
            except StorageError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                refused.append(True)
        storage.pwrite(fd, byte_view(buffer, start, end), offset)

    def run(group: list[tuple[int, int, int, int]]) -> None:
        for start, end, i, k in group:
            per_tensor[i][k] = checksum(byte_view(buffer, start, end))
            if end > start:
                write(start, end)

    try:
        await run_groups(run, split_balanced(chunks, threads), limiter)
    except BaseException:
        if direct is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_close_quietly, storage, direct,
                                               limiter=limiter)
        raise
    if direct is not None:
        await anyio.to_thread.run_sync(storage.close, direct, limiter=limiter)
    crash_point("serialize.data_written")
    records = tuple(
        TensorRecord(path, dtype, shape, PREAMBLE_SIZE + offset, nbytes, sums, device, layout)
        for path, dtype, shape, offset, nbytes, sums, device, layout in zip(
            job.paths, job.dtypes, job.shapes, job.offsets, job.sizes, map(tuple, per_tensor),
            job.devices, job.layouts)
    )
    job.header = encode_header(ShardHeader(
        step=job.step, rank=job.rank, world_size=job.world_size, save_id=job.save_id,
        created_unix=time.time(), chunk_bytes=chunk_bytes, data_offset=PREAMBLE_SIZE,
        data_length=job.data_length, tensors=records, tree=job.tree,
        train_state=job.train_state,
    ))


def _close_quietly(storage: Storage, fd: int) -> None:
    with contextlib.suppress(StorageError):
        storage.close(fd)
