"""Stage 2, write_data: the host copy into a temporary shard file, hashed as it is written."""

from __future__ import annotations

import errno
import functools
import queue
import time
from bisect import bisect_left, bisect_right

import anyio
import torch

from .._crash import crash_point
from .._format.documents import encode_tree
from .._format.header import contiguous_stride
from .._format.limits import ALIGN, CHECKSUM_BLOCK_BYTES, MAX_HEADER_BYTES, MIN_CHUNK_BYTES
from .._format.names import shard_name, step_dir_name
from .._format.publish import close_quietly
from .._format.region import align_down, align_up, checksum, region_chunks
from .._format.shard import PREAMBLE_SIZE, encode_header_fields
from .._hostmem import byte_view
from .._parallel import first_leaf, run_groups, split_balanced
from .._threads import in_thread
from .._tiers.replica.push import Push
from ..errors import StorageError
from ..storage import Storage
from .copy import Snapshot
from .copy_streamed import copy_piece
from .job import DataWritten, SaveJob

__all__ = ("chunk_sizes", "hash_data", "required_bytes", "write_data")


def chunk_sizes(data_end: int, chunk_bytes: int, threads: int) -> tuple[int, int]:
    """(write chunk, checksum block) of a save. The write chunk is ``chunk_bytes``, or smaller
    for a small shard (never below ``MIN_CHUNK_BYTES``), so that every I/O thread gets chunks
    to write and, at restore, to read and verify; a multiple of the block. The block is
    ``CHECKSUM_BLOCK_BYTES``, or the chunk when that is smaller: what the header records as
    its ``chunk_bytes`` and a range read verifies whole."""
    share = align_up(-(-data_end // (2 * threads)))
    chunk = max(ALIGN, min(chunk_bytes, max(MIN_CHUNK_BYTES, share)))
    block = min(chunk, CHECKSUM_BLOCK_BYTES)
    return chunk // block * block, block


def required_bytes(job: SaveJob, chunk_bytes: int) -> int:
    """Bytes a save needs on disk (an upper bound): shard data, header, small files."""
    chunks = -(-job.data.data_end // chunk_bytes)
    header = (len(job.tree) + 4 * ALIGN + sum(len(p) + 128 for p in job.paths) + 9 * chunks
              + 40 * len(job.data.items) + len(encode_tree(job.train_state)))
    return job.data.data_end + header + 3 * ALIGN


async def write_data(job: SaveJob, storage: Storage, *, chunk_bytes: int, threads: int,
                     limiter: anyio.CapacityLimiter, direct_io: bool = True) -> DataWritten:
    """Write the data region into a new temporary shard file, then encode the shard header.

    One pass over host memory: each checksum chunk of the region is hashed (xxh3) right
    before it is written at its offset, by several threads at once. With ``direct_io`` the
    aligned part of each chunk goes through a second descriptor opened with ``O_DIRECT`` (no
    page cache, no copy into it) and the unaligned end of the region through the first one;
    where the file system refuses direct I/O the same writes go through the page cache. A
    streamed snapshot (state larger than the host buffer) is copied here, a piece at a time,
    each piece written while the next is copied; the result's ``copy_seconds`` are then until
    the last copy was launched. The temporary shard is left open (``job.files.fd``) for
    ``seal``; the result holds the encoded header.
    """
    job.files.dir_name = step_dir_name(job.step)
    layout = job.data
    chunk, block = chunk_sizes(layout.data_end, chunk_bytes, threads)
    need = required_bytes(job, block)
    free = await in_thread(limiter, storage.free_bytes)
    if free < need:
        raise StorageError(
            f"not enough free space: the save needs {need} bytes, {free} are free",
            step=job.step, rank=job.rank, path=str(storage.root),
            hint="free disk space, lower keep_last, or use a larger disk")
    await in_thread(limiter, storage.make_dir, job.files.dir_name)
    fd, temp = await in_thread(limiter, storage.create_temp, job.files.dir_name,
                               shard_name(job.rank))
    job.files.created(temp)
    job.files.fd = fd
    if job.push is not None:  # connect to the holders of the copies before the first chunk
        await in_thread(limiter, job.push.open, layout.data_end + MAX_HEADER_BYTES)
    assert job.slot is not None and job.snapshot is not None
    buffer = job.slot.buffer
    chunks = _chunks(layout.data_end, chunk, block)
    sums = [0] * len(region_chunks(PREAMBLE_SIZE, layout.data_end, block))
    direct: int | None = None
    if direct_io and buffer.data_ptr() % ALIGN == 0 and chunks:
        direct = await in_thread(limiter, storage.open_direct, job.files.dir_name, temp)
    snap = job.snapshot
    writer = _ChunkWriter(storage, fd, direct, buffer, block, sums, snap.copied,
                          [item.offset for item in layout.items], job.push)
    copied: float | None = None
    try:
        if snap.streaming:
            copied = await _stream(job, writer, chunks, threads, limiter)
        elif snap.has_device_copies:
            copied = await _overlapped(snap, writer, chunks, threads, limiter)
        else:
            await run_groups(writer.run, split_balanced(chunks, threads), limiter)
    except BaseException:
        if direct is not None:
            with anyio.CancelScope(shield=True):
                await in_thread(limiter, close_quietly, storage, direct)
        raise
    if direct is not None:
        await in_thread(limiter, storage.close, direct)
    crash_point("write_data.done")
    return DataWritten(await _encode_header(job, block, sums, limiter), copied)


async def hash_data(job: SaveJob, *, chunk_bytes: int, threads: int,
                    limiter: anyio.CapacityLimiter) -> DataWritten:
    """``write_data`` for the memory tier: the data region stays where the snapshot copied
    it (the buffer is the shard); each checksum chunk is hashed as its copies land, by
    several threads, then the header is encoded."""
    layout = job.data
    chunk, block = chunk_sizes(layout.data_end, chunk_bytes, threads)
    assert job.slot is not None and job.snapshot is not None
    chunks = _chunks(layout.data_end, chunk, block)
    sums = [0] * len(region_chunks(PREAMBLE_SIZE, layout.data_end, block))
    hasher = _Hasher(job.slot.buffer, block, sums, job.snapshot.copied,
                     [item.offset for item in layout.items])
    snap = job.snapshot
    copied: float | None = None
    if snap.has_device_copies:
        copied = await _overlapped(snap, hasher, chunks, threads, limiter)
    else:
        await run_groups(hasher.run, split_balanced(chunks, threads), limiter)
    return DataWritten(await _encode_header(job, block, sums, limiter), copied)


async def _encode_header(job: SaveJob, block: int, sums: list[int],
                         limiter: anyio.CapacityLimiter) -> bytes:
    layout = job.data
    return await in_thread(limiter, functools.partial(
        encode_header_fields, step=job.step, rank=job.rank, world_size=job.world_size,
        save_id=job.save_id, created_unix=time.time(), chunk_bytes=block,
        data_offset=PREAMBLE_SIZE, data_length=layout.data_length, checksums=sums,
        storages=layout.storage_records(),
        tensors=(
            (path, dtype, shape, contiguous_stride(shape) if stride is None else stride, item,
             offset, dist)
            for path, dtype, shape, stride, item, offset, dist in zip(
                job.paths, job.dtypes, job.shapes, layout.tensor_stride, layout.tensor_item,
                layout.tensor_offset, job.layouts)),
        tensor_count=len(job.paths), tree=job.tree, train_state=job.train_state,
        meshes=job.meshes))


Chunk = tuple[int, int, int]  # (start, end) file offsets of a write chunk, its first block's index


def _chunks(data_end: int, chunk: int, block: int) -> list[Chunk]:
    """The write chunks of the data region, each with the index of its first checksum block
    (a chunk is a multiple of the block, so its blocks are the region's)."""
    first = PREAMBLE_SIZE // block
    return [(a, b, a // block - first)
            for a, b in region_chunks(PREAMBLE_SIZE, data_end, chunk)]


class _ChunkWriter:
    """Hash and write chunks from a host buffer; shared by the worker threads of one save."""

    def __init__(self, storage: Storage, fd: int, direct: int | None, buffer: torch.Tensor,
                 block: int, sums: list[int], copied: dict[int, torch.cuda.Event],
                 item_offsets: list[int], push: Push | None = None) -> None:
        self.push = push  # the copies for other ranks: each chunk is sent once written
        self.copied = copied  # device copies still running into the buffer, per stored item
        self.storage = storage
        self.fd = fd
        self.direct = direct
        self.buffer = buffer
        self.block = block
        self.sums = sums
        self.item_offsets = item_offsets
        self.refused = False  # a direct write was refused: buffered writes from then on

    def chunk(self, chunk: Chunk, at: int) -> None:
        """Hash and write one chunk whose bytes are at ``buffer[at:]``; then send it to the
        holders of the copies (if any), from the same memory."""
        self._write(chunk, at)
        if self.push is not None:
            for k, lo, hi in self.blocks(chunk):
                self.push.send(lo, byte_view(self.buffer, at + lo - chunk[0],
                                             at + hi - chunk[0]), self.sums[k])

    def blocks(self, chunk: Chunk) -> list[tuple[int, int, int]]:
        """(index, start, end) of each checksum block of ``chunk``."""
        start, end, k = chunk
        return [(k + j, lo, hi) for j, (lo, hi) in enumerate(region_chunks(start, end,
                                                                           self.block))]

    def hash(self, chunk: Chunk, at: int) -> None:
        """The checksum of each block of ``chunk``, whose bytes are at ``buffer[at:]``."""
        for k, lo, hi in self.blocks(chunk):
            self.sums[k] = checksum(byte_view(self.buffer, at + lo - chunk[0],
                                              at + hi - chunk[0]))

    def _write(self, chunk: Chunk, at: int) -> None:
        """Hash and write one chunk whose bytes are at ``buffer[at:]``.

        The buffer holds the file's bytes around the chunk at the same alignment, so the
        direct write may start at the page the chunk starts in (before the data region, that
        is the preamble's page, which ``seal`` writes last).
        """
        start, end, _k = chunk
        stop = at + end - start
        self.hash(chunk, at)
        if self.direct is not None and not self.refused:
            first = align_down(start)
            last = end if end % ALIGN == 0 else align_down(end)
            try:
                if last > first:
                    self.storage.pwrite(self.direct,
                                        byte_view(self.buffer, at - (start - first),
                                                  at + (last - start)), first)
                if last < end:  # the unaligned end of the region
                    lo = max(start, last)
                    self.storage.pwrite(self.fd, byte_view(self.buffer, at + lo - start, stop),
                                        lo)
                return
            except StorageError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.refused = True
        self.storage.pwrite(self.fd, byte_view(self.buffer, at, stop), start)

    def wait_copied(self, start: int, end: int) -> None:
        """Wait for the device copies into [start, end) (the last one per stream suffices)."""
        if not self.copied:
            return
        offsets = self.item_offsets
        first = max(0, bisect_right(offsets, start) - 1)
        seen: dict[int, torch.cuda.Event] = {}
        for k in range(first, bisect_left(offsets, end)):
            event = self.copied.get(k)
            if event is not None:
                seen[id(event)] = event
        for event in seen.values():
            event.synchronize()

    def run(self, group: list[Chunk]) -> None:
        """Chunks laid out in the buffer as in the file (the whole state fits).

        A chunk whose device copies may still run waits for them first.
        """
        for chunk in group:
            self.wait_copied(chunk[0], chunk[1])
            self.chunk(chunk, chunk[0])


class _Hasher(_ChunkWriter):
    """A chunk writer that only hashes: the bytes stay in the buffer (the memory tier)."""

    def __init__(self, buffer: torch.Tensor, block: int, sums: list[int],
                 copied: dict[int, torch.cuda.Event], item_offsets: list[int]) -> None:
        self.copied = copied
        self.buffer = buffer
        self.block = block
        self.sums = sums
        self.item_offsets = item_offsets
        self.push = None

    def chunk(self, chunk: Chunk, at: int) -> None:
        self.hash(chunk, at)


async def _overlapped(snap: Snapshot, writer: _ChunkWriter, chunks: list[Chunk], threads: int,
                      limiter: anyio.CapacityLimiter) -> float:
    """Hash and write while the device copies finish; then check the snapshot was not torn.

    Returns the seconds until the last copy was done.
    """
    started = time.perf_counter()
    done = [0.0]

    def copies_done() -> None:
        for _device, event in snap.events:
            event.synchronize()
        done[0] = time.perf_counter() - started

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(in_thread, None, copies_done)  # a waiter, not I/O
            tg.start_soon(run_groups, writer.run, split_balanced(chunks, threads), limiter)
    except Exception as exc:
        raise first_leaf(exc) from None
    await in_thread(limiter, snap.release_by_pipeline)
    if snap.torn is not None:
        raise snap.torn
    return done[0]


def pieces_of(chunks: list[Chunk], piece_bytes: int) -> list[tuple[int, list[Chunk]]]:
    """Consecutive chunks grouped so that each group, from the aligned offset before its first
    chunk, spans at most ``piece_bytes``. Returns (that aligned file offset, the chunks)."""
    out: list[tuple[int, list[Chunk]]] = []
    for chunk in chunks:
        if not out or align_up(chunk[1]) - out[-1][0] > piece_bytes:
            out.append((align_down(chunk[0]), []))
        out[-1][1].append(chunk)
    return out


async def _stream(job: SaveJob, writer: _ChunkWriter, chunks: list[Chunk], threads: int,
                  limiter: anyio.CapacityLimiter) -> float:
    """Copy a streamed snapshot through the host buffer a piece at a time, writing each.

    The buffer is cut into segments; one thread launches the copies of the next piece into a
    free segment while the others hash and write the pieces already copied. Sets the
    snapshot's final events and ``enqueued`` once every copy is launched (or on failure), so
    that ``wait_snapshot`` never waits forever. Returns the seconds until then.
    """
    snap = job.snapshot
    assert snap is not None
    buffer = writer.buffer
    chunk_bytes = max((b - a for a, b, _k in chunks), default=ALIGN)
    segments = max(2, min(threads, buffer.numel() // chunk_bytes))
    segment_bytes = buffer.numel() // segments // ALIGN * ALIGN
    pieces = pieces_of(chunks, segment_bytes)
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(segments):
        free.put(index)
    work: queue.SimpleQueue[tuple[int, list[Chunk], int, list[torch.cuda.Event]] | None] = \
        queue.SimpleQueue()
    errors: list[BaseException] = []
    writers = max(1, min(threads, segments - 1, len(pieces)))
    started = time.perf_counter()
    launched = [0.0]

    def drive() -> None:
        latest: dict[int, torch.cuda.Event] = {}
        try:
            for base, group in pieces:
                segment = free.get()
                if errors:
                    break
                at = segment * segment_bytes
                done = copy_piece(snap, group[0][0], group[-1][1],
                                  buffer[at:at + segment_bytes], base)
                latest.update(done)
                work.put((base, group, at, list(done.values())))
        except BaseException as exc:
            errors.append(exc)
        finally:
            snap.events = [(torch.device("cuda", i), e) for i, e in latest.items()]
            launched[0] = time.perf_counter() - started
            snap.enqueued.set()
            for _ in range(writers):
                work.put(None)

    def write() -> None:
        while (item := work.get()) is not None:
            base, group, at, events = item
            try:
                if not errors:
                    for event in events:
                        event.synchronize()
                    for chunk in group:
                        writer.chunk(chunk, at + chunk[0] - base)
            except BaseException as exc:
                errors.append(exc)
            finally:
                free.put(at // segment_bytes)

    async with anyio.create_task_group() as tg:
        # Not under the I/O limiter: the writers must be able to run while it waits for them.
        tg.start_soon(in_thread, None, drive)
        for _ in range(writers):
            tg.start_soon(in_thread, limiter, write)
    if errors:
        raise errors[0]
    await in_thread(limiter, snap.release_by_pipeline)
    if snap.torn is not None:
        raise snap.torn
    return launched[0]
