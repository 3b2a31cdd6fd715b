"""Stage 3, write: the shard and manifest of this rank, durable under their final names.

Each file is published as: create a temporary name, write everything, fsync, close, link to the
final name (never replacing one), fsync the directory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import anyio

from .._crash import crash_point
from .._format.documents import Manifest, encode_manifest
from .._format.names import manifest_name, shard_name
from .._format.shard import PREAMBLE_SIZE, align_up, checksum, encode_preamble
from .._restore.scan import tidy_step_dir
from ..errors import StorageError
from ..storage import Storage
from .job import SaveJob

__all__ = ("close_quietly", "publish_small", "remove_published", "write_shard")


async def _thread(fn: Callable[..., Any], *args: Any, limiter: anyio.CapacityLimiter) -> Any:
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


async def write_shard(job: SaveJob, storage: Storage, *,
                      limiter: anyio.CapacityLimiter) -> None:
    """Finish the shard the serialize stage streamed, publish it, then the manifest.

    Header and preamble go after the data, then fsync, close, link to the final name; on
    return the shard and the manifest are durable under their final names.
    """
    fd = job.fd
    assert fd is not None
    header_offset = align_up(PREAMBLE_SIZE + job.data_length)
    try:
        await _thread(storage.pwrite, fd, memoryview(job.header), header_offset,
                      limiter=limiter)
        preamble = memoryview(encode_preamble(header_offset, job.header))
        await _thread(storage.pwrite, fd, preamble, 0, limiter=limiter)
        await _thread(storage.fsync, fd, limiter=limiter)
        crash_point("write.shard_fsynced")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _thread(close_quietly, storage, fd, limiter=limiter)
        job.fd = None
        raise
    job.fd = None
    await _thread(storage.close, fd, limiter=limiter)
    job.shard_size = header_offset + len(job.header)
    final = shard_name(job.rank)
    temp = job.temp_names[-1]
    await _thread(storage.publish, job.dir_name, temp, final, limiter=limiter)
    job.temp_names.remove(temp)
    job.published.append(final)
    crash_point("write.shard_published")

    manifest = encode_manifest(Manifest(
        step=job.step, rank=job.rank, world_size=job.world_size, save_id=job.save_id,
        shard_size=job.shard_size, header_checksum=checksum(job.header),
        data_bytes=job.data_bytes))
    await publish_small(job, storage, manifest_name(job.rank), manifest, limiter=limiter)
    crash_point("write.done")


async def publish_small(job: SaveJob, storage: Storage, final: str, data: bytes, *,
                        limiter: anyio.CapacityLimiter) -> None:
    """Publish a small file durably in the job's step directory (directory fsynced too)."""

    def publish() -> None:
        fd, temp = storage.create_temp(job.dir_name, final)
        job.temp_names.append(temp)
        try:
            storage.pwrite(fd, memoryview(data), 0)
            storage.fsync(fd)
        except BaseException:
            close_quietly(storage, fd)
            raise
        storage.close(fd)
        storage.publish(job.dir_name, temp, final)
        job.temp_names.remove(temp)
        job.published.append(final)
        storage.fsync_dir(job.dir_name)

    await _thread(publish, limiter=limiter)


def close_quietly(storage: Storage, fd: int) -> None:
    """Close a descriptor on a path that is failing already: a close error adds nothing."""
    with contextlib.suppress(StorageError):
        storage.close(fd)


def remove_published(job: SaveJob, storage: Storage) -> None:
    """Undo a failed save: temporaries and this rank's published files of the step.

    Runs in a worker thread. The commit record is removed first, so that nothing on disk looks
    complete while the rest is being removed.
    """
    if job.fd is not None:
        close_quietly(storage, job.fd)
        job.fd = None
    if not job.dir_name:
        return
    names = sorted(job.published, key=lambda n: not n.endswith(".commit"))
    for name in [*names, *job.temp_names]:
        with contextlib.suppress(StorageError):
            storage.unlink(os.path.join(job.dir_name, name))
            if name.endswith(".commit"):
                storage.fsync_dir(job.dir_name)  # gone for good before the data go
    job.published.clear()
    job.temp_names.clear()
    with contextlib.suppress(StorageError):
        tidy_step_dir(storage, job.dir_name)
