"""Reading a shard's data back: every checksummed range read once, verified as it arrives.

The storages are grouped into units of memory, each allocated once on the device its tensors
go to: a large storage is a unit of its own, consecutive small ones share one (so that a tensor
kept after the restore holds little else alive). Each checksummed range of the file is read
straight into the units it covers (through small pinned buffers for a GPU), by several threads
at once, and hashed on the way; the tensors are then views of the units, so tensors that shared
a storage when saved share memory again. Nothing here touches the live state.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch
import xxhash

from .._format.header import ShardHeader
from .._format.layout import LARGE_STORAGE
from .._format.limits import DTYPES
from .._format.names import shard_name
from .._format.region import checksum
from .._format.scan import StepStatus
from .._hostmem import byte_view
from .._parallel import run_groups, split_balanced
from .._threads import in_thread
from ..errors import CheckpointIntegrityError, StorageError
from ..storage import Storage

__all__ = ("LoadedShard", "device_bytes", "read_shard")

_STAGING_BYTES = 8 * 1024 * 1024
"""Pinned piece size for reads bound for a GPU."""
_SCRATCH_BYTES = 1024 * 1024
_SMALL_GAP = 4096
"""Small storages at most this far apart share a unit (the gap is read into it)."""


@dataclass(frozen=True, slots=True)
class LoadedShard:
    """A shard's tensors, every checksum verified, on the devices they were read for."""

    header: ShardHeader
    tensors: list[torch.Tensor]


@dataclass(slots=True)
class _Unit:
    start: int
    end: int
    device: torch.device
    small: bool


def _storage_devices(header: ShardHeader, devices: Sequence[torch.device] | None
                     ) -> list[torch.device | None]:
    """Where each storage goes: where its first tensor goes (None: no tensor views it)."""
    out: list[torch.device | None] = [None] * len(header.storages)
    for i, rec in enumerate(header.tensors):
        if out[rec.storage] is None:
            out[rec.storage] = devices[i] if devices is not None else torch.device("cpu")
    return out


def _units(header: ShardHeader, targets: list[torch.device | None]
           ) -> tuple[list[_Unit], list[int]]:
    units: list[_Unit] = []
    unit_of = [-1] * len(header.storages)
    for j, s in enumerate(header.storages):
        device = targets[j]
        if device is None or s.nbytes == 0:
            continue
        small = s.nbytes < LARGE_STORAGE
        last = units[-1] if units else None
        if (last is not None and small and last.small and last.device == device
                and s.offset - last.end <= _SMALL_GAP):
            last.end = s.end
        else:
            units.append(_Unit(s.offset, s.end, device, small))
        unit_of[j] = len(units) - 1
    return units, unit_of


def device_bytes(header: ShardHeader, devices: Sequence[torch.device]) -> dict[int, int]:
    """GPU memory, per device index, that ``read_shard`` allocates for these targets."""
    out: dict[int, int] = {}
    for unit in _units(header, _storage_devices(header, devices))[0]:
        if unit.device.type == "cuda":
            index = unit.device.index if unit.device.index is not None else 0
            out[index] = out.get(index, 0) + unit.end - unit.start
    return out


async def read_shard(
    storage: Storage,
    status: StepStatus,
    rank: int,
    *,
    devices: Sequence[torch.device] | None = None,
    threads: int,
    limiter: anyio.CapacityLimiter,
    progress: Callable[[int], None] | None = None,
    shard_file: str | None = None,
    arrived: Callable[[int, int], None] | None = None,
) -> LoadedShard:
    """Read all tensor data of a validated step (``scan.StepStatus``), verifying every
    checksum; ``devices`` says where each tensor goes (default: all on the CPU).

    ``progress(bytes)`` is called from several worker threads at once; it must be thread-safe.
    A shard still arriving (a download) is read from ``shard_file`` in the step's directory,
    and ``arrived(start, end)`` blocks each read until those bytes are in the file.
    """
    header = status.header
    if header is None:
        raise CheckpointIntegrityError("step was not validated", step=status.step, rank=rank,
                                       path=status.path)
    targets = _storage_devices(header, devices)
    units, unit_of = _units(header, targets)
    memory = [torch.empty(u.end - u.start, dtype=torch.uint8, device=u.device) for u in units]
    starts = [u.start for u in units]
    rel = os.path.join(status.dir_name,
                       shard_file or status.shard_file or shard_name(rank))
    path = os.path.join(storage.root, rel)
    bad: list[tuple[int, int]] = []
    fd, _size = await in_thread(limiter, storage.open_read, rel, status.shard_size)

    def read(view: memoryview, offset: int) -> None:
        try:
            if arrived is not None:
                arrived(offset, offset + len(view))
            storage.pread_into(fd, view, offset)
        except StorageError as exc:
            raise StorageError(exc.message, step=status.step, rank=rank, path=path,
                               hint=exc.hint, errno=exc.errno) from exc

    def run(group: list[tuple[int, int, int]]) -> None:
        reader = _RangeReader(read, units, memory, starts)
        try:
            for start, end, expected in group:
                if reader.read(start, end) != expected:
                    bad.append((start, end))
                if progress is not None:
                    progress(end - start)
        finally:
            reader.close()

    try:
        await run_groups(run, split_balanced(header.checks(), threads), limiter)
    finally:
        await in_thread(limiter, storage.close, fd)
    if bad:
        start, end = min(bad)
        raise CheckpointIntegrityError(
            f"checksum mismatch in {len(bad)} chunk(s), the first at bytes {start}-{end} "
            f"(tensor {_tensor_at(header, start, end)!r})", step=status.step, rank=rank,
            path=path, hint="the shard is corrupt")
    return LoadedShard(header, _views(header, targets, units, unit_of, memory, status, rank))


class _RangeReader:
    """One worker thread's reads: a checksummed range into the units it covers."""

    def __init__(self, read: Callable[[memoryview, int], None], units: list[_Unit],
                 memory: list[torch.Tensor], starts: list[int]) -> None:
        self._read = read
        self.units = units
        self.memory = memory
        self.starts = starts
        self.scratch: bytearray | None = None
        self.staging: list[torch.Tensor] = []
        self.pending: list[Any] = [None, None]
        self.stream: Any = None
        self.turn = 0

    def read(self, start: int, end: int) -> int:
        """Read [start, end) into place; return its xxh3-64."""
        segments = self._segments(start, end)
        if len(segments) == 1 and segments[0][2] >= 0:
            lo, hi, u = segments[0]
            if self.units[u].device.type != "cuda":
                view = byte_view(self.memory[u], lo - self.units[u].start,
                                 hi - self.units[u].start)
                self._read(view, lo)
                return checksum(view)
        digest = xxhash.xxh3_64()
        for lo, hi, u in segments:
            if u < 0:
                self._skip(lo, hi, digest)
            elif self.units[u].device.type == "cuda":
                self._to_device(lo, hi, u, digest)
            else:
                view = byte_view(self.memory[u], lo - self.units[u].start,
                                 hi - self.units[u].start)
                self._read(view, lo)
                digest.update(view)
        return int(digest.intdigest())

    def _segments(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """[start, end) cut at unit bounds: (lo, hi, unit index or -1 for bytes of none)."""
        out: list[tuple[int, int, int]] = []
        pos = start
        while pos < end:
            u = bisect_right(self.starts, pos) - 1
            if u >= 0 and pos < self.units[u].end:
                hi = min(end, self.units[u].end)
                out.append((pos, hi, u))
            else:
                following = self.starts[u + 1] if u + 1 < len(self.starts) else end
                hi = min(end, following)
                out.append((pos, hi, -1))
            pos = hi
        return out

    def _skip(self, lo: int, hi: int, digest: Any) -> None:
        """Bytes no tensor needs (padding, unused storages): read for the checksum only."""
        if self.scratch is None:
            self.scratch = bytearray(_SCRATCH_BYTES)
        for at in range(lo, hi, _SCRATCH_BYTES):
            view = memoryview(self.scratch)[:min(_SCRATCH_BYTES, hi - at)]
            self._read(view, at)
            digest.update(view)

    def _to_device(self, lo: int, hi: int, u: int, digest: Any) -> None:
        """Small pinned pieces, alternating: one piece's copy to the GPU runs while the next
        is read."""
        unit = self.units[u]
        if not self.staging:
            self.staging = [torch.empty(_STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
                            for _ in range(2)]
            self.stream = torch.cuda.Stream(device=unit.device)
        out = self.memory[u]
        for at in range(lo, hi, _STAGING_BYTES):
            n = min(_STAGING_BYTES, hi - at)
            slot = self.turn % 2
            self.turn += 1
            if self.pending[slot] is not None:
                self.pending[slot].synchronize()
            host = self.staging[slot][:n]
            view = byte_view(host)
            self._read(view, at)
            digest.update(view)
            with torch.cuda.stream(self.stream):
                out[at - unit.start:at - unit.start + n].copy_(host, non_blocking=True)
                self.pending[slot] = torch.cuda.Event()
                self.pending[slot].record(self.stream)

    def close(self) -> None:
        for event in self.pending:
            if event is not None:
                event.synchronize()


def _views(header: ShardHeader, targets: list[torch.device | None], units: list[_Unit],
           unit_of: list[int], memory: list[torch.Tensor], status: StepStatus,
           rank: int) -> list[torch.Tensor]:
    """Each tensor as a view of its unit (tensors of one storage share its memory).

    A large unit's tensors own their memory as far as torch can tell (``set_``: no view base,
    so that a restore may hand it to a live tensor); a small unit's are strided views of it.
    """
    out: list[torch.Tensor] = []
    typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    for rec in header.tensors:
        dtype = DTYPES[rec.dtype]
        device = targets[rec.storage]
        assert device is not None
        u = unit_of[rec.storage]
        if u < 0:  # a storage of no bytes (an empty tensor), or none read
            out.append(torch.empty_strided(rec.shape, rec.stride, dtype=dtype, device=device))
            continue
        at = header.storages[rec.storage].offset + rec.byte_offset - units[u].start
        size = dtype.itemsize
        if at % size:
            raise CheckpointIntegrityError(
                f"tensor {rec.path!r} is not aligned to its element size in its storage",
                step=status.step, rank=rank, path=status.path, hint="the shard is corrupt")
        if not units[u].small:
            view = torch.empty(0, dtype=dtype, device=device)
            out.append(view.set_(memory[u].untyped_storage(), at // size, rec.shape,
                                 rec.stride))
            continue
        base = typed.get((u, dtype))
        if base is None:
            raw = memory[u]
            base = typed[(u, dtype)] = raw[:raw.numel() // size * size].view(dtype)
        out.append(base.as_strided(rec.shape, rec.stride, at // size))
    return out


def _tensor_at(header: ShardHeader, start: int, end: int) -> str:
    """The path of a tensor whose storage overlaps [start, end), for messages."""
    for rec in header.tensors:
        s = header.storages[rec.storage]
        if s.offset < end and start < max(s.end, s.offset + 1):
            return rec.path
    return "<padding>"
