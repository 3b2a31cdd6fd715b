"""The format's msgpack documents: state tree, messages, manifest, commit record.

Everything except raw tensor bytes is msgpack (docs/format.md), never pickle. Encoding packs
plain values strictly, with two extensions: a ``TensorRef`` placeholder in the state tree and a
tuple. Decoding (``_unpack``) runs with explicit length limits, bounds the nesting, refuses
anything the library does not write (non-string/int map keys, duplicate keys, timestamps), and
each document is then validated field by field into its dataclass. The field checkers
(``required_field``, ``nonneg_field``, ``_is_format``) serve the shard header (``shard.py``) as well.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .._gc import gc_paused
from ..errors import CheckpointIntegrityError
from .limits import MAX_HEADER_BYTES, MAX_NESTING, MAX_SAVE_ID_LEN, MAX_SMALL_FILE_BYTES
from .timeline import (
    MAX_REWINDS,
    Lineage,
    Rewind,
    decode_lineage,
    decode_rewind,
    encode_lineage,
    rewind_doc,
)

__all__ = (
    "FORMAT_VERSION",
    "CommitRecord",
    "Manifest",
    "TensorRef",
    "decode_commit",
    "decode_document",
    "decode_manifest",
    "decode_message",
    "decode_rewinds",
    "decode_tree",
    "encode_commit",
    "encode_manifest",
    "encode_message",
    "encode_rewinds",
    "encode_tree",
    "nonneg_field",
    "pack_plain",
    "required_field",
)

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Format 2 (2026-12): storages packed and written once; format 1 is still read."""

# The limits every reader enforces (MAX_HEADER_BYTES, MAX_SMALL_FILE_BYTES, MAX_TENSORS,
# MAX_NDIM, MAX_PATH_LEN, MAX_NESTING, MAX_SAVE_ID_LEN, the dtype allow-list, the device and
# placement patterns) are defined in ``limits``, the one table that save() checks first.

_EXT_TENSOR = 1
_EXT_TUPLE = 2


# --------------------------------------------------------------------------- msgpack


def pack_plain(obj: Any) -> bytes:
    """Pack plain values strictly (exact types; tensor references and tuples as extensions)."""
    return bytes(msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default))


def _default(obj: Any) -> Any:
    if isinstance(obj, TensorRef):
        return msgpack.ExtType(_EXT_TENSOR, struct.pack("<Q", obj.index))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, pack_plain(list(obj)))
    raise TypeError(f"cannot encode {type(obj).__name__}")


class _Nested:
    """A tuple's msgpack payload, decoded after the enclosing document (see ``_unpack``)."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


def _unpack(data: bytes, *, max_len: int, unwalked: tuple[str, ...] = ()) -> Any:
    """Decode with explicit limits, then walk the result (``_walk``).

    A tuple is an extension whose payload is msgpack again. Decoding it from inside the
    extension hook would nest a C-level decoder per level (tens of KiB of C stack each: a
    small file of nested tuples could overflow the stack and kill the process), so the hook
    only keeps the payload and the walk decodes it afterwards, one level at a time.
    ``unwalked``: keys of a top-level map whose values the caller checks element by element
    (a tuple or a timestamp there fails that check), so the walk skips them.
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
            skip = unwalked if depth == 0 and isinstance(value, dict) else ()
            for key, item in list(items):
                if key in skip:
                    continue
                if isinstance(item, (list, dict, _Nested, msgpack.Timestamp)):
                    value[key] = walk(item, depth + 1)
            return value
        if isinstance(value, msgpack.Timestamp):
            raise ValueError("timestamp extension (not written by ckpt_pipeline)")
        return value

    with gc_paused():
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


def decode_document(data: bytes, what: str, path: str, unwalked: tuple[str, ...] = ()
                    ) -> Any:
    """Decode one msgpack document with the readers' limits; CheckpointIntegrityError
    naming ``what`` otherwise. ``unwalked``: top-level keys whose values the caller checks
    field by field itself."""
    try:
        return _unpack(data, max_len=MAX_HEADER_BYTES, unwalked=unwalked)
    except (ValueError, TypeError, RecursionError, msgpack.ExtraData,
            msgpack.FormatError, msgpack.StackError) as exc:
        raise CheckpointIntegrityError(f"{what} is not valid msgpack: {exc}", path=path) from exc


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Stands for the tensor at ``index`` of the shard's tensor index inside the state tree."""

    index: int


def encode_tree(tree: Any) -> bytes:
    """msgpack of a state skeleton (plain values, tuples, TensorRef placeholders)."""
    return pack_plain(tree)


def decode_tree(data: bytes, path: str, tensor_count: int | None = None) -> dict[Any, Any]:
    """Decode a state tree; it must be a map of names, and refer only to existing tensors."""
    tree = decode_document(data, "state tree", path)
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
    return pack_plain(message)


def decode_message(data: bytes, what: str) -> dict[str, Any]:
    """Decode a control-plane message with the same limits as files; it must be a map."""
    value = decode_document(data, what, "<control plane>")
    if not isinstance(value, dict):
        raise CheckpointIntegrityError(f"{what} is not a map")
    return value


# --------------------------------------------------------------------------- fields


def _is_format(data: Mapping[str, Any]) -> bool:
    """The document's format version is one this library reads (an int: not True, not 1.0)."""
    version = data.get("format")
    return type(version) is int and version in READABLE_VERSIONS


def required_field(data: Mapping[str, Any], key: str, typ: type | tuple[type, ...],
                   path: str) -> Any:
    """The value of ``key``, which must be present and of type ``typ`` (a bool is no int)."""
    value = data.get(key)
    if not isinstance(value, typ) or (isinstance(value, bool) and bool not in _as_tuple(typ)):
        raise CheckpointIntegrityError(f"field {key!r} is missing or has the wrong type",
                                       path=path)
    return value


def _as_tuple(typ: type | tuple[type, ...]) -> tuple[type, ...]:
    return typ if isinstance(typ, tuple) else (typ,)


def nonneg_field(data: Mapping[str, Any], key: str, path: str) -> int:
    """The value of ``key``: a non-negative int."""
    value = required_field(data, key, int, path)
    if value < 0:
        raise CheckpointIntegrityError(f"field {key!r} is negative", path=path)
    return int(value)


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
    """Written last, after every rank reported its shard durable: the step is complete.

    ``metrics``: the values the retention policies rank steps by, from rank 0's
    ``TrainState.extra`` at this save (the same on every rank); empty when none asked.
    ``lineage``: the step this one continues from and the run's timeline (``timeline.py``);
    None in records written before lineage existed.
    """

    step: int
    rank: int
    world_size: int
    save_id: str
    committed_unix: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    lineage: Lineage | None = None


def encode_manifest(m: Manifest) -> bytes:
    return pack_plain({"format": FORMAT_VERSION, "kind": "manifest", "step": m.step,
                  "rank": m.rank, "world_size": m.world_size, "save_id": m.save_id,
                  "shard_size": m.shard_size, "header_checksum": m.header_checksum,
                  "data_bytes": m.data_bytes})


def encode_commit(c: CommitRecord) -> bytes:
    """The record; ``metrics`` and the lineage only when there are some (records stay as
    before without)."""
    doc: dict[str, Any] = {"format": FORMAT_VERSION, "kind": "commit", "step": c.step,
                           "rank": c.rank, "world_size": c.world_size, "save_id": c.save_id,
                           "committed_unix": float(c.committed_unix)}
    if c.metrics:
        doc["metrics"] = {str(name): float(value) for name, value in c.metrics.items()}
    if c.lineage is not None:
        doc.update(encode_lineage(c.lineage))
    return pack_plain(doc)


def _small(raw: bytes, kind: str, path: str) -> dict[str, Any]:
    if len(raw) > MAX_SMALL_FILE_BYTES:
        raise CheckpointIntegrityError(f"{kind} is too large", path=path)
    data = decode_document(raw, kind, path)
    if not isinstance(data, dict) or not _is_format(data) or (
        data.get("kind") != kind
    ):
        raise CheckpointIntegrityError(f"{kind} has the wrong format or kind", path=path)
    return data


def _placement(d: Mapping[str, Any], path: str) -> tuple[int, int, int, str]:
    step, rank, world = (nonneg_field(d, k, path) for k in ("step", "rank", "world_size"))
    if world < 1 or rank >= world:
        raise CheckpointIntegrityError(f"rank {rank} is outside world size {world}", path=path)
    save_id = required_field(d, "save_id", str, path)
    if not (0 < len(save_id) <= MAX_SAVE_ID_LEN):
        raise CheckpointIntegrityError("save id is malformed", path=path)
    return step, rank, world, save_id


def decode_manifest(raw: bytes, path: str) -> Manifest:
    d = _small(raw, "manifest", path)
    return Manifest(*_placement(d, path), nonneg_field(d, "shard_size", path),
                    nonneg_field(d, "header_checksum", path), nonneg_field(d, "data_bytes", path))


def decode_commit(raw: bytes, path: str) -> CommitRecord:
    d = _small(raw, "commit", path)
    return CommitRecord(*_placement(d, path), required_field(d, "committed_unix", float, path),
                        _metrics(d, path), decode_lineage(d, path))


def _metrics(d: Mapping[str, Any], path: str) -> dict[str, float]:
    """The optional ``metrics`` field: a map of non-empty names to finite floats ({} when
    absent, as in records written before the field existed)."""
    if "metrics" not in d:
        return {}
    value = d["metrics"]
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k and type(v) is float and math.isfinite(v)
        for k, v in value.items()
    ):
        raise CheckpointIntegrityError("field 'metrics' is not a map of names to finite "
                                       "floats", path=path)
    return dict(value)


# --------------------------------------------------------------------------- rewinds


def encode_rewinds(rewinds: Sequence[Rewind]) -> bytes:
    """A rewind record: a rank's file in a local root (one rewind) or the persistent tier's
    ``timeline.rewinds`` (the newest ``MAX_REWINDS``), oldest timeline first."""
    newest = sorted(rewinds, key=lambda r: r.timeline)[-MAX_REWINDS:]
    return pack_plain({"format": FORMAT_VERSION, "kind": "rewinds",
                  "rewinds": [rewind_doc(r) for r in newest]})


def decode_rewinds(raw: bytes, path: str) -> list[Rewind]:
    d = _small(raw, "rewinds", path)
    value = d.get("rewinds")
    if not isinstance(value, list) or len(value) > MAX_REWINDS:
        raise CheckpointIntegrityError(f"field 'rewinds' is not a list of at most "
                                       f"{MAX_REWINDS} rewinds", path=path)
    return [decode_rewind(item, path) for item in value]
