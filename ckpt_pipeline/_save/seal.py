"""Stage 3, seal: the shard and manifest of this rank, durable under their final names.

Each file is published as: create a temporary name, write everything, fsync, close, link to the
final name (never replacing one), fsync the directory (``_format/publish.py``).
"""

from __future__ import annotations

import anyio

from .._crash import crash_point
from .._format.documents import Manifest, encode_manifest
from .._format.names import manifest_name, shard_name
from .._format.publish import close_quietly
from .._format.region import checksum
from .._format.shard import encode_preamble
from .._threads import in_thread
from ..storage import Storage
from .job import SaveJob, Sealed

__all__ = ("publish_small", "seal")


async def seal(job: SaveJob, storage: Storage, *, limiter: anyio.CapacityLimiter) -> Sealed:
    """Finish the shard that write_data streamed, publish it, then the manifest.

    Header and preamble go after the data, then fsync, close, link to the final name; on
    return the shard and the manifest are durable under their final names.
    """
    fd = job.files.fd
    assert fd is not None and job.written is not None
    header = job.written.header
    header_offset = job.data.data_end
    try:
        await in_thread(limiter, storage.pwrite, fd, memoryview(header), header_offset)
        preamble = memoryview(encode_preamble(header_offset, header))
        await in_thread(limiter, storage.pwrite, fd, preamble, 0)
        await in_thread(limiter, storage.fsync, fd)
        crash_point("seal.shard_fsynced")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await in_thread(limiter, close_quietly, storage, fd)
        job.files.fd = None
        raise
    job.files.fd = None
    await in_thread(limiter, storage.close, fd)
    shard_size = header_offset + len(header)
    final = shard_name(job.rank)
    temp = job.files.temps[-1]
    await in_thread(limiter, job.files.publish, storage, temp, final)
    crash_point("seal.shard_published")

    manifest = encode_manifest(Manifest(
        step=job.step, rank=job.rank, world_size=job.world_size, save_id=job.save_id,
        shard_size=shard_size, header_checksum=checksum(header),
        data_bytes=job.data_bytes))
    await publish_small(job, storage, manifest_name(job.rank), manifest, limiter=limiter)
    crash_point("seal.done")
    return Sealed(shard_size, bytes(preamble), manifest)


async def publish_small(job: SaveJob, storage: Storage, final: str, data: bytes, *,
                        limiter: anyio.CapacityLimiter) -> None:
    """Publish a small file durably in the job's step directory (directory fsynced too)."""
    await in_thread(limiter, job.files.publish_small, storage, final, data)
