"""Stage 2, serialize: the host copy into a temporary shard file, hashed as it is written."""

from __future__ import annotations

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
                    limiter: anyio.CapacityLimiter) -> None:
    """Stream the host copy into a new temporary shard file, then encode the shard header.

    One pass over host memory: each chunk is hashed (xxh3) right before it is written with
    ``pwrite`` at its offset, by several threads at once. Fills ``job.fd`` (left open for the
    write stage) and ``job.header``.
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

    def run(group: list[tuple[int, int, int, int]]) -> None:
        for start, end, i, k in group:
            view = byte_view(buffer, start, end)
            per_tensor[i][k] = checksum(view)
            if end > start:
                storage.pwrite(fd, view, PREAMBLE_SIZE + start)

    await run_groups(run, split_balanced(chunks, threads), limiter)
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
