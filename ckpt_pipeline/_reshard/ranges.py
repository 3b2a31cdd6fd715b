"""Verified byte ranges of one saved shard file.

A shard's data region is checksummed in blocks (``region_chunks``: cut at the multiples of the
header's ``chunk_bytes``, 4 MiB as this library writes them, 64 MiB in shards written before
it; each with its xxh3-64 in the header). A range read reads every block it touches whole,
verifies it, and copies the range out of it; the last few blocks stay cached, so that
neighbouring ranges (the pieces of one tensor, tensors next to each other) read a block once.
What a range costs beyond its own bytes is therefore at most one block on each side, and a
block shared with a neighbour is not read again.

``read_box`` copies one box of a saved tensor (its record's view of a storage: offset, shape,
stride) into a destination tensor, one span at a time (``runs.spans``: gaps shorter than a
block read through, at most ``bound`` bytes a span), each viewed with the record's strides.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections import OrderedDict

import torch

from .._format.header import ShardHeader, TensorRecord
from .._format.limits import DTYPES
from .._format.names import shard_name
from .._format.region import checksum
from .._format.scan import StepStatus
from ..errors import CheckpointIntegrityError
from ..storage import Storage
from .boxes import Box
from .runs import spans

__all__ = ("ShardRanges",)

_CACHED_CHUNKS = 2


class ShardRanges:
    """Range reads of one saved rank's shard of a step (see the module docstring). Not
    thread-safe: one reader a thread."""

    def __init__(self, storage: Storage, status: StepStatus, rank: int, *,
                 bound: int = 64 * 1024 * 1024) -> None:
        header = status.header
        if header is None:
            raise CheckpointIntegrityError("step was not validated", step=status.step,
                                           rank=rank, path=status.path)
        self.header: ShardHeader = header
        self.status = status
        self.rank = rank
        self.storage = storage
        self.rel = os.path.join(status.dir_name, status.shard_file or shard_name(rank))
        self.checks = header.checks()
        self.starts = [start for start, _, _ in self.checks]
        self.block = max((end - start for start, end, _ in self.checks), default=0)
        """The largest checksummed range: what a range read may read beyond each end."""
        self.bound = bound
        """The most bytes one span of ``read_box`` copies at a time."""
        self.records = {record.path: record for record in header.tensors}
        self.bytes_read = 0
        self._cache: OrderedDict[int, bytearray] = OrderedDict()
        self._fd, _ = storage.open_read(self.rel, status.shard_size)

    def close(self) -> None:
        self.storage.close(self._fd)
        self._cache.clear()

    def read(self, start: int, end: int) -> bytearray:
        """The file's bytes [start, end) of the data region, every chunk they touch verified."""
        out = bytearray(end - start)
        at = start
        while at < end:
            i = bisect_right(self.starts, at) - 1
            if i < 0 or at >= self.checks[i][1]:
                raise CheckpointIntegrityError(
                    f"bytes {at}-{end} lie outside the shard's data region", step=self.status.step,
                    rank=self.rank,
                    path=os.path.join(str(self.status.path), os.path.basename(self.rel)))
            lo, hi, _ = self.checks[i]
            chunk = self._chunk(i)
            stop = min(end, hi)
            out[at - start:stop - start] = chunk[at - lo:stop - lo]
            at = stop
        return out

    def _chunk(self, i: int) -> bytearray:
        cached = self._cache.get(i)
        if cached is not None:
            self._cache.move_to_end(i)
            return cached
        lo, hi, expected = self.checks[i]
        buf = bytearray(hi - lo)
        self.storage.pread_into(self._fd, memoryview(buf), lo)
        self.bytes_read += hi - lo
        if checksum(memoryview(buf)) != expected:
            raise CheckpointIntegrityError(
                f"checksum mismatch in bytes {lo}-{hi} of rank {self.rank}'s shard",
                step=self.status.step, rank=self.rank,
                path=os.path.join(str(self.status.path), os.path.basename(self.rel)),
                hint="the shard is corrupt")
        self._cache[i] = buf
        if len(self._cache) > _CACHED_CHUNKS:
            self._cache.popitem(last=False)
        return buf

    def read_box(self, record: TensorRecord, box: Box, out: torch.Tensor) -> None:
        """Copy ``box`` (in the coordinates of the saved tensor ``record``) into ``out``."""
        dtype = DTYPES[record.dtype]
        item = dtype.itemsize
        base = self.header.storages[record.storage].offset + record.byte_offset
        for part in spans(box, record.stride, item, gap=self.block, bound=self.bound):
            first = sum(o * s for o, s in zip(part.offsets, record.stride))
            last = sum((o + n - 1) * s
                       for o, n, s in zip(part.offsets, part.sizes, record.stride))
            raw = self.read(base + first * item, base + (last + 1) * item)
            flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
            out[part.relative_to(box).index()].copy_(flat.as_strided(part.sizes,
                                                                     record.stride))
