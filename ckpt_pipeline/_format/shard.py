"""The layout of a shard file: preamble, data region, header; storages, tensors, checksums.

A shard is a small preamble (magic, version, where the header is and its checksum), the data
region (each stored storage's bytes, packed: only large ones start at an aligned offset),
checksummed in chunks of the region with xxh3-64, then the header: a msgpack document
(``documents.py``) listing the storages (byte ranges of the region), the tensors as views of
them (``TensorRecord``: storage, byte offset, shape, stride; a ``DistLayout`` for a DTensor's
local shard), the state tree and the TrainState. docs/format.md is the reference. Decoding
checks every field against the limits (``limits.py``) and every offset against the file, so
that nothing read points outside it. Format 1 shards are read by ``shard_v1.py`` into the same
classes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from .._gc import gc_paused
from ..errors import CheckpointIntegrityError
from .documents import FORMAT_VERSION, _decode, _nonneg, _pack, _req
from .limits import (
    ALIGN,
    DEVICE_PATTERN,
    DTYPES,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    MAX_PATH_LEN,
    MAX_SAVE_ID_LEN,
    MAX_TENSORS,
    PLACEMENT_PATTERN,
)

__all__ = (
    "PREAMBLE_SIZE",
    "SHARD_MAGIC",
    "DistLayout",
    "ShardHeader",
    "StorageRecord",
    "TensorRecord",
    "align_down",
    "align_up",
    "checksum",
    "chunk_count",
    "contiguous_stride",
    "decode_header",
    "decode_preamble",
    "encode_header",
    "encode_header_fields",
    "encode_preamble",
    "region_chunks",
)

SHARD_MAGIC = b"CKPTSHRD"
_PREAMBLE = struct.Struct("<8sHHIQQQ")  # magic, version, flags, reserved, hdr off, hdr len, hdr xxh3
PREAMBLE_SIZE = 64
"""Bytes before the data region (format 2; format 1 used 4096)."""


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def align_down(n: int, align: int = ALIGN) -> int:
    return n // align * align


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of a byte range (releases the GIL for large inputs)."""
    return int(xxhash.xxh3_64_intdigest(data))


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride: list[int] = []
    acc = 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def chunk_count(start: int, end: int, chunk_bytes: int) -> int:
    """How many ``region_chunks`` the region [start, end) has (without listing them)."""
    return -(-end // chunk_bytes) - start // chunk_bytes if end > start else 0


def region_chunks(start: int, end: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The checksum chunks of the data region [start, end): cut at the multiples of
    ``chunk_bytes`` of the file offset, so that each chunk is also an aligned write."""
    return [(max(start, k * chunk_bytes), min(end, (k + 1) * chunk_bytes))
            for k in range(start // chunk_bytes, -(-end // chunk_bytes))] if end > start else []


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


_PLACEMENT = PLACEMENT_PATTERN  # used with fullmatch: no trailing newline
_DEVICE = DEVICE_PATTERN  # "cpu", "cuda:0" (str(torch.device))


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


def encode_header(h: ShardHeader) -> bytes:
    if h.version != FORMAT_VERSION:
        raise ValueError(f"only format {FORMAT_VERSION} is written")
    return encode_header_fields(
        step=h.step, rank=h.rank, world_size=h.world_size, save_id=h.save_id,
        created_unix=h.created_unix, chunk_bytes=h.chunk_bytes, data_offset=h.data_offset,
        data_length=h.data_length, checksums=h.checksums,
        storages=h.storages,
        tensors=((t.path, t.dtype, t.shape, t.stride, t.storage, t.byte_offset, t.dist)
                 for t in h.tensors),
        tensor_count=len(h.tensors), tree=h.tree, train_state=h.train_state)


def encode_header_fields(
    *, step: int, rank: int, world_size: int, save_id: str, created_unix: float,
    chunk_bytes: int, data_offset: int, data_length: int, checksums: Sequence[int],
    storages: Sequence[StorageRecord],
    tensors: Iterable[tuple[str, str, Sequence[int], Sequence[int], int, int,
                            DistLayout | None]],
    tensor_count: int, tree: bytes, train_state: dict[str, Any],
) -> bytes:
    """The shard header, packed one entry at a time (the writer's path: no record objects, and
    a million-tensor header never holds the GIL in one long msgpack call, so the training
    thread gets its turns while a save is encoded)."""
    devices: dict[str, int] = {}
    for record in storages:
        devices.setdefault(record.device, len(devices))
    packer = msgpack.Packer(use_bin_type=True, strict_types=True)
    fixed: dict[str, Any] = {
        "format": FORMAT_VERSION, "kind": "shard", "step": step, "rank": rank,
        "world_size": world_size, "save_id": save_id, "created_unix": float(created_unix),
        "chunk_bytes": chunk_bytes, "data_offset": data_offset, "data_length": data_length,
        "checksums": list(checksums), "devices": list(devices)}
    parts = [packer.pack_map_header(len(fixed) + 4)]
    for key, value in fixed.items():
        parts.append(packer.pack(key))
        parts.append(packer.pack(value))
    parts.append(packer.pack("storages"))
    parts.append(packer.pack_array_header(len(storages)))
    parts.extend(packer.pack([s.offset, s.nbytes, devices[s.device]]) for s in storages)
    parts.append(packer.pack("tensors"))
    parts.append(packer.pack_array_header(tensor_count))
    written = 0
    for path, dtype, shape, stride, storage, byte_offset, dist in tensors:
        parts.append(packer.pack([path, dtype, list(shape), list(stride), storage, byte_offset,
                                  None if dist is None else dist.to_plain()]))
        written += 1
    if written != tensor_count:
        raise ValueError(f"{written} tensor records for a count of {tensor_count}")
    parts.append(packer.pack("tree"))
    parts.append(packer.pack(tree))
    parts.append(packer.pack("train_state"))
    parts.append(_pack(train_state))
    return b"".join(parts)


def encode_preamble(header_offset: int, header: bytes) -> bytes:
    raw = _PREAMBLE.pack(SHARD_MAGIC, FORMAT_VERSION, 0, 0, header_offset, len(header),
                         checksum(header))
    return raw + bytes(PREAMBLE_SIZE - len(raw))


def decode_preamble(raw: bytes, file_size: int, path: str) -> tuple[int, int, int, int]:
    """(format version, header offset, header length, header checksum), checked against the
    file size. ``raw``: the first ``PREAMBLE_SIZE`` bytes (fewer if the file is shorter)."""
    from .shard_v1 import V1_PREAMBLE_SIZE

    if len(raw) < _PREAMBLE.size:
        raise CheckpointIntegrityError("shard is shorter than its preamble", path=path)
    magic, version, flags, reserved, off, length, digest = _PREAMBLE.unpack_from(raw)
    if magic != SHARD_MAGIC:
        raise CheckpointIntegrityError("not a ckpt_pipeline shard (bad magic)", path=path)
    if flags or reserved:
        raise CheckpointIntegrityError("shard preamble has unknown flags", path=path)
    if version not in (1, FORMAT_VERSION):
        raise CheckpointIntegrityError(
            f"shard format version {version} is not supported (this library reads 1 to "
            f"{FORMAT_VERSION})", path=path, hint="upgrade ckpt_pipeline")
    lowest = PREAMBLE_SIZE if version == FORMAT_VERSION else V1_PREAMBLE_SIZE
    if (off < lowest or (version == 1 and off % ALIGN) or length == 0
            or length > MAX_HEADER_BYTES or off + length != file_size):
        raise CheckpointIntegrityError(
            f"shard header at {off}+{length} does not fit a file of {file_size} bytes",
            path=path)
    return version, off, length, digest


def decode_header(raw: bytes, path: str, *, file_size: int, header_offset: int,
                  version: int = FORMAT_VERSION) -> ShardHeader:
    """Decode and validate a shard header; every offset must stay inside the file."""
    # The index's entries are checked field by field below: the walk need not visit them.
    data = _decode(raw, "shard header", path, unwalked=("tensors", "storages", "checksums"))
    if not isinstance(data, dict):
        raise CheckpointIntegrityError("shard header is not a map", path=path)
    found = data.get("format")
    if type(found) is not int or found != version or data.get("kind") != "shard":
        raise CheckpointIntegrityError("shard header has the wrong format or kind", path=path)
    if version == 1:
        from .shard_v1 import decode_v1_body
        return decode_v1_body(data, path, file_size=file_size, header_offset=header_offset)
    step, rank, world, save_id, created, chunk = decode_identity(data, path)
    data_offset = _nonneg(data, "data_offset", path)
    data_length = _nonneg(data, "data_length", path)
    data_end = data_offset + data_length
    if data_offset != PREAMBLE_SIZE or data_end != header_offset or header_offset > file_size:
        raise CheckpointIntegrityError("data region does not match the preamble", path=path)
    sums = _req(data, "checksums", list, path)
    if (len(sums) != chunk_count(data_offset, data_end, chunk)
            or not all(_is_u64(s) for s in sums)):
        raise CheckpointIntegrityError("checksums are malformed", path=path)
    devices = _req(data, "devices", list, path)
    if len(devices) > 1024 or not all(_device_name_ok(d) for d in devices):
        raise CheckpointIntegrityError("device names are malformed", path=path)
    storages = _decode_storages(_req(data, "storages", list, path), devices, data_offset,
                                data_end, path)
    records_raw = _req(data, "tensors", list, path)
    if len(records_raw) > MAX_TENSORS:
        raise CheckpointIntegrityError("too many tensors", path=path)
    with gc_paused():
        records = tuple(_decode_record(r, i, storages, path)
                        for i, r in enumerate(records_raw))
    tree = _req(data, "tree", bytes, path)
    train_state = _req(data, "train_state", dict, path)
    return ShardHeader(step, rank, world, save_id, created, chunk, data_offset, data_length,
                       storages, records, tuple(sums), tree, train_state)


def decode_identity(data: dict[str, Any], path: str
                    ) -> tuple[int, int, int, str, float, int]:
    """step, rank, world size, save id, creation time and chunk size of a shard header."""
    step = _nonneg(data, "step", path)
    rank = _nonneg(data, "rank", path)
    world = _nonneg(data, "world_size", path)
    if world < 1 or rank >= world:
        raise CheckpointIntegrityError(f"rank {rank} is outside world size {world}", path=path)
    save_id = _req(data, "save_id", str, path)
    if not (0 < len(save_id) <= MAX_SAVE_ID_LEN):
        raise CheckpointIntegrityError("save id is malformed", path=path)
    created = _req(data, "created_unix", float, path)
    if not math.isfinite(created):
        raise CheckpointIntegrityError("creation time is not a finite number", path=path)
    chunk = _nonneg(data, "chunk_bytes", path)
    if chunk < ALIGN or chunk % ALIGN:
        raise CheckpointIntegrityError("chunk size is malformed", path=path)
    return step, rank, world, save_id, created, chunk


def _is_u64(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**64  # msgpack gives exact ints (bool apart)


def _is_nonneg(value: object) -> bool:
    return type(value) is int and value >= 0


_DEVICE_NAMES: dict[str, bool] = {}


def _device_name_ok(name: object) -> bool:
    """A device name a reader accepts (cached: a shard repeats a handful of names)."""
    if type(name) is not str:
        return False
    ok = _DEVICE_NAMES.get(name)
    if ok is None:
        ok = _DEVICE.fullmatch(name) is not None
        if len(_DEVICE_NAMES) < 1024:
            _DEVICE_NAMES[name] = ok
    return ok


def _decode_storages(raw: list[Any], devices: list[str], lo: int, hi: int, path: str
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


def _decode_record(raw: Any, index: int, storages: tuple[StorageRecord, ...],
                   path: str) -> TensorRecord:
    if type(raw) is not list or len(raw) != 7:
        raise CheckpointIntegrityError(f"tensor #{index} record is malformed", path=path)
    tpath, dtype, shape, stride, storage, byte_offset, dist = raw
    if type(tpath) is not str or len(tpath) > MAX_PATH_LEN:
        raise CheckpointIntegrityError(f"tensor #{index} path is malformed", path=path)
    if type(dtype) is not str or dtype not in DTYPES:
        raise CheckpointIntegrityError(f"tensor #{index} ({tpath}) has dtype {dtype!r}, which "
                                       "is not on the allow-list", path=path)
    if (not _ints(shape) or not _ints(stride) or len(stride) != len(shape)
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
              else _decode_dist(dist, len(shape), f"tensor #{index} ({tpath})", path))
    return TensorRecord(tpath, dtype, tuple(shape), tuple(stride), storage, byte_offset,
                        record.device, layout)


_INT64_MAX = 2**63 - 1
"""Sizes and strides torch can hold."""


def _ints(value: Any, *, positive: bool = False) -> bool:
    """A list of at most MAX_NDIM ints in [0 (1 if ``positive``), 2**63 - 1]."""
    if type(value) is not list or len(value) > MAX_NDIM:
        return False
    low = 1 if positive else 0
    for v in value:  # a loop: ~3x faster than all() over a generator here  # noqa: SIM110
        if type(v) is not int or v < low or v > _INT64_MAX:
            return False
    return True


def numel_fits(shape: Sequence[int]) -> bool:
    """The product of the non-zero sizes fits in int64 (torch checks it even when one is 0)."""
    count = 1
    for size in shape:
        if size:
            count *= size
            if count > _INT64_MAX:
                return False
    return True


def _decode_dist(raw: Any, ndim: int, where: str, path: str) -> DistLayout:
    if not isinstance(raw, list) or len(raw) != 4:
        raise CheckpointIntegrityError(f"{where} DTensor layout is malformed", path=path)
    mesh, placements, gshape, gstride = raw
    if (not _ints(mesh, positive=True) or not mesh or not isinstance(placements, list)
            or len(placements) != len(mesh)
            or not all(isinstance(p, str) and _PLACEMENT.fullmatch(p) for p in placements)
            or not _ints(gshape) or len(gshape) != ndim or not _ints(gstride)
            or len(gstride) != ndim
            or any(p != "R" and int(p[1:]) >= ndim for p in placements)):
        raise CheckpointIntegrityError(f"{where} DTensor layout is malformed", path=path)
    return DistLayout(tuple(mesh), tuple(placements), tuple(gshape), tuple(gstride))
