"""Reading format 1 shards (written before 2026-12), into the classes of ``header.py``.

Format 1 put every tensor at a 4096-aligned offset of its own, with checksums of each tensor's
chunks, and a 4096-byte preamble. Each tensor becomes a storage of its own here (format 1 wrote
shared storages once per tensor), viewed contiguously, and its chunks become the header's
``legacy_checks``. docs/format.md ("Format 1") describes it.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import CheckpointIntegrityError
from .documents import nonneg_field, required_field
from .header import (
    DEVICE,
    ShardHeader,
    StorageRecord,
    TensorRecord,
    contiguous_stride,
    decode_dist,
    decode_identity,
    is_u64,
    numel_fits,
    sizes_ok,
)
from .limits import ALIGN, DTYPES, MAX_PATH_LEN, MAX_TENSORS
from .region import align_up

__all__ = ("V1_PREAMBLE_SIZE", "decode_v1_body")

V1_PREAMBLE_SIZE = ALIGN


def decode_v1_body(data: dict[str, Any], path: str, *, file_size: int,
                   header_offset: int) -> ShardHeader:
    step, rank, world, save_id, created, chunk = decode_identity(data, path)
    data_offset = nonneg_field(data, "data_offset", path)
    data_length = nonneg_field(data, "data_length", path)
    if (data_offset != V1_PREAMBLE_SIZE or align_up(data_offset + data_length) != header_offset
            or header_offset > file_size):
        raise CheckpointIntegrityError("data region does not match the preamble", path=path)
    records_raw = required_field(data, "tensors", list, path)
    if len(records_raw) > MAX_TENSORS:
        raise CheckpointIntegrityError("too many tensors", path=path)
    storages: list[StorageRecord] = []
    tensors: list[TensorRecord] = []
    checks: list[tuple[int, int, int]] = []
    end = data_offset + data_length
    for i, raw in enumerate(records_raw):
        record, offset, sums = _decode_v1_record(raw, i, chunk, data_offset, end, path,
                                                 len(storages))
        storage = StorageRecord(offset, record.nbytes, record.device)
        if storages and storage.offset < storages[-1].end:
            raise CheckpointIntegrityError(f"tensor #{i} overlaps the one before it", path=path)
        storages.append(storage)
        tensors.append(record)
        starts = range(storage.offset, max(storage.end, storage.offset + 1), chunk)
        checks.extend((a, min(a + chunk, storage.end), s) for a, s in zip(starts, sums))
    tree = required_field(data, "tree", bytes, path)
    train_state = required_field(data, "train_state", dict, path)
    return ShardHeader(step, rank, world, save_id, created, chunk, data_offset, data_length,
                       tuple(storages), tuple(tensors), (), tree, train_state, version=1,
                       legacy_checks=tuple(checks))


def _decode_v1_record(raw: Any, index: int, chunk: int, lo: int, hi: int, path: str,
                      storage: int) -> tuple[TensorRecord, int, list[int]]:
    """A format-1 record as a view of a storage of its own, its file offset, its checksums."""
    where = f"tensor #{index}"
    if not isinstance(raw, list) or len(raw) != 8:
        raise CheckpointIntegrityError(f"{where} record is malformed", path=path)
    tpath, dtype, shape, offset, nbytes, sums, device, dist = raw
    if not isinstance(tpath, str) or len(tpath) > MAX_PATH_LEN:
        raise CheckpointIntegrityError(f"{where} path is malformed", path=path)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointIntegrityError(f"{where} ({tpath}) has dtype {dtype!r}, which is not "
                                       "on the allow-list", path=path)
    if not sizes_ok(shape) or not numel_fits(shape):
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
    if (not isinstance(sums, list) or len(sums) != max(1, -(-nbytes // chunk))
            or not all(is_u64(s) for s in sums)):
        raise CheckpointIntegrityError(f"{where} ({tpath}) checksums are malformed", path=path)
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise CheckpointIntegrityError(f"{where} ({tpath}) device is malformed", path=path)
    layout = None if dist is None else decode_dist(dist, len(shape), f"{where} ({tpath})", path)
    record = TensorRecord(tpath, dtype, tuple(shape), contiguous_stride(shape), storage, 0,
                          device, layout)
    return record, offset, sums
