"""The on-disk format (version 1): names, shard layout, header, manifest and commit record.

docs/format.md is the reference. Everything except raw tensor bytes is msgpack, decoded with
explicit limits and validated field by field; nothing is ever unpickled.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from ..errors import CheckpointIntegrityError
from .limits import (
    ALIGN,
    DEVICE_PATTERN,
    DTYPE_NAMES,
    DTYPES,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    MAX_NESTING,
    MAX_PATH_LEN,
    MAX_SAVE_ID_LEN,
    MAX_SMALL_FILE_BYTES,
    MAX_TENSORS,
    PLACEMENT_PATTERN,
)

__all__ = (
    "ALIGN",
    "DTYPES",
    "DTYPE_NAMES",
    "FORMAT_VERSION",
    "CommitRecord",
    "DistLayout",
    "Manifest",
    "ShardHeader",
    "TensorRecord",
    "TensorRef",
    "align_up",
    "checksum",
    "commit_name",
    "decode_commit",
    "decode_header",
    "decode_manifest",
    "decode_message",
    "decode_preamble",
    "decode_tree",
    "encode_commit",
    "encode_header",
    "encode_manifest",
    "encode_message",
    "encode_preamble",
    "encode_tree",
    "manifest_name",
    "parse_rank_file",
    "parse_rejected_dir",
    "parse_step_dir",
    "rejected_dir_name",
    "shard_name",
    "step_dir_name",
)

FORMAT_VERSION = 1
SHARD_MAGIC = b"CKPTSHRD"
_PREAMBLE = struct.Struct("<8sHHIQQQ")  # magic, version, flags, reserved, hdr off, hdr len, hdr xxh3
PREAMBLE_SIZE = ALIGN  # the data region starts at the first aligned offset after the preamble

# The limits every reader enforces (MAX_HEADER_BYTES, MAX_SMALL_FILE_BYTES, MAX_TENSORS,
# MAX_NDIM, MAX_PATH_LEN, MAX_NESTING, MAX_SAVE_ID_LEN, the dtype allow-list, the device and
# placement patterns) are defined in ``_limits``, the one table that save() checks first.

_EXT_TENSOR = 1
_EXT_TUPLE = 2

_STEP_DIR = re.compile(r"^step-([0-9]{10,})$")
_RANK_FILE = re.compile(r"^rank-([0-9]{5,})\.(shard|manifest|commit)$")
_REJECTED_DIR = re.compile(r"^(step-[0-9]{10,})\.rejected-r([0-9]{5,})-([0-9a-f]{8})$")
TEMP_FILE = re.compile(r"^\.rank-[0-9]{5,}\.(shard|manifest|commit)\.tmp-[0-9a-f]{1,32}$")


def step_dir_name(step: int) -> str:
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a step directory name, or None; only the canonical spelling matches."""
    m = _STEP_DIR.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None


def rejected_dir_name(step: int, rank: int, token: str) -> str:
    """Where recovery moves a rank's files of a step it will not use (kept for inspection)."""
    return f"{step_dir_name(step)}.rejected-r{rank:05d}-{token}"


def parse_rejected_dir(name: str) -> tuple[int, int] | None:
    """(step, rank) of a directory that recovery moved aside, or None."""
    m = _REJECTED_DIR.match(name)
    if m is None:
        return None
    step = parse_step_dir(m.group(1))
    rank = int(m.group(2))
    if step is None or rejected_dir_name(step, rank, m.group(3)) != name:
        return None
    return step, rank


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.shard"


def manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.manifest"


def commit_name(rank: int) -> str:
    return f"rank-{rank:05d}.commit"


def parse_rank_file(name: str) -> tuple[int, str] | None:
    """(rank, kind) of a committed file name, or None."""
    m = _RANK_FILE.match(name)
    if m is None:
        return None
    rank = int(m.group(1))
    kind = m.group(2)
    return (rank, kind) if f"rank-{rank:05d}.{kind}" == name else None


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of a byte range (releases the GIL for large inputs)."""
    return int(xxhash.xxh3_64_intdigest(data))


# --------------------------------------------------------------------------- msgpack


def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default))


def _default(obj: Any) -> Any:
    if isinstance(obj, TensorRef):
        return msgpack.ExtType(_EXT_TENSOR, struct.pack("<Q", obj.index))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    raise TypeError(f"cannot encode {type(obj).__name__}")


class _Nested:
    """A tuple's msgpack payload, decoded after the enclosing document (see ``_unpack``)."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


def _unpack(data: bytes, *, max_len: int) -> Any:
    """Decode with explicit limits, then walk the result (``_walk``).

    A tuple is an extension whose payload is msgpack again. Decoding it from inside the
    extension hook would nest a C-level decoder per level (tens of KiB of C stack each: a
    small file of nested tuples could overflow the stack and kill the process), so the hook
    only keeps the payload and the walk decodes it afterwards, one level at a time.
    """
    def ext_hook(code: int, payload: bytes) -> Any:
        if code == _EXT_TENSOR:
            if len(payload) != 8:
                raise ValueError("bad tensor reference")
            return TensorRef(struct.unpack("<Q", payload)[0])
        if code == _EXT_TUPLE:
            return _Nested(payload)
        raise ValueError(f"unknown extension type {code}")

    def flat(raw: bytes) -> Any:
        return msgpack.unpackb(
            raw,
            raw=False,
            use_list=True,
            strict_map_key=False,
            object_pairs_hook=_checked_map,
            ext_hook=ext_hook,
            max_str_len=min(len(raw), max_len),
            max_bin_len=min(len(raw), max_len),
            max_array_len=min(len(raw), max_len),
            max_map_len=min(len(raw), max_len) // 2,
            max_ext_len=min(len(raw), max_len),
        )

    def walk(value: Any, depth: int) -> Any:
        """Check the depth, refuse timestamps, turn tuple payloads into tuples."""
        if isinstance(value, _Nested):
            inner = walk(flat(value.payload), depth)
            if not isinstance(inner, list):
                raise ValueError("bad tuple")
            return tuple(inner)
        if isinstance(value, (list, dict)):
            if depth >= MAX_NESTING:
                raise ValueError(f"nested deeper than {MAX_NESTING} levels")
            items = enumerate(value) if isinstance(value, list) else value.items()
            for key, item in list(items):
                if isinstance(item, (list, dict, _Nested, msgpack.Timestamp)):
                    value[key] = walk(item, depth + 1)
            return value
        if isinstance(value, msgpack.Timestamp):
            raise ValueError("timestamp extension (not written by ckpt_pipeline)")
        return value

    return walk(flat(data), 0)


def _checked_map(pairs: Sequence[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise ValueError(f"map key of type {type(key).__name__}")
        if key in out:
            raise ValueError(f"duplicate map key {key!r}")
        out[key] = value
    return out


def _decode(data: bytes, what: str, path: str) -> Any:
    try:
        return _unpack(data, max_len=MAX_HEADER_BYTES)
    except (ValueError, TypeError, RecursionError, msgpack.ExtraData,
            msgpack.FormatError, msgpack.StackError) as exc:
        raise CheckpointIntegrityError(f"{what} is not valid msgpack: {exc}", path=path) from exc


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Stands for the tensor at ``index`` of the shard's tensor index inside the state tree."""

    index: int


def encode_tree(tree: Any) -> bytes:
    """msgpack of a state skeleton (plain values, tuples, TensorRef placeholders)."""
    return _pack(tree)


def decode_tree(data: bytes, path: str, tensor_count: int | None = None) -> dict[Any, Any]:
    """Decode a state tree; it must be a map of names, and refer only to existing tensors."""
    tree = _decode(data, "state tree", path)
    if not isinstance(tree, dict) or not all(isinstance(k, str) for k in tree):
        raise CheckpointIntegrityError("state tree is not a map of names", path=path)
    if tensor_count is not None:
        stack: list[Any] = [tree]
        while stack:
            node = stack.pop()
            if isinstance(node, TensorRef):
                if node.index >= tensor_count:
                    raise CheckpointIntegrityError(
                        f"state tree refers to tensor #{node.index}, the shard holds "
                        f"{tensor_count}", path=path)
            elif isinstance(node, dict):
                stack.extend(node.values())
            elif isinstance(node, (list, tuple)):
                stack.extend(node)
    return tree


def encode_message(message: dict[str, Any]) -> bytes:
    """A control-plane message between ranks (msgpack, never pickle)."""
    return _pack(message)


def decode_message(data: bytes, what: str) -> dict[str, Any]:
    """Decode a control-plane message with the same limits as files; it must be a map."""
    value = _decode(data, what, "<control plane>")
    if not isinstance(value, dict):
        raise CheckpointIntegrityError(f"{what} is not a map")
    return value


# --------------------------------------------------------------------------- shard


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


def _is_format(data: Mapping[str, Any]) -> bool:
    """The document's format version is this library's (an int: not True, not 1.0)."""
    version = data.get("format")
    return type(version) is int and version == FORMAT_VERSION


def _req(data: Mapping[str, Any], key: str, typ: type | tuple[type, ...], path: str) -> Any:
    value = data.get(key)
    if not isinstance(value, typ) or (isinstance(value, bool) and bool not in _as_tuple(typ)):
        raise CheckpointIntegrityError(f"field {key!r} is missing or has the wrong type",
                                       path=path)
    return value


def _as_tuple(typ: type | tuple[type, ...]) -> tuple[type, ...]:
    return typ if isinstance(typ, tuple) else (typ,)


def _nonneg(data: Mapping[str, Any], key: str, path: str) -> int:
    value = _req(data, key, int, path)
    if value < 0:
        raise CheckpointIntegrityError(f"field {key!r} is negative", path=path)
    return int(value)


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


# --------------------------------------------------------------------------- manifest, commit


@dataclass(frozen=True, slots=True)
class Manifest:
    """What one rank wrote for a step: its shard's size and header checksum."""

    step: int
    rank: int
    world_size: int
    save_id: str
    shard_size: int
    header_checksum: int
    data_bytes: int


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """Written last, after every rank reported its shard durable: the step is complete."""

    step: int
    rank: int
    world_size: int
    save_id: str
    committed_unix: float


def encode_manifest(m: Manifest) -> bytes:
    return _pack({"format": FORMAT_VERSION, "kind": "manifest", "step": m.step,
                  "rank": m.rank, "world_size": m.world_size, "save_id": m.save_id,
                  "shard_size": m.shard_size, "header_checksum": m.header_checksum,
                  "data_bytes": m.data_bytes})


def encode_commit(c: CommitRecord) -> bytes:
    return _pack({"format": FORMAT_VERSION, "kind": "commit", "step": c.step, "rank": c.rank,
                  "world_size": c.world_size, "save_id": c.save_id,
                  "committed_unix": float(c.committed_unix)})


def _small(raw: bytes, kind: str, path: str) -> dict[str, Any]:
    if len(raw) > MAX_SMALL_FILE_BYTES:
        raise CheckpointIntegrityError(f"{kind} is too large", path=path)
    data = _decode(raw, kind, path)
    if not isinstance(data, dict) or not _is_format(data) or (
        data.get("kind") != kind
    ):
        raise CheckpointIntegrityError(f"{kind} has the wrong format or kind", path=path)
    return data


def _placement(d: Mapping[str, Any], path: str) -> tuple[int, int, int, str]:
    step, rank, world = (_nonneg(d, k, path) for k in ("step", "rank", "world_size"))
    if world < 1 or rank >= world:
        raise CheckpointIntegrityError(f"rank {rank} is outside world size {world}", path=path)
    save_id = _req(d, "save_id", str, path)
    if not (0 < len(save_id) <= MAX_SAVE_ID_LEN):
        raise CheckpointIntegrityError("save id is malformed", path=path)
    return step, rank, world, save_id


def decode_manifest(raw: bytes, path: str) -> Manifest:
    d = _small(raw, "manifest", path)
    return Manifest(*_placement(d, path), _nonneg(d, "shard_size", path),
                    _nonneg(d, "header_checksum", path), _nonneg(d, "data_bytes", path))


def decode_commit(raw: bytes, path: str) -> CommitRecord:
    d = _small(raw, "commit", path)
    return CommitRecord(*_placement(d, path), _req(d, "committed_unix", float, path))
