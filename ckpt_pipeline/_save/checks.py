"""The save-side check of every limit a reader enforces, on the training thread, before anything
is copied or written (the table of limits is ``_format/limits.py``).

What ``save()`` acknowledges, restore must accept. Per tensor and per container,
``_tree.flatten_state`` checks as it walks the state (it names the offending path);
``check_save`` checks what needs the whole save: the TrainState, the planned size of the shard
header, the save id, the manifest and commit record, and DTensor layouts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._format.documents import CommitRecord, Manifest, encode_commit, encode_manifest, encode_tree
from .._format.header import ShardHeader, StorageRecord, TensorRecord, contiguous_stride
from .._format.layout import DataLayout
from .._format.limits import (
    ALIGN,
    DTYPE_NAMES,
    DTYPES,
    INT_MAX,
    INT_MIN,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    MAX_NESTING,
    MAX_SAVE_ID_LEN,
    MAX_SMALL_FILE_BYTES,
    MIN_CHUNK_BYTES,
    PLACEMENT_PATTERN,
    TRAIN_STATE_DEPTH,
)
from .._format.shard import PREAMBLE_SIZE, encode_header
from .._tree import FlatState, check_text, nesting_error, short_path
from ..errors import StateError

__all__ = (
    "check_byte_copyable",
    "check_save",
    "header_bytes_bound",
    "small_file_bytes_bound",
)


def check_save(flat: FlatState, tree: bytes, train_state: Mapping[str, Any], *, step: int,
               rank: int, world_size: int, save_id: str, chunk_bytes: int,
               layout: DataLayout) -> None:
    """Raise StateError unless every reader's limit holds for this save; writes nothing.

    ``flat`` comes from ``flatten_state`` (which checked each tensor and the state tree's
    containers and leaves), ``tree`` is its encoding, ``train_state`` the TrainState's
    ``to_plain()``; the rest is what the shard header will hold.
    """
    if not 0 <= step <= INT_MAX:
        raise StateError(f"step {step} does not fit in 64 bits (limit int_range)", step=step,
                         rank=rank)
    _check_train_state(train_state, step=step, rank=rank)
    try:
        ts_bytes = encode_tree(train_state)
    except (TypeError, ValueError, OverflowError) as exc:  # not expected after the walk
        raise StateError(f"a value cannot be encoded: {exc}", step=step, rank=rank,
                         path="train_state", hint="TrainState.extra must hold plain "
                                                  "values") from exc
    _check_layouts(flat, step=step, rank=rank)
    if len(save_id) > MAX_SAVE_ID_LEN:
        raise StateError(f"save id {save_id[:40]!r}... is {len(save_id)} characters; a reader "
                         f"accepts at most {MAX_SAVE_ID_LEN} (limit save_id_length)",
                         step=step, rank=rank, hint="use a smaller step number")
    small = small_file_bytes_bound(step=step, rank=rank, world_size=world_size,
                                   save_id=save_id)
    if small > MAX_SMALL_FILE_BYTES:
        raise StateError(f"the manifest or commit record would be up to {small} bytes; a "
                         f"reader accepts at most {MAX_SMALL_FILE_BYTES} "
                         "(limit small_file_bytes)", step=step, rank=rank)
    size = header_bytes_bound(flat, tree, ts_bytes, step=step, rank=rank,
                              world_size=world_size, save_id=save_id, chunk_bytes=chunk_bytes,
                              layout=layout, cap=MAX_HEADER_BYTES)
    if size > MAX_HEADER_BYTES:
        raise _header_error(flat, tree, ts_bytes, train_state, size, step=step, rank=rank)


def check_byte_copyable(flat: FlatState, *, step: int, rank: int) -> None:
    """A streamed save copies each tensor's memory as bytes: refuse views whose values are not
    their bytes (conjugate or negative bit set, zero tensors without storage)."""
    for t, path in zip(flat.tensors, flat.paths):
        if t.is_conj() or t.is_neg() or t._is_zerotensor():
            what = ("a conjugate view" if t.is_conj() else "a negative view" if t.is_neg()
                    else "a zero tensor without storage")
            raise StateError(
                f"tensor {short_path(path)} is {what}; a state larger than host_buffer_bytes is "
                "copied as raw bytes, which would not hold its values", step=step, rank=rank,
                path=path, hint="save t.resolve_conj().resolve_neg() (a copy), or set "
                                "host_buffer_bytes=None (a buffer as large as the state)")


def _check_train_state(plain: Mapping[str, Any], *, step: int, rank: int) -> None:
    """Walk the TrainState's plain form as the header's decoder will see it.

    The counters are checked for the int range; ``extra`` fully (keys, leaves, containers,
    depth); the RNG states are produced by the library (ints below 2**32, bytes, floats).
    """
    for key, value in plain.items():
        if key in ("extra", "rng"):
            continue
        if type(value) is int and not INT_MIN <= value <= INT_MAX:
            raise StateError(f"TrainState.{key} = {value} does not fit in 64 bits "
                             "(limit int_range)", step=step, rank=rank,
                             path=f"train_state/{key}")
    extra = plain.get("extra", {})
    _walk_plain(extra, "train_state/extra", TRAIN_STATE_DEPTH + 1, step=step, rank=rank)


def _walk_plain(obj: Any, path: str, depth: int, *, step: int, rank: int) -> None:
    """Check a value the header's encoder packs as is (``strict_types``): exact plain types."""
    kind = type(obj)
    if kind is dict or kind is list or kind is tuple:
        if depth >= MAX_NESTING:
            raise nesting_error(path, depth, step=step, rank=rank,
                                document="the shard header (train_state/extra is at depth "
                                         f"{TRAIN_STATE_DEPTH + 1})")
        if kind is dict:
            for key, value in obj.items():
                _check_plain_key(key, path, step=step, rank=rank)
                _walk_plain(value, f"{path}/{key}", depth + 1, step=step, rank=rank)
        else:
            for i, value in enumerate(obj):
                _walk_plain(value, f"{path}/{i}", depth + 1, step=step, rank=rank)
        return
    if obj is None or kind is bool or kind is float or kind is bytes:
        return
    if kind is int:
        if not INT_MIN <= obj <= INT_MAX:
            raise StateError(f"integer {obj} at {short_path(path)} does not fit in 64 bits "
                             "(limit int_range)", step=step, rank=rank, path=path)
        return
    if kind is str:
        check_text(obj, path, step=step, rank=rank)
        return
    if kind is bytearray or kind is memoryview:
        return  # packed as bin: read back as bytes, as in the state tree
    if isinstance(obj, (Mapping, list, tuple)):
        raise StateError(
            f"{short_path(path)} is a {kind.__module__}.{kind.__qualname__}; it would not come "
            "back as what was saved (limit value_types)", step=step, rank=rank, path=path,
            hint="convert it to a plain dict, list or tuple")
    raise StateError(
        f"{short_path(path)} holds a value of type {kind.__module__}.{kind.__qualname__}, which "
        "TrainState.extra cannot hold (limit value_types)", step=step, rank=rank, path=path,
        hint="TrainState.extra holds plain values: None, bool, int, float, str, bytes, and "
             "dicts, lists and tuples of them")


def _check_plain_key(key: object, path: str, *, step: int, rank: int) -> None:
    if type(key) is str:
        check_text(key, path, step=step, rank=rank)
        return
    if type(key) is int and INT_MIN <= key <= INT_MAX:
        return
    raise StateError(f"map key {key!r} of type {type(key).__name__} at {short_path(path)} is not "
                     "supported (limit map_keys: keys are str or int)", step=step, rank=rank,
                     path=path, hint="use str or int keys")



def _check_layouts(flat: FlatState, *, step: int, rank: int) -> None:
    if flat.layouts.count(None) == len(flat.layouts):
        return
    for t, path, layout in zip(flat.tensors, flat.paths, flat.layouts):
        if layout is None:
            continue
        ndim = t.dim()
        problem = None
        if not 0 < len(layout.mesh_shape) <= MAX_NDIM:
            problem = (f"its mesh has {len(layout.mesh_shape)} dimensions (limit ndim: at most "
                       f"{MAX_NDIM})")
        elif not all(type(d) is int and 0 < d <= INT_MAX for d in layout.mesh_shape):
            problem = f"its mesh shape {list(layout.mesh_shape)} is not all positive"
        elif len(layout.placements) != len(layout.mesh_shape) or not all(
            PLACEMENT_PATTERN.fullmatch(p) and (p == "R" or int(p[1:]) < ndim)
            for p in layout.placements
        ):
            problem = (f"placements {list(layout.placements)} are not one 'R' or 'S<dim>' "
                       f"(0 <= dim < {ndim}) per mesh dimension")
        elif (len(layout.global_shape) != ndim or len(layout.global_stride) != ndim
              or not all(type(v) is int and 0 <= v <= INT_MAX
                         for v in (*layout.global_shape, *layout.global_stride))):
            problem = (f"its global shape {list(layout.global_shape)} and stride "
                       f"{list(layout.global_stride)} do not fit its {ndim} local dimensions")
        if problem is not None:
            raise StateError(f"DTensor {short_path(path)}: {problem} (limit dtensor_layout)",
                             step=step, rank=rank, path=path,
                             hint="redistribute it to Shard(dim) or Replicate placements "
                                  "with non-negative dims")


def small_file_bytes_bound(*, step: int, rank: int, world_size: int, save_id: str) -> int:
    """The largest the manifest or the commit record of this save can be."""
    manifest = encode_manifest(Manifest(step, rank, world_size, save_id, INT_MAX, INT_MAX,
                                        INT_MAX))
    commit = encode_commit(CommitRecord(step, rank, world_size, save_id, 0.0))
    return max(len(manifest), len(commit))


def _array_header(n: int) -> int:
    return 1 if n < 16 else 3 if n < 1 << 16 else 5


def _bin_header(n: int) -> int:
    return 2 if n < 1 << 8 else 3 if n < 1 << 16 else 5


_CHECKSUM_BYTES = 9
"""The largest msgpack encoding of a checksum (a uint64)."""
_RECORD_BYTES = (1 + 5 + 1 + max(map(len, DTYPES)) + 2 * (3 + 9 * MAX_NDIM) + 9 + 9 + 1)
"""A bound on a tensor record's bytes besides its path's (array header, path header, dtype,
shape and stride of at most MAX_NDIM dims, storage index, byte offset, nil dist)."""
_STORAGE_BYTES = 1 + 9 + 9 + 1 + 21
"""A bound on a storage record's bytes (array header, offset, length, device)."""
_DIST_BYTES = 1 + (3 + 9 * MAX_NDIM) + (3 + 4 * MAX_NDIM) + 2 * (3 + 9 * MAX_NDIM) - 1
"""A bound on a DTensor layout's bytes beyond the nil counted in ``_RECORD_BYTES``."""


def header_bytes_bound(flat: FlatState, tree: bytes, ts_bytes: bytes, *, step: int,
                       rank: int, world_size: int, save_id: str, chunk_bytes: int,
                       layout: DataLayout, cap: int, exact: bool = False) -> int:
    """An upper bound of the shard header's size, exact but for the checksums' encodings.

    The header ``serialize`` writes is ``encode_header`` of these fields, with the checksums
    known only then and a checksum chunk of at least ``min(chunk_bytes, 1 MiB)``; each
    checksum is counted here at its largest encoding, so a header can only be smaller. A cheap
    bound (every number and name at its largest, no per-tensor Python work) is returned when
    it is at most ``cap``: normal states. Above it, the header is encoded here with the real
    records. When the state tree and TrainState alone exceed ``cap``, that (lower) bound is
    returned without encoding anything. ``exact``: always encode.
    """
    paths, tensors, layouts = flat.paths, flat.tensors, flat.layouts
    n = len(tensors)
    count = len(layout.items)
    smallest_chunk = max(ALIGN, min(chunk_bytes, MIN_CHUNK_BYTES))
    chunks = -(-layout.data_length // smallest_chunk) + (layout.data_length > 0)

    def header(records: tuple[TensorRecord, ...], storages: tuple[StorageRecord, ...],
               tree: bytes, train_state: dict[str, Any]) -> bytes:
        return encode_header(ShardHeader(
            step=step, rank=rank, world_size=world_size, save_id=save_id, created_unix=0.0,
            chunk_bytes=chunk_bytes, data_offset=PREAMBLE_SIZE,
            data_length=layout.data_length, storages=storages, tensors=records,
            checksums=(), tree=tree, train_state=train_state, meshes=flat.meshes))

    # The fixed fields, with empty lists (1 byte each), tree (2) and train_state map (1).
    fixed = len(header((), (), b"", {})) - 6
    low = (fixed + _bin_header(len(tree)) + len(tree) + len(ts_bytes) + _array_header(n)
           + _array_header(count) + _array_header(chunks) + _CHECKSUM_BYTES * chunks)
    if not exact:
        if low > cap:  # the state tree and the TrainState alone are too large
            return low
        cheap = (low + n * _RECORD_BYTES + 4 * sum(map(len, paths))  # UTF-8: <= 4 B a char
                 + count * _STORAGE_BYTES + _STORAGE_BYTES * min(count, 1024)  # device names
                 + (n - layouts.count(None)) * _DIST_BYTES)
        if cheap <= cap:
            return cheap
        tighter = cheap - 18 * (MAX_NDIM * n - sum(t.dim() for t in tensors))  # real dims
        if tighter <= cap:
            return tighter
    items = layout.storage_records()
    records = tuple(
        TensorRecord(path, DTYPE_NAMES[t.dtype], tuple(t.shape),
                     contiguous_stride(t.shape) if stride is None else stride, item, offset,
                     items[item].device, dist)
        for t, path, stride, item, offset, dist in zip(
            tensors, paths, layout.tensor_stride, layout.tensor_item, layout.tensor_offset,
            layouts))
    encoded = len(header(records, items, tree, {}))  # train_state: its bytes added below
    return (encoded - 2 + len(ts_bytes) + _array_header(chunks) + _CHECKSUM_BYTES * chunks)


def _header_error(flat: FlatState, tree: bytes, ts_bytes: bytes,
                  train_state: Mapping[str, Any], size: int, *, step: int,
                  rank: int) -> StateError:
    """Name the largest value (str or bytes) of the state tree or TrainState.extra."""
    largest: tuple[int, str] = (0, "")

    def visit(obj: Any, path: str) -> None:
        nonlocal largest
        if isinstance(obj, dict):
            for key, value in obj.items():
                visit(value, f"{path}/{key}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                visit(value, f"{path}/{i}")
        elif isinstance(obj, (str, bytes, bytearray, memoryview)):
            length = len(obj)
            if length > largest[0]:
                largest = (length, path)

    for name, value in flat.skeleton.items():
        visit(value, name)
    visit(train_state.get("extra", {}), "train_state/extra")
    parts = (f"the state tree is {len(tree)} bytes, the TrainState {len(ts_bytes)}, the index "
             f"of {len(flat.tensors)} tensors the rest")
    where = (f"; the largest value is {short_path(largest[1])} ({largest[0]} bytes)"
             if largest[0] else "")
    return StateError(
        f"the shard header would be about {size} bytes; a reader accepts at most "
        f"{MAX_HEADER_BYTES} (limit header_bytes): {parts}{where}", step=step, rank=rank,
        path=largest[1] or None,
        hint="keep large blobs out of plain values: save them as tensors "
             "(torch.frombuffer(blob, dtype=torch.uint8)), whose data have no such limit; "
             "or merge many small tensors into fewer")
