"""The shard file: preamble, data region, header, and their encoding and decoding.

A shard is a small preamble (magic, version, where the header is and its checksum), the data
region (each stored storage's bytes, packed: only large ones start at an aligned offset),
checksummed in chunks of the region with xxh3-64 (``region.py``), then the header: a msgpack
document (``documents.py``) of what ``header.py`` describes (storages, tensor records, the state
tree and the TrainState). docs/format.md is the reference. Decoding checks every field against
the limits and every offset against the file, so that nothing read points outside it. Format 1
shards are read by ``shard_v1.py`` into the same classes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack

from .._gc import gc_paused
from ..errors import CheckpointIntegrityError
from .documents import FORMAT_VERSION, decode_document, nonneg_field, pack_plain, required_field
from .header import (
    DistLayout,
    ShardHeader,
    StorageRecord,
    decode_identity,
    decode_meshes,
    decode_record,
    decode_storages,
    device_name_ok,
    is_u64,
)
from .limits import ALIGN, MAX_HEADER_BYTES, MAX_TENSORS
from .region import checksum, chunk_count
from .shard_v1 import V1_PREAMBLE_SIZE, decode_v1_body

__all__ = (
    "PREAMBLE_SIZE",
    "SHARD_MAGIC",
    "decode_header",
    "decode_preamble",
    "encode_header",
    "encode_header_fields",
    "encode_preamble",
)


SHARD_MAGIC = b"CKPTSHRD"
_PREAMBLE = struct.Struct("<8sHHIQQQ")  # magic, version, flags, reserved, hdr off, hdr len, hdr xxh3
PREAMBLE_SIZE = 64
"""Bytes before the data region (format 2; format 1 used 4096)."""


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
        tensor_count=len(h.tensors), tree=h.tree, train_state=h.train_state,
        meshes=h.meshes or ())


def encode_header_fields(
    *, step: int, rank: int, world_size: int, save_id: str, created_unix: float,
    chunk_bytes: int, data_offset: int, data_length: int, checksums: Sequence[int],
    storages: Sequence[StorageRecord],
    tensors: Iterable[tuple[str, str, Sequence[int], Sequence[int], int, int,
                            DistLayout | None]],
    tensor_count: int, tree: bytes, train_state: dict[str, Any],
    meshes: Sequence[tuple[Sequence[int], Sequence[str] | None]] = (),
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
        "checksums": list(checksums), "devices": list(devices),
        "meshes": [[list(shape), None if names is None else list(names)]
                   for shape, names in meshes]}
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
    parts.append(pack_plain(train_state))
    return b"".join(parts)


def encode_preamble(header_offset: int, header: bytes) -> bytes:
    raw = _PREAMBLE.pack(SHARD_MAGIC, FORMAT_VERSION, 0, 0, header_offset, len(header),
                         checksum(header))
    return raw + bytes(PREAMBLE_SIZE - len(raw))


def decode_preamble(raw: bytes, file_size: int, path: str) -> tuple[int, int, int, int]:
    """(format version, header offset, header length, header checksum), checked against the
    file size. ``raw``: the first ``PREAMBLE_SIZE`` bytes (fewer if the file is shorter)."""
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
    data = decode_document(raw, "shard header", path, unwalked=("tensors", "storages", "checksums"))
    if not isinstance(data, dict):
        raise CheckpointIntegrityError("shard header is not a map", path=path)
    found = data.get("format")
    if type(found) is not int or found != version or data.get("kind") != "shard":
        raise CheckpointIntegrityError("shard header has the wrong format or kind", path=path)
    if version == 1:
        return decode_v1_body(data, path, file_size=file_size, header_offset=header_offset)
    step, rank, world, save_id, created, chunk = decode_identity(data, path)
    data_offset = nonneg_field(data, "data_offset", path)
    data_length = nonneg_field(data, "data_length", path)
    data_end = data_offset + data_length
    if data_offset != PREAMBLE_SIZE or data_end != header_offset or header_offset > file_size:
        raise CheckpointIntegrityError("data region does not match the preamble", path=path)
    sums = required_field(data, "checksums", list, path)
    if (len(sums) != chunk_count(data_offset, data_end, chunk)
            or not all(is_u64(s) for s in sums)):
        raise CheckpointIntegrityError("checksums are malformed", path=path)
    devices = required_field(data, "devices", list, path)
    if len(devices) > 1024 or not all(device_name_ok(d) for d in devices):
        raise CheckpointIntegrityError("device names are malformed", path=path)
    storages = decode_storages(required_field(data, "storages", list, path), devices, data_offset,
                                data_end, path)
    records_raw = required_field(data, "tensors", list, path)
    if len(records_raw) > MAX_TENSORS:
        raise CheckpointIntegrityError("too many tensors", path=path)
    with gc_paused():
        records = tuple(decode_record(r, i, storages, path)
                        for i, r in enumerate(records_raw))
    tree = required_field(data, "tree", bytes, path)
    train_state = required_field(data, "train_state", dict, path)
    return ShardHeader(step, rank, world, save_id, created, chunk, data_offset, data_length,
                       storages, records, tuple(sums), tree, train_state,
                       meshes=decode_meshes(data.get("meshes"), path))

