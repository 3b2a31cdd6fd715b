"""The format: names, tree encoding and hostile-input decoding (property-based)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_pipeline import CheckpointIntegrityError
from ckpt_pipeline._format.documents import (
    TensorRef,
    decode_commit,
    decode_manifest,
    decode_tree,
    encode_tree,
)
from ckpt_pipeline._format.header import ShardHeader, StorageRecord, TensorRecord
from ckpt_pipeline._format.limits import ALIGN
from ckpt_pipeline._format.names import parse_rank_file, parse_step_dir, step_dir_name
from ckpt_pipeline._format.shard import PREAMBLE_SIZE, decode_header, decode_preamble, encode_header
from ckpt_pipeline._tree import flatten_state, materialize

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=20,
)


@given(st.integers(min_value=0, max_value=10**30))
def test_step_directory_names_parse_back_without_a_digit_limit(step: int) -> None:
    assert parse_step_dir(step_dir_name(step)) == step


@pytest.mark.parametrize("name", ["step-00000000050", "step-50", "step-000000005x",
                                  "step-0000000050/..", "../step-0000000050", "step--000000005"])
def test_non_canonical_step_names_are_ignored(name: str) -> None:
    assert parse_step_dir(name) is None


@pytest.mark.parametrize("name", ["rank-0.shard", "rank-000000.shard", "rank-00000.shard.bak",
                                  "rank-00000.pickle", "/rank-00000.shard"])
def test_non_canonical_rank_files_are_ignored(name: str) -> None:
    assert parse_rank_file(name) is None


@given(plain)
def test_plain_values_round_trip_through_the_tree_encoding(value: Any) -> None:
    flat = flatten_state({"v": value}, step=1)
    assert decode_tree(encode_tree(flat.skeleton), "x") == {"v": value}


@given(st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_tensor_references_round_trip_in_order(indices: list[int]) -> None:
    tensors = [torch.full((2,), float(i)) for i in range(4)]
    state = {"ts": [tensors[i] for i in indices]}
    flat = flatten_state(state, step=1)
    tree = decode_tree(encode_tree(flat.skeleton), "x")
    assert all(isinstance(r, TensorRef) for r in tree["ts"])
    back = materialize(tree, list(flat.tensors))
    for got, i in zip(back["ts"], indices, strict=True):
        assert torch.equal(got, tensors[i])


@settings(max_examples=300)
@given(st.binary(max_size=512))
def test_garbage_header_bytes_fail_with_an_integrity_error(raw: bytes) -> None:
    with pytest.raises(CheckpointIntegrityError):
        decode_header(raw, "x", file_size=1 << 20, header_offset=ALIGN)


@settings(max_examples=300)
@given(st.binary(max_size=256))
def test_garbage_manifest_and_commit_bytes_fail_with_an_integrity_error(raw: bytes) -> None:
    with pytest.raises(CheckpointIntegrityError):
        decode_manifest(raw, "x")
    with pytest.raises(CheckpointIntegrityError):
        decode_commit(raw, "x")


@settings(max_examples=300)
@given(st.binary(max_size=4096))
def test_garbage_tree_bytes_decode_or_fail_with_an_integrity_error(raw: bytes) -> None:
    with contextlib.suppress(CheckpointIntegrityError):
        decode_tree(raw, "x")


@given(st.binary(min_size=40, max_size=64), st.integers(0, 1 << 40))
def test_garbage_preamble_never_points_outside_the_file(raw: bytes, size: int) -> None:
    try:
        version, offset, length, _ = decode_preamble(raw, size, "x")
    except CheckpointIntegrityError:
        return
    assert offset + length == size and offset >= PREAMBLE_SIZE
    assert version == 2 or offset % ALIGN == 0


def test_declared_lengths_larger_than_the_input_are_refused() -> None:
    bomb = b"\xdd\xff\xff\xff\xff"  # array32 declaring 4 billion items, then nothing
    with pytest.raises(CheckpointIntegrityError):
        decode_tree(bomb, "x")


def test_deep_nesting_is_refused_without_crashing() -> None:
    deep = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    with pytest.raises(CheckpointIntegrityError):
        decode_tree(deep, "x")


def _one_tensor_header(record: TensorRecord, storage: StorageRecord) -> bytes:
    return encode_header(ShardHeader(
        step=1, rank=0, world_size=1, save_id="a-1", created_unix=0.0, chunk_bytes=ALIGN,
        data_offset=PREAMBLE_SIZE, data_length=16, storages=(storage,), tensors=(record,),
        checksums=(0,), tree=b"\x80", train_state={}))


_STORAGE = StorageRecord(PREAMBLE_SIZE, 16, "cpu")


@pytest.mark.parametrize(("record", "storage", "message"), [
    (TensorRecord("w", "object", (2,), (1,), 0, 0, "cpu"), _STORAGE, "allow-list"),
    (TensorRecord("w", "float32", (5,), (1,), 0, 0, "cpu"), _STORAGE, "outside its storage"),
    (TensorRecord("w", "float32", (2,), (1,), 0, 12, "cpu"), _STORAGE, "outside its storage"),
    (TensorRecord("w", "float32", (2, 2), (1, 3), 0, 0, "cpu"), _STORAGE,
     "outside its storage"),
    (TensorRecord("w", "float32", (2,), (1,), 0, 2, "cpu"), _STORAGE, "aligned"),
    (TensorRecord("w", "float32", (2,), (1,), 0, 0, "cpu"),
     StorageRecord(PREAMBLE_SIZE + 1, 15, "cpu"), "aligned"),
    (TensorRecord("w", "float32", (2,), (1,), 1, 0, "cpu"), _STORAGE, "storage reference"),
    (TensorRecord("w", "float32", (2,), (1, 1), 0, 0, "cpu"), _STORAGE, "stride"),
    (TensorRecord("w", "float32", (2,), (1,), 0, 0, "cpu"),
     StorageRecord(PREAMBLE_SIZE, 17, "cpu"), "outside the data region"),
    (TensorRecord("w", "float32", (2,), (1,), 0, 0, "cpu"),
     StorageRecord(PREAMBLE_SIZE - 1, 16, "cpu"), "outside the data region"),
])
def test_header_with_an_impossible_tensor_record_is_refused(
        record: TensorRecord, storage: StorageRecord, message: str) -> None:
    header = _one_tensor_header(record, storage)
    with pytest.raises(CheckpointIntegrityError, match=message):
        decode_header(header, "x", file_size=PREAMBLE_SIZE + 16 + len(header),
                      header_offset=PREAMBLE_SIZE + 16)


def test_checksums_must_cover_every_chunk_of_the_data_region() -> None:
    record = TensorRecord("w", "float32", (4,), (1,), 0, 0, "cpu")
    raw = encode_header(ShardHeader(
        step=1, rank=0, world_size=1, save_id="a-1", created_unix=0.0, chunk_bytes=ALIGN,
        data_offset=PREAMBLE_SIZE, data_length=16, storages=(_STORAGE,), tensors=(record,),
        checksums=(0, 0), tree=b"\x80", train_state={}))
    with pytest.raises(CheckpointIntegrityError, match="checksums"):
        decode_header(raw, "x", file_size=PREAMBLE_SIZE + 16 + len(raw),
                      header_offset=PREAMBLE_SIZE + 16)


def _header_with_meshes(meshes: Any) -> bytes:
    """A one-tensor header whose ``meshes`` entry is ``meshes`` (packed as given)."""
    import msgpack

    record = TensorRecord("w", "float32", (4,), (1,), 0, 0, "cpu")
    raw = encode_header(ShardHeader(
        step=1, rank=0, world_size=1, save_id="a-1", created_unix=0.0, chunk_bytes=ALIGN,
        data_offset=PREAMBLE_SIZE, data_length=16, storages=(_STORAGE,), tensors=(record,),
        checksums=(0,), tree=b"\x80", train_state={}))
    data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    if meshes is ...:
        del data["meshes"]  # a writer from before the names were recorded
    else:
        data["meshes"] = meshes
    return msgpack.packb(data, use_bin_type=True)


def _decoded(raw: bytes) -> ShardHeader:
    return decode_header(raw, "x", file_size=PREAMBLE_SIZE + 16 + len(raw),
                         header_offset=PREAMBLE_SIZE + 16)


def test_the_meshes_names_round_trip_and_an_older_header_has_none() -> None:
    meshes = [[[2, 2], ["dp", "tp"]], [[4], None]]
    assert _decoded(_header_with_meshes(meshes)).meshes == (((2, 2), ("dp", "tp")),
                                                            ((4,), None))
    assert _decoded(_header_with_meshes([])).meshes == ()
    assert _decoded(_header_with_meshes(...)).meshes is None


@pytest.mark.parametrize("meshes", [
    "dp", [[[2, 2], ["dp"]]], [[[0], ["dp"]]], [[[2], [""]]], [[[2], [3]]], [[[2]]],
    [[[], []]], [[[2], ["x" * 257]]], [[[1], None]] * 65,
], ids=["not-a-list", "names-short", "zero-size", "empty-name", "name-not-text", "no-names",
        "no-dims", "long-name", "too-many"])
def test_malformed_meshes_are_refused(meshes: Any) -> None:
    with pytest.raises(CheckpointIntegrityError, match="meshes"):
        _decoded(_header_with_meshes(meshes))


@pytest.mark.parametrize(("names", "count"), [
    (("dp", "tp"), 1), (("", "tp"), 1), (("x" * 257, "tp"), 1), (("x" * 256, "tp"), 1),
    (("dp", "tp"), 65),
], ids=["fine", "empty-name", "long-name", "longest-name", "too-many"])
def test_a_save_refuses_the_meshes_a_reader_would_refuse(names: tuple[str, ...],
                                                         count: int) -> None:
    """What the save records of its meshes (``_tree._recordable_mesh``) is refused at save
    exactly where a reader would refuse the header (``decode_meshes``): an acknowledged save
    is always readable."""
    from types import SimpleNamespace

    from ckpt_pipeline._format.header import decode_meshes
    from ckpt_pipeline._tree import _recordable_mesh
    from ckpt_pipeline.errors import StateError

    recorded: set[Any] = set()
    refused = False
    try:
        for i in range(count):
            mesh = SimpleNamespace(shape=(2, i + 1), mesh_dim_names=names)
            recorded.add(_recordable_mesh(mesh, recorded, "model/w", 3))
    except StateError as exc:
        refused = True
        assert exc.step == 3 and exc.path == "model/w"
    raw = [[list(shape), list(n)] for shape, n in recorded]
    raw.append([[2, count + 1], list(names)])  # the one the save refused, or one more
    try:
        decode_meshes(raw[:count], "x")
        readable = True
    except CheckpointIntegrityError:
        readable = False
    assert refused != readable
