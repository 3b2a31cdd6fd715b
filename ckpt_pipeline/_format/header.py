"""What a shard header holds: storages, tensor records, DTensor layouts, and the checks of
each decoded field.

``ShardHeader`` is the self-description of a shard file; its storages are byte ranges of the
data region, its tensors views of them (``TensorRecord``: storage, byte offset, shape, stride; a
``DistLayout`` for a DTensor's local shard). The decoders below check every field against the
limits (``limits.py``) and every offset against its storage and the region, so that nothing
read points outside the file. ``shard.py`` (format 2) and ``shard_v1.py`` (format 1) decode
into these classes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointIntegrityError
from .documents import FORMAT_VERSION, nonneg_field, required_field
from .limits import (
    ALIGN,
    DEVICE_PATTERN,
    DTYPES,
    MAX_NDIM,
    MAX_PATH_LEN,
    MAX_SAVE_ID_LEN,
    MAX_TENSORS,
    PLACEMENT_PATTERN,
)
from .region import align_up, region_chunks

__all__ = (
    "DEVICE",
    "PLACEMENT",
    "DistLayout",
    "ShardHeader",
    "StorageRecord",
    "TensorRecord",
    "check_view",
    "contiguous_stride",
    "decode_dist",
    "decode_identity",
    "decode_record",
    "decode_storages",
    "device_name_ok",
    "is_u64",
    "numel_fits",
    "sizes_ok",
)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``, in elements."""
    stride: list[int] = []
    acc = 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))



@dataclass(frozen=True, slots=True)
class DistLayout:
    """Where a rank's local shard sits in a DTensor: mesh, placements, global size."""

    mesh_shape: tuple[int, ...]
    placements: tuple[str, ...]
    """``"R"`` (replicate) or ``"S<dim>"`` (shard on dim), one per mesh dimension."""
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]

    def to_plain(self) -> list[Any]:
        return [list(self.mesh_shape), list(self.placements), list(self.global_shape),
                list(self.global_stride)]


PLACEMENT = PLACEMENT_PATTERN  # used with fullmatch: no trailing newline
DEVICE = DEVICE_PATTERN  # "cpu", "cuda:0" (str(torch.device))


@dataclass(frozen=True, slots=True)
class StorageRecord:
    """Bytes of one storage in the data region, written once however many tensors view it."""

    offset: int
    """Absolute file offset."""
    nbytes: int
    device: str
    """Where the storage lived (``cpu``, ``cuda:0``)."""

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor of the state: a view (offset, shape, stride) of a stored storage."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage: int
    """Index into ``ShardHeader.storages``."""
    byte_offset: int
    """Where the view starts in its storage."""
    device: str
    """The storage's device."""
    dist: DistLayout | None = None
    """Set when the tensor is a rank's local shard of a DTensor."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """The self-description of a shard file."""

    step: int
    rank: int
    world_size: int
    save_id: str
    created_unix: float
    chunk_bytes: int
    data_offset: int
    data_length: int
    storages: tuple[StorageRecord, ...]
    tensors: tuple[TensorRecord, ...]
    checksums: tuple[int, ...]
    """xxh3-64 of each of ``region_chunks`` of the data region."""
    tree: bytes
    train_state: dict[str, Any]
    version: int = FORMAT_VERSION
    legacy_checks: tuple[tuple[int, int, int], ...] | None = None
    """Format 1: (start, end, xxh3) of each checksummed range (chunks of each tensor)."""
    meshes: tuple[tuple[tuple[int, ...], tuple[str, ...] | None], ...] | None = None
    """The DeviceMeshes of the saved DTensors: (shape, dimension names or None), each once;
    None where the writer did not record them (before the names were recorded)."""

    @property
    def header_offset(self) -> int:
        end = self.data_offset + self.data_length
        return end if self.version >= 2 else align_up(end)

    @property
    def data_end(self) -> int:
        return self.data_offset + self.data_length

    def checks(self) -> list[tuple[int, int, int]]:
        """(start, end, xxh3) of every checksummed byte range, in file order."""
        if self.legacy_checks is not None:
            return list(self.legacy_checks)
        chunks = region_chunks(self.data_offset, self.data_end, self.chunk_bytes)
        return [(a, b, s) for (a, b), s in zip(chunks, self.checksums, strict=True)]



def decode_identity(data: dict[str, Any], path: str
                    ) -> tuple[int, int, int, str, float, int]:
    """step, rank, world size, save id, creation time and chunk size of a shard header."""
    step = nonneg_field(data, "step", path)
    rank = nonneg_field(data, "rank", path)
    world = nonneg_field(data, "world_size", path)
    if world < 1 or rank >= world:
        raise CheckpointIntegrityError(f"rank {rank} is outside world size {world}", path=path)
    save_id = required_field(data, "save_id", str, path)
    if not (0 < len(save_id) <= MAX_SAVE_ID_LEN):
        raise CheckpointIntegrityError("save id is malformed", path=path)
    created = required_field(data, "created_unix", float, path)
    if not math.isfinite(created):
        raise CheckpointIntegrityError("creation time is not a finite number", path=path)
    chunk = nonneg_field(data, "chunk_bytes", path)
    if chunk < ALIGN or chunk % ALIGN:
        raise CheckpointIntegrityError("chunk size is malformed", path=path)
    return step, rank, world, save_id, created, chunk


def is_u64(value: object) -> bool:
    """A checksum as msgpack decodes it: an exact int in [0, 2**64)."""
    return type(value) is int and 0 <= value < 2**64  # msgpack gives exact ints (bool apart)


def _is_nonneg(value: object) -> bool:
    return type(value) is int and value >= 0


_DEVICE_NAMES: dict[str, bool] = {}


def device_name_ok(name: object) -> bool:
    """A device name a reader accepts (cached: a shard repeats a handful of names)."""
    if type(name) is not str:
        return False
    ok = _DEVICE_NAMES.get(name)
    if ok is None:
        ok = DEVICE.fullmatch(name) is not None
        if len(_DEVICE_NAMES) < 1024:
            _DEVICE_NAMES[name] = ok
    return ok


def decode_storages(raw: list[Any], devices: list[str], lo: int, hi: int, path: str
                     ) -> tuple[StorageRecord, ...]:
    """Storages in file order, inside [lo, hi), none overlapping another."""
    if len(raw) > MAX_TENSORS:
        raise CheckpointIntegrityError("too many storages", path=path)
    out: list[StorageRecord] = []
    end = lo
    for i, entry in enumerate(raw):
        if (type(entry) is not list or len(entry) != 3 or not _is_nonneg(entry[0])
                or not _is_nonneg(entry[1]) or type(entry[2]) is not int
                or not 0 <= entry[2] < len(devices)):
            raise CheckpointIntegrityError(f"storage #{i} record is malformed", path=path)
        offset, nbytes, device = entry[0], entry[1], devices[entry[2]]
        if offset < end or offset + nbytes > hi:
            raise CheckpointIntegrityError(
                f"storage #{i} at {offset}+{nbytes} overlaps another or lies outside the data "
                "region", path=path)
        end = offset + nbytes
        out.append(StorageRecord(offset, nbytes, device))
    return tuple(out)


def check_view(where: str, dtype: str, shape: Sequence[int], stride: Sequence[int],
               byte_offset: int, storage: StorageRecord, path: str) -> None:
    """The view lies inside its storage, at an offset its element size divides."""
    itemsize = DTYPES[dtype].itemsize
    if byte_offset % itemsize or (storage.offset + byte_offset) % itemsize:
        raise CheckpointIntegrityError(f"{where} is not aligned to its element size",
                                       path=path)
    last = 0
    for size, step in zip(shape, stride):
        if size == 0:
            if byte_offset > storage.nbytes:
                raise CheckpointIntegrityError(f"{where} lies outside its storage", path=path)
            return
        last += (size - 1) * step
    if byte_offset + (last + 1) * itemsize > storage.nbytes:
        raise CheckpointIntegrityError(f"{where} lies outside its storage", path=path)


def decode_record(raw: Any, index: int, storages: tuple[StorageRecord, ...],
                   path: str) -> TensorRecord:
    """Tensor record #``index`` of a format-2 header, checked as a view of its storage."""
    if type(raw) is not list or len(raw) != 7:
        raise CheckpointIntegrityError(f"tensor #{index} record is malformed", path=path)
    tpath, dtype, shape, stride, storage, byte_offset, dist = raw
    if type(tpath) is not str or len(tpath) > MAX_PATH_LEN:
        raise CheckpointIntegrityError(f"tensor #{index} path is malformed", path=path)
    if type(dtype) is not str or dtype not in DTYPES:
        raise CheckpointIntegrityError(f"tensor #{index} ({tpath}) has dtype {dtype!r}, which "
                                       "is not on the allow-list", path=path)
    if (not sizes_ok(shape) or not sizes_ok(stride) or len(stride) != len(shape)
            or not numel_fits(shape)):
        raise CheckpointIntegrityError(f"tensor #{index} ({tpath}) shape or stride is "
                                       "malformed", path=path)
    if (type(storage) is not int or not 0 <= storage < len(storages)
            or type(byte_offset) is not int or byte_offset < 0):
        raise CheckpointIntegrityError(f"tensor #{index} ({tpath}) storage reference is "
                                       "malformed", path=path)
    record = storages[storage]
    check_view(f"tensor #{index} ({tpath})", dtype, shape, stride, byte_offset, record, path)
    layout = (None if dist is None
              else decode_dist(dist, len(shape), f"tensor #{index} ({tpath})", path))
    return TensorRecord(tpath, dtype, tuple(shape), tuple(stride), storage, byte_offset,
                        record.device, layout)


_INT64_MAX = 2**63 - 1
"""Sizes and strides torch can hold."""


def sizes_ok(value: Any, *, positive: bool = False) -> bool:
    """A list of at most MAX_NDIM ints in [0 (1 if ``positive``), 2**63 - 1]."""
    if type(value) is not list or len(value) > MAX_NDIM:
        return False
    low = 1 if positive else 0
    for v in value:  # a loop: ~3x faster than all() over a generator here  # noqa: SIM110
        if type(v) is not int or v < low or v > _INT64_MAX:
            return False
    return True


MAX_MESHES = 64
"""Distinct DeviceMeshes a shard header may name."""
MAX_MESH_NAME = 256
"""Characters of a mesh dimension's name."""


def decode_meshes(raw: Any, path: str
                  ) -> tuple[tuple[tuple[int, ...], tuple[str, ...] | None], ...] | None:
    """The header's ``meshes`` (None when absent: a writer before the names were recorded)."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_MESHES:
        raise CheckpointIntegrityError("the meshes are malformed", path=path)
    out: list[tuple[tuple[int, ...], tuple[str, ...] | None]] = []
    for entry in raw:
        if not isinstance(entry, list) or len(entry) != 2:
            raise CheckpointIntegrityError("the meshes are malformed", path=path)
        shape, names = entry
        if not sizes_ok(shape, positive=True) or not shape or not (names is None or (
                isinstance(names, list) and len(names) == len(shape)
                and all(isinstance(n, str) and 0 < len(n) <= MAX_MESH_NAME for n in names))):
            raise CheckpointIntegrityError("the meshes are malformed", path=path)
        out.append((tuple(shape), None if names is None else tuple(names)))
    return tuple(out)


def numel_fits(shape: Sequence[int]) -> bool:
    """The product of the non-zero sizes fits in int64 (torch checks it even when one is 0)."""
    count = 1
    for size in shape:
        if size:
            count *= size
            if count > _INT64_MAX:
                return False
    return True


def decode_dist(raw: Any, ndim: int, where: str, path: str) -> DistLayout:
    """A DTensor layout of a tensor of ``ndim`` dimensions (``where`` names the tensor)."""
    if not isinstance(raw, list) or len(raw) != 4:
        raise CheckpointIntegrityError(f"{where} DTensor layout is malformed", path=path)
    mesh, placements, gshape, gstride = raw
    if (not sizes_ok(mesh, positive=True) or not mesh or not isinstance(placements, list)
            or len(placements) != len(mesh)
            or not all(isinstance(p, str) and PLACEMENT.fullmatch(p) for p in placements)
            or not sizes_ok(gshape) or len(gshape) != ndim or not sizes_ok(gstride)
            or len(gstride) != ndim
            or any(p != "R" and int(p[1:]) >= ndim for p in placements)):
        raise CheckpointIntegrityError(f"{where} DTensor layout is malformed", path=path)
    return DistLayout(tuple(mesh), tuple(placements), tuple(gshape), tuple(gstride))
