"""Verified byte ranges of saved shard files, read by several threads at once.

A shard's data region is checksummed in blocks (``region_chunks``: cut at the multiples of the
header's ``chunk_bytes``, 4 MiB as this library writes them, 64 MiB in shards written before
it; each with its xxh3-64 in the header). What a range costs beyond its own bytes is at most
one block on each side, each block read once by one thread, in one of two ways:

- from a local file (``_Stream``): the range's bytes in one read call straight into their
  destination, the rest of the blocks it touches (what no range of the thread needs) into a
  scratch buffer, each block verified from those pieces with a streaming xxh3, in file order,
  before the thread is done;
- from a source where each read is a request (the persistent tier, another rank's copy
  server: ``_Reader``): the blocks a range touches, whole, in one request, each verified
  before any of its bytes is used; when the thread's next range starts in the last block,
  that block stays with the thread, so that it is not read again.

``ShardRanges`` is one saved rank's file (its header, its descriptor; shared by the threads),
in a root, in the persistent tier or in another live rank's root (a ``RangeSource``: there
each read is a ranged request).
``Span`` is one range to copy into a destination tensor (``spans_of`` cuts a box of a saved
tensor into them: ``runs.spans``). ``group_spans`` and ``read_group`` read a list of spans
with several threads, each taking a contiguous run of them in file order, cut where two runs
share no block or, inside a span that fills its destination in order, at a block's end, so
that no block is read twice.
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._format.header import ShardHeader, TensorRecord
from .._format.limits import DTYPES
from .._format.names import shard_name
from .._format.region import checksum, checksum_stream
from .._format.scan import StepStatus
from .._hostmem import byte_view
from ..errors import CheckpointIntegrityError
from ..storage import RangeSource
from .boxes import Box
from .runs import spans

__all__ = ("ShardRanges", "Span", "group_spans", "read_group", "spans_of")


class ShardRanges:
    """One saved rank's shard file of a step, open for range reads (see the module
    docstring); ``close`` once every reader is done."""

    def __init__(self, storage: RangeSource, status: StepStatus, rank: int) -> None:
        header = status.header
        if header is None:
            raise CheckpointIntegrityError("step was not validated", step=status.step,
                                           rank=rank, path=status.path)
        self.header: ShardHeader = header
        self.status = status
        self.rank = rank
        self.storage = storage
        self.rel = os.path.join(status.dir_name,
                                status.shard_file or shard_name(rank))
        self.checks = header.checks()
        self.starts = [start for start, _, _ in self.checks]
        self.block = max((end - start for start, end, _ in self.checks), default=0)
        """The largest checksummed range: what a range read may read beyond each end."""
        self.records = {record.path: record for record in header.tensors}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self._fd, _ = storage.open_read(self.rel, status.shard_size)

    @property
    def path(self) -> str:
        return os.path.join(str(self.status.path), os.path.basename(self.rel))

    def close(self) -> None:
        self.storage.close(self._fd)

    def blocks(self, start: int, end: int) -> tuple[int, int]:
        """The first and last block of the file's bytes [start, end) of the data region."""
        first = bisect_right(self.starts, start) - 1
        last = bisect_right(self.starts, end - 1) - 1
        if first < 0 or end > self.checks[last][1] or end <= start:
            raise CheckpointIntegrityError(
                f"bytes {start}-{end} lie outside the shard's data region",
                step=self.status.step, rank=self.rank, path=self.path)
        return first, last

    def read_blocks(self, first: int, last: int, into: memoryview) -> None:
        """Read blocks ``first`` to ``last`` into ``into`` (their bytes, in one call) and
        verify each."""
        lo = self.checks[first][0]
        self.read_into(lo, into)
        for a, b, expected in self.checks[first:last + 1]:
            if checksum(into[a - lo:b - lo]) != expected:
                raise self.mismatch(a, b)

    def read_into(self, start: int, into: memoryview) -> None:
        """Read the file's bytes [start, start + len(into)) into ``into`` (unverified)."""
        self.storage.pread_into(self._fd, into, start)
        with self._lock:
            self.bytes_read += len(into)

    def mismatch(self, a: int, b: int) -> CheckpointIntegrityError:
        """The error for block [a, b) whose checksum does not match."""
        return CheckpointIntegrityError(
            f"checksum mismatch in bytes {a}-{b} of rank {self.rank}'s shard",
            step=self.status.step, rank=self.rank, path=self.path, hint="the shard is corrupt")


class _Reader:
    """One thread's reads of one shard: a span's blocks into a buffer the caller gives, less
    the first when the previous span ended in it (kept, verified).

    The kept block lives in one host tensor of the shard's largest block, made at the first
    keep and reused (a fresh copy per span would map and unmap memory each time), and every
    copy into or out of it is a tensor copy, which runs without the GIL: a memoryview copy
    of a 4 MiB block holds it throughout, and the other reading threads of the process wait
    for it at the end of each of their reads and checksums. ``read_kept`` serves a range
    inside one block (a direct span's partial head or tail) straight from that tensor, read
    into it first unless it holds that block, so that a block shared by two spans is read
    once and copied only in the parts each span needs."""

    def __init__(self, shard: ShardRanges) -> None:
        self.shard = shard
        self.kept: tuple[int, int] | None = None
        """(block, its length): the block held in ``_kept``."""
        self._kept = torch.empty(0, dtype=torch.uint8)

    def extent(self, start: int, end: int) -> int:
        """The bytes of the blocks [start, end) touches: the buffer ``read`` needs."""
        first, last = self.shard.blocks(start, end)
        return self.shard.checks[last][1] - self.shard.checks[first][0]

    def read(self, start: int, end: int, view: memoryview, *, keep: bool = True) -> int:
        """Read the blocks the file's bytes [start, end) touch into ``view``, every one
        verified; returns where ``start`` is in it. ``keep``: keep the last block for the next
        read (only worth its copy where the next read starts in it)."""
        shard = self.shard
        first, last = shard.blocks(start, end)
        lo, hi = shard.checks[first][0], shard.checks[last][1]
        view = view[:hi - lo]
        at = first
        if self.kept is not None and self.kept[0] == first:
            size = self.kept[1]
            _bytes_of(view[:size]).copy_(self._kept[:size])
            at += 1
        if at <= last:
            shard.read_blocks(at, last, view[shard.checks[at][0] - lo:])
        self.kept = None
        if keep:
            tail = view[shard.checks[last][0] - lo:]
            self._buffer(len(tail))[:len(tail)].copy_(_bytes_of(tail))
            self.kept = (last, len(tail))
        return start - lo

    def _copy_kept(self, start: int, end: int, into: torch.Tensor) -> bool:
        """Copy the file's bytes [start, end) into the host bytes ``into`` from the kept
        block, where it holds them; False (nothing copied) where it does not."""
        shard = self.shard
        first, last = shard.blocks(start, end)
        if self.kept is None or first != last or self.kept[0] != first:
            return False
        at = start - shard.checks[first][0]
        into.copy_(self._kept[at:at + end - start])
        return True

    def read_kept(self, start: int, end: int, into: torch.Tensor) -> None:
        """Copy the file's bytes [start, end), which lie in one block, into the host bytes
        ``into``: the block read (and verified) into the kept tensor unless it is there
        already, and kept."""
        if self._copy_kept(start, end, into):
            return
        shard = self.shard
        block, _ = shard.blocks(start, end)
        lo, hi = shard.checks[block][0], shard.checks[block][1]
        self.kept = None
        buffer = self._buffer(hi - lo)
        shard.read_blocks(block, block, byte_view(buffer, 0, hi - lo))
        self.kept = (block, hi - lo)
        into.copy_(buffer[start - lo:end - lo])

    def _buffer(self, size: int) -> torch.Tensor:
        if self._kept.numel() < size:
            self._kept = torch.empty(max(size, self.shard.block), dtype=torch.uint8)
        return self._kept


def _bytes_of(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over a writable memoryview's bytes (no copy; the caller keeps the
    memory alive). Every view here is of a tensor's memory, so writable: torch warns of a
    read-only one, and ``warnings.catch_warnings`` is not for threads."""
    return torch.frombuffer(view, dtype=torch.uint8)


class _Staging:
    """One thread's buffers: host memory it reuses for spans bound for host tensors; for a
    GPU, two pinned buffers in turn, each span's copy to the device running on a side stream
    while the next is read."""

    def __init__(self) -> None:
        self.host = torch.empty(0, dtype=torch.uint8)
        self.pinned: list[torch.Tensor] = [self.host, self.host]
        self.pending: list[Any] = [None, None]
        self.stream: Any = None
        self.turn = 0

    def buffer(self, size: int, device: torch.device) -> torch.Tensor:
        """A uint8 host tensor of ``size`` bytes to read a span bound for ``device`` into."""
        if device.type != "cuda":
            if self.host.numel() < size:
                self.host = torch.empty(size, dtype=torch.uint8)
            return self.host[:size]
        slot = self.turn % 2
        if self.pending[slot] is not None:
            self.pending[slot].synchronize()
            self.pending[slot] = None
        if self.pinned[slot].numel() < size:
            self.pinned[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return self.pinned[slot][:size]

    def copy(self, into: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` (a view of the last ``buffer``) into ``into``."""
        if into.device.type != "cuda":
            into.copy_(source)
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=into.device)
        slot = self.turn % 2
        self.turn += 1
        with torch.cuda.stream(self.stream):
            into.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[slot] = event

    def close(self) -> None:
        """Wait for the copies still running."""
        for event in self.pending:
            if event is not None:
                event.synchronize()


@dataclass(frozen=True, slots=True)
class Span:
    """Copy the file bytes [start, end) of saved rank ``source``'s shard, viewed as ``sizes``
    elements of ``dtype`` with ``stride``, into ``into``."""

    source: int
    start: int
    end: int
    dtype: torch.dtype
    sizes: tuple[int, ...]
    stride: tuple[int, ...]
    into: torch.Tensor
    before: Callable[[torch.Tensor], None] | None = None
    """Runs on ``into`` before the span is copied into it (a live tensor read straight into:
    the bits it overwrites are copied aside)."""


def spans_of(shard: ShardRanges, source: int, record: TensorRecord, box: Box,
             out: torch.Tensor, bound: int,
             before: Callable[[torch.Tensor], None] | None = None
             ) -> Iterator[Span]:
    """The spans that copy ``box`` (coordinates of the saved tensor ``record``) into ``out``
    (``before`` running before each copy)."""
    dtype = DTYPES[record.dtype]
    item = dtype.itemsize
    base = shard.header.storages[record.storage].offset + record.byte_offset
    for part in spans(box, record.stride, item, gap=max(shard.block, 1), bound=bound):
        first = sum(o * s for o, s in zip(part.offsets, record.stride))
        last = sum((o + n - 1) * s for o, n, s in zip(part.offsets, part.sizes, record.stride))
        yield Span(source, base + first * item, base + (last + 1) * item, dtype, part.sizes,
                   tuple(record.stride), out[part.relative_to(box).index()], before)


def group_spans(shards: Sequence[ShardRanges], all_spans: Sequence[Span], parts: int
                ) -> list[list[Span]]:
    """At most ``parts`` groups of similar bytes, each a run of the spans in file order (by
    source, then offset), so that no block is read twice: a group ends between two spans of
    one shard that share no block, or where the span that would start the next group shares
    its first block with the span before it, at that block's end, the span cut in two there
    (``_split``: its head, inside the shared block, stays with the group that reads that
    block). The tensors of a shard lie one after the other, each ending inside the block
    where the next begins, so without the cut a whole shard's spans were one group: a rank
    that read two saved shards read with two threads, whatever ``parts`` said."""
    order = sorted(all_spans, key=lambda s: (s.source, s.start))
    total = sum(s.end - s.start for s in order)
    target = max(1, total // max(1, parts))
    groups: list[list[Span]] = []
    acc = 0
    previous: tuple[int, int] | None = None  # (source, last block) of the span before
    for whole in order:
        shard = shards[whole.source]
        first, last = shard.blocks(whole.start, whole.end)
        same = previous is not None and previous[0] == whole.source
        shares = same and previous is not None and first <= previous[1]
        pieces = [whole]
        if groups and acc >= target and len(groups) < parts and shares:
            pieces = _split(whole, shard.checks[first][1])
        for span in pieces:
            first, last = shard.blocks(span.start, span.end)
            shares = same and previous is not None and first <= previous[1]
            if not groups or (acc >= target and not shares and len(groups) < parts):
                groups.append([])
                acc = 0
            groups[-1].append(span)
            acc += span.end - span.start
            previous = (span.source, max(last, previous[1]) if same and previous else last)
            same = True
    return groups


def _split(span: Span, at: int) -> list[Span]:
    """``span`` as two spans, the file's bytes [start, at) and [at, end), where its bytes fill
    a contiguous destination in order (and ``at`` falls between two of its elements);
    otherwise ``[span]``."""
    into = span.into
    item = span.dtype.itemsize
    if not (span.start < at < span.end and (at - span.start) % item == 0
            and into.dtype == span.dtype and into.is_contiguous()
            and into.numel() * item == span.end - span.start):
        return [span]
    flat = into.reshape(-1)
    head = (at - span.start) // item
    return [Span(span.source, span.start, at, span.dtype, (head,), (1,), flat[:head],
                 span.before),
            Span(span.source, at, span.end, span.dtype, (flat.numel() - head,), (1,),
                 flat[head:], span.before)]


def _direct(span: Span) -> bool:
    """Whether the span's bytes are the destination's bytes, in order: a contiguous host
    tensor of the saved dtype that the file's bytes [start, end) fill exactly."""
    into = span.into
    return (into.device.type == "cpu" and into.dtype == span.dtype and into.is_contiguous()
            and not into.is_conj() and not into.is_neg()
            and into.numel() * into.element_size() == span.end - span.start)


def _read_span(reader: _Reader, staging: _Staging, span: Span, keep: bool) -> None:
    """Copy the span into its destination through the staging buffer."""
    buffer = staging.buffer(reader.extent(span.start, span.end), span.into.device)
    at = reader.read(span.start, span.end, byte_view(buffer), keep=keep)
    raw = buffer[at:at + span.end - span.start].view(span.dtype)
    staging.copy(span.into, raw.as_strided(span.sizes, span.stride))


def _read_bytes(reader: _Reader, staging: _Staging, start: int, end: int, into: torch.Tensor,
                keep: bool) -> None:
    """Copy the file's bytes [start, end) into the host bytes ``into`` through the staging
    buffer."""
    buffer = staging.buffer(reader.extent(start, end), into.device)
    at = reader.read(start, end, byte_view(buffer), keep=keep)
    staging.copy(into, buffer[at:at + end - start])


def _read_direct(reader: _Reader, staging: _Staging, span: Span, keep: bool) -> None:
    """A ``_direct`` span: the whole blocks inside it read straight into the destination's
    memory (and verified there), the partial blocks at its ends through the staging buffer."""
    shard = reader.shard
    first, last = shard.blocks(span.start, span.end)
    lo = shard.checks[first][0] if shard.checks[first][0] >= span.start else \
        shard.checks[first][1]
    hi = shard.checks[last][1] if shard.checks[last][1] <= span.end else shard.checks[last][0]
    flat = span.into.reshape(-1).view(torch.uint8)  # a view: contiguous
    if lo >= hi:  # no whole block inside: all of it through the staging buffer
        _read_bytes(reader, staging, span.start, span.end, flat, keep)
        return
    if span.start < lo:  # the head, inside one block: from the kept one, or read into it
        reader.read_kept(span.start, lo, flat[:lo - span.start])
    a, b = shard.blocks(lo, hi)
    shard.read_blocks(a, b, byte_view(flat, lo - span.start, hi - span.start))
    reader.kept = None
    if hi < span.end:  # the tail, inside one block: read into the kept tensor, kept
        reader.read_kept(hi, span.end, flat[hi - span.start:])


class _Stream:
    """One thread's reads of one shard of a local file, in file order, where a read of a few
    KiB costs a system call rather than a request: each span's bytes are read once, in one
    call, straight into their destination (or the staging buffer, for a destination they do
    not fill in order), and the bytes of a block that no span of the thread needs (before its
    first span, between two spans, after its last) into a scratch buffer. Each block is
    verified from its pieces as they arrive, with a streaming xxh3 over them in file order;
    every block a span touches is verified before ``read_group`` returns. Nothing is read
    twice and nothing is copied between buffers: the bytes read are those of the blocks the
    spans touch, as with whole blocks, without the whole-block copies."""

    def __init__(self, shard: ShardRanges) -> None:
        self.shard = shard
        self.block = -1
        """The block being verified (-1: none); its bytes before ``at`` are hashed."""
        self.at = 0
        self.hasher: Any = None
        self.done = 0
        """The file offset up to which bytes were taken: a span that starts before it
        (bytes another span of this thread read too) is read whole-block instead."""
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def seek(self, start: int) -> None:
        """Make the file's byte ``start`` (not before ``done``) the next one taken: the rest
        of the block being verified read into scratch if ``start`` lies beyond it, and the
        bytes of ``start``'s block before it."""
        shard = self.shard
        if self.block >= 0:
            end = shard.checks[self.block][1]
            if start < end:
                self.take(self.at, start, None)
                return
            self.take(self.at, end, None)
        first, _ = shard.blocks(start, start + 1)
        self.take(shard.checks[first][0], start, None)

    def take(self, start: int, end: int, into: memoryview | None) -> None:
        """Read the file's bytes [start, end) (the next ones of the stream) into ``into``
        (None: into scratch: at most the rest of one block) and hash them."""
        if end <= start:
            return
        if into is None:
            if self._scratch.numel() < end - start:
                self._scratch = torch.empty(max(end - start, self.shard.block),
                                            dtype=torch.uint8)
            into = byte_view(self._scratch, 0, end - start)
        self.shard.read_into(start, into)
        self._hash(start, into)
        self.done = end

    def _hash(self, start: int, view: memoryview) -> None:
        """Hash the file's bytes [start, start + len(view)), held in ``view``, verifying
        each block they complete."""
        shard = self.shard
        end = start + len(view)
        pos = start
        while pos < end:
            if self.block < 0:
                self.block, _ = shard.blocks(pos, pos + 1)
                self.at = shard.checks[self.block][0]
                if self.at != pos:  # seek reads a block's head first: never happens
                    raise CheckpointIntegrityError(
                        f"a read of rank {shard.rank}'s shard began at byte {pos}, inside a "
                        "block", step=shard.status.step, rank=shard.rank, path=shard.path)
                self.hasher = checksum_stream()
            a, b, expected = shard.checks[self.block]
            stop = min(b, end)
            self.hasher.update(view[pos - start:stop - start])
            pos = self.at = stop
            if stop == b:
                self.block = -1
                if self.hasher.intdigest() != expected:
                    raise shard.mismatch(a, b)

    def finish(self) -> None:
        """Read and verify the rest of the block being verified."""
        if self.block >= 0:
            self.take(self.at, self.shard.checks[self.block][1], None)


def _streams(shards: Sequence[ShardRanges], group: Sequence[Span]) -> bool:
    """Whether every shard the group reads is a local file (``SMALL_READS``), read by
    ``_Stream``; otherwise (the persistent tier, another rank's copy server: a request a
    read) whole blocks are read through ``_Reader``."""
    return all(getattr(shards[s].storage, "SMALL_READS", False)
               for s in {span.source for span in group})


def _read_streamed(shards: Sequence[ShardRanges], group: Sequence[Span],
                   staging: _Staging) -> None:
    """``read_group`` through ``_Stream``s (one a shard): each span's bytes straight into its
    destination where it is ``_direct``, else into the staging buffer and copied from there.
    A span that starts before the stream's last byte (bytes another span of the group read
    too) is read on its own, whole blocks through ``_Reader``."""
    streams: dict[int, _Stream] = {}
    try:
        for span in group:
            stream = streams.get(span.source)
            if stream is None:
                stream = streams[span.source] = _Stream(shards[span.source])
            if span.before is not None:
                span.before(span.into)
            if span.start < stream.done:
                _read_span(_Reader(shards[span.source]), staging, span, keep=False)
                continue
            stream.seek(span.start)
            if _direct(span):
                flat = span.into.reshape(-1).view(torch.uint8)  # a view: contiguous
                stream.take(span.start, span.end, byte_view(flat))
                continue
            buffer = staging.buffer(span.end - span.start, span.into.device)
            stream.take(span.start, span.end, byte_view(buffer))
            raw = buffer.view(span.dtype)
            staging.copy(span.into, raw.as_strided(span.sizes, span.stride))
        for stream in streams.values():
            stream.finish()
    finally:
        staging.close()


def read_group(shards: Sequence[ShardRanges], group: Sequence[Span]) -> None:
    """Read and copy one group's spans (one thread); every copy is done, and every block a
    span touches verified, when it returns."""
    staging = _Staging()
    if _streams(shards, group):
        _read_streamed(shards, group, staging)
        return
    readers: dict[int, _Reader] = {}
    try:
        for i, span in enumerate(group):
            reader = readers.get(span.source)
            if reader is None:
                reader = readers[span.source] = _Reader(shards[span.source])
            after = group[i + 1] if i + 1 < len(group) else None
            shard = shards[span.source]
            keep = (after is not None and after.source == span.source
                    and shard.blocks(after.start, after.end)[0]
                    == shard.blocks(span.start, span.end)[1])
            if span.before is not None:
                span.before(span.into)
            if _direct(span):
                _read_direct(reader, staging, span, keep)
            else:
                _read_span(reader, staging, span, keep)
    finally:
        staging.close()
