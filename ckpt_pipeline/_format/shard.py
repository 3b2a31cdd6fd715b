"""The layout of a shard file: preamble, data region, header; tensor records and checksums.

A shard is a fixed-size preamble (magic, version, where the header is and its checksum), the
data region (each tensor's bytes at an aligned offset, checksummed in chunks with xxh3-64),
then the header: a msgpack document (``documents.py``) describing every tensor
(``TensorRecord``, with its ``DistLayout`` for a DTensor's local shard), the state tree and the
TrainState. docs/format.md is the reference. Decoding checks every field against the limits
(``limits.py``) and every offset against the file, so that nothing read points outside it.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import CheckpointIntegrityError
from .documents import FORMAT_VERSION, _decode, _is_format, _nonneg, _pack, _req
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
    "TensorRecord",
    "align_up",
    "checksum",
    "chunk_count",
    "decode_header",
    "decode_preamble",
    "encode_header",
    "encode_preamble",
)

SHARD_MAGIC = b"CKPTSHRD"
_PREAMBLE = struct.Struct("<8sHHIQQQ")  # magic, version, flags, reserved, hdr off, hdr len, hdr xxh3
PREAMBLE_SIZE = ALIGN  # the data region starts at the first aligned offset after the preamble


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of a byte range (releases the GIL for large inputs)."""
    return int(xxhash.xxh3_64_intdigest(data))


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
class TensorRecord:
    """One tensor in a shard: where its bytes are and how to check them."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksums: tuple[int, ...]
    device: str
    dist: DistLayout | None = None
    """Set when the tensor is a rank's local shard of a DTensor."""


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
    tensors: tuple[TensorRecord, ...]
    tree: bytes
    train_state: dict[str, Any]

    @property
    def header_offset(self) -> int:
        return align_up(self.data_offset + self.data_length)


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    return max(1, math.ceil(nbytes / chunk_bytes))


def encode_header(h: ShardHeader) -> bytes:
    return _pack({
        "format": FORMAT_VERSION,
        "kind": "shard",
        "step": h.step,
        "rank": h.rank,
        "world_size": h.world_size,
        "save_id": h.save_id,
        "created_unix": float(h.created_unix),
        "chunk_bytes": h.chunk_bytes,
        "data_offset": h.data_offset,
        "data_length": h.data_length,
        "tensors": [
            [t.path, t.dtype, list(t.shape), t.offset, t.nbytes, list(t.checksums), t.device,
             None if t.dist is None else t.dist.to_plain()]
            for t in h.tensors
        ],
        "tree": h.tree,
        "train_state": h.train_state,
    })


def encode_preamble(header_offset: int, header: bytes) -> bytes:
    raw = _PREAMBLE.pack(SHARD_MAGIC, FORMAT_VERSION, 0, 0, header_offset, len(header),
                         checksum(header))
    return raw + bytes(PREAMBLE_SIZE - len(raw))


def decode_preamble(raw: bytes, file_size: int, path: str) -> tuple[int, int, int]:
    """(header offset, header length, header checksum), checked against the file size."""
    if len(raw) < _PREAMBLE.size:
        raise CheckpointIntegrityError("shard is shorter than its preamble", path=path)
    magic, version, flags, reserved, off, length, digest = _PREAMBLE.unpack_from(raw)
    if magic != SHARD_MAGIC:
        raise CheckpointIntegrityError("not a ckpt_pipeline shard (bad magic)", path=path)
    if flags or reserved:
        raise CheckpointIntegrityError("shard preamble has unknown flags", path=path)
    if version != FORMAT_VERSION:
        raise CheckpointIntegrityError(
            f"shard format version {version} is not supported (this library reads "
            f"{FORMAT_VERSION})", path=path, hint="upgrade ckpt_pipeline")
    if (off < PREAMBLE_SIZE or off % ALIGN or length == 0 or length > MAX_HEADER_BYTES
            or off + length != file_size):
        raise CheckpointIntegrityError(
            f"shard header at {off}+{length} does not fit a file of {file_size} bytes",
            path=path)
    return off, length, digest


def decode_header(raw: bytes, path: str, *, file_size: int, header_offset: int) -> ShardHeader:
    """Decode and validate a shard header; every offset must stay inside the file."""
    data = _decode(raw, "shard header", path)
    if not isinstance(data, dict):
        raise CheckpointIntegrityError("shard header is not a map", path=path)
    if not _is_format(data) or data.get("kind") != "shard":
        raise CheckpointIntegrityError("shard header has the wrong format or kind", path=path)
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
    data_offset = _nonneg(data, "data_offset", path)
    data_length = _nonneg(data, "data_length", path)
    if data_offset != PREAMBLE_SIZE or align_up(data_offset + data_length) != header_offset:
        raise CheckpointIntegrityError("data region does not match the preamble", path=path)
    records_raw = _req(data, "tensors", list, path)
    if len(records_raw) > MAX_TENSORS:
        raise CheckpointIntegrityError("too many tensors", path=path)
    records = tuple(
        _decode_record(r, i, chunk, data_offset, data_offset + data_length, path)
        for i, r in enumerate(records_raw)
    )
    tree = _req(data, "tree", bytes, path)
    train_state = _req(data, "train_state", dict, path)
    if header_offset > file_size:
        raise CheckpointIntegrityError("header lies beyond the end of the file", path=path)
    return ShardHeader(step, rank, world, save_id, created, chunk, data_offset, data_length,
                       records, tree, train_state)


def _decode_record(raw: Any, index: int, chunk: int, lo: int, hi: int, path: str) -> TensorRecord:
    where = f"tensor #{index}"
    if not isinstance(raw, list) or len(raw) != 8:
        raise CheckpointIntegrityError(f"{where} record is malformed", path=path)
    tpath, dtype, shape, offset, nbytes, sums, device, dist = raw
    if not isinstance(tpath, str) or len(tpath) > MAX_PATH_LEN:
        raise CheckpointIntegrityError(f"{where} path is malformed", path=path)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointIntegrityError(f"{where} ({tpath}) has dtype {dtype!r}, which is not "
                                       "on the allow-list", path=path)
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise CheckpointIntegrityError(f"{where} ({tpath}) shape is malformed", path=path)
    for name, value in (("offset", offset), ("length", nbytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointIntegrityError(f"{where} ({tpath}) {name} is malformed", path=path)
    itemsize = DTYPES[dtype].itemsize
    if math.prod(shape) * itemsize != nbytes:
        raise CheckpointIntegrityError(
            f"{where} ({tpath}): shape {shape} x {itemsize} bytes != length {nbytes}", path=path)
    if offset % ALIGN or offset < lo or offset + nbytes > hi:
        raise CheckpointIntegrityError(f"{where} ({tpath}) lies outside the data region",
                                       path=path)
    if (not isinstance(sums, list) or len(sums) != chunk_count(nbytes, chunk)
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**64
                       for s in sums)):
        raise CheckpointIntegrityError(f"{where} ({tpath}) checksums are malformed", path=path)
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise CheckpointIntegrityError(f"{where} ({tpath}) device is malformed", path=path)
    layout = None if dist is None else _decode_dist(dist, len(shape), f"{where} ({tpath})", path)
    return TensorRecord(tpath, dtype, tuple(shape), offset, nbytes, tuple(sums), device, layout)


def _ints(value: Any, *, positive: bool = False) -> bool:
    return isinstance(value, list) and len(value) <= MAX_NDIM and all(
        isinstance(v, int) and not isinstance(v, bool) and (v > 0 if positive else v >= 0)
        for v in value)


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
