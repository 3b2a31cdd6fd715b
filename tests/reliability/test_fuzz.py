"""Fuzzing every decoder of bytes read from disk (hypothesis).

Decoders: the shard preamble (``decode_preamble``), the shard header with its tensor index and
DTensor layouts (``decode_header``), the state tree (``decode_tree``), the TrainState
(``TrainState.from_plain`` and ``decode_contents``, the path restore takes), the manifest
(``decode_manifest``) and the commit record (``decode_commit``); end to end, ``restore_latest``
over a real checkpoint whose header, manifest or commit record was replaced by fuzzed bytes.

The contract checked everywhere: a decoder returns an object that passes the documented checks
(docs/format.md), or raises ``CheckpointIntegrityError`` (``StateError`` for
``TrainState.from_plain``): never another exception, never a hang, never unbounded memory. Valid
encodings round-trip exactly.

Size: ``CKPT_FUZZ_EXAMPLES`` (default 125) is the unit of every property's ``max_examples``; each
property takes a weight of it (``_WEIGHTS``), 17x in all: 2,125 cases by default, of which 126
end to end. ``CKPT_FUZZ_EXAMPLES=2950`` runs 50,150.

The decoder bugs this suite found (a stack overflow from nested tuple extensions, unhashable
dtypes, placements with a trailing newline, unbounded tree depth, msgpack timestamps, RNG
states of the wrong size, unparsable device strings) were fixed; the ``test_fixed_*`` tests
below keep their reproducers.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import ckpt_pipeline as cp
from ckpt_pipeline import CheckpointError, CheckpointIntegrityError, StateError
from ckpt_pipeline._format.documents import (
    CommitRecord,
    Manifest,
    TensorRef,
    decode_commit,
    decode_manifest,
    decode_message,
    decode_tree,
    encode_commit,
    encode_manifest,
    encode_tree,
)
from ckpt_pipeline._format.limits import (
    ALIGN,
    DTYPES,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    MAX_PATH_LEN,
    MAX_SMALL_FILE_BYTES,
)
from ckpt_pipeline._format.shard import (
    PREAMBLE_SIZE,
    DistLayout,
    ShardHeader,
    TensorRecord,
    align_up,
    checksum,
    chunk_count,
    decode_header,
    decode_preamble,
    encode_header,
    encode_preamble,
)
from ckpt_pipeline._restore.scan import StepStatus, decode_contents
from ckpt_pipeline.train_state import RNGState, TrainState

T = TypeVar("T")

EXAMPLES = int(os.environ.get("CKPT_FUZZ_EXAMPLES", "125"))

_WEIGHTS = {
    "preamble": 1.0, "preamble_round_trip": 0.5,
    "header_bytes": 1.0, "header_mutated": 1.5, "header_fields": 2.0, "header_numbers": 1.0,
    "header_round_trip": 1.0,
    "tree": 1.5, "tree_round_trip": 1.0,
    "train_state": 1.5, "train_state_round_trip": 0.5,
    "manifest": 1.0, "commit": 1.0, "small_round_trip": 0.5,
    "bombs": 0.5, "deep": 0.5,
    "e2e_header": 0.4, "e2e_manifest": 0.3, "e2e_commit": 0.3,
}


def fuzz(name: str) -> settings:
    """Settings of one property: its share of CKPT_FUZZ_EXAMPLES, no deadline."""
    return settings(max_examples=max(1, round(EXAMPLES * _WEIGHTS[name])), deadline=None)


SMALL_DECODE_S = 10.0  # no decoder may take this long on these inputs (a hang)
RESTORE_S = 60.0
BOMB_PEAK_BYTES = 4 * 1024 * 1024
SAFE_TUPLE_DEPTH = 32  # deeper tuple-extension nesting crashes the interpreter, see the bug test
U64 = 2**64 - 1


# --------------------------------------------------------------------------- contract helpers


class _Hang(AssertionError):
    """A decoder ran past its time limit."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Fail (in the main thread) when the block runs longer than ``seconds``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise _Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _outcome(call: Callable[[], T], refusal: type[CheckpointError] = CheckpointIntegrityError,
             limit: float = SMALL_DECODE_S) -> T | None:
    """The decoded value, or None when the decoder refused with ``refusal``.

    Any other exception fails the property.
    """
    try:
        with _time_limit(limit):
            value = call()
    except refusal as exc:
        assert exc.message, "a refusal says why"
        event(f"refused: {type(exc).__name__}")
        return None
    event("accepted")
    return value


def _alloc_peak(call: Callable[[], object]) -> int:
    """Peak bytes the Python allocator held while ``call`` ran."""
    tracemalloc.start()
    try:
        call()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


# --------------------------------------------------------------------------- hand-made msgpack


@dataclass(frozen=True)
class Raw:
    """Bytes emitted as they are in the middle of an encoded document."""

    data: bytes


@dataclass(frozen=True)
class Pairs:
    """A map written pair by pair: keys of any type, duplicates allowed."""

    items: tuple[tuple[Any, Any], ...]


def _container_header(n: int, fix: int, b16: int, b32: int) -> bytes:
    if n < 16:
        return bytes([fix | n])
    if n < 2**16:
        return bytes([b16]) + n.to_bytes(2, "big")
    return bytes([b32]) + n.to_bytes(4, "big")


def enc(obj: Any) -> bytes:
    """msgpack of ``obj`` as the library writes it, plus Raw bytes and Pairs maps."""
    if isinstance(obj, Raw):
        return obj.data
    if isinstance(obj, dict):
        obj = Pairs(tuple(obj.items()))
    if isinstance(obj, Pairs):
        return _container_header(len(obj.items), 0x80, 0xDE, 0xDF) + b"".join(
            enc(k) + enc(v) for k, v in obj.items)
    if isinstance(obj, list):
        return _container_header(len(obj), 0x90, 0xDC, 0xDD) + b"".join(enc(v) for v in obj)
    if isinstance(obj, msgpack.ExtType):  # a namedtuple: before the tuple case
        return bytes(msgpack.packb(obj))
    if isinstance(obj, tuple):
        return bytes(msgpack.packb(msgpack.ExtType(2, enc(list(obj)))))
    if isinstance(obj, TensorRef):
        return bytes(msgpack.packb(msgpack.ExtType(1, struct.pack("<Q", obj.index))))
    return bytes(msgpack.packb(obj, use_bin_type=True))


def _plain_of(raw: bytes) -> Any:
    """A valid encoding decoded to plain values, extensions kept as ExtType (re-encodable)."""
    return msgpack.unpackb(raw, raw=False, strict_map_key=False,
                           ext_hook=lambda code, data: msgpack.ExtType(code, data))


def _ext(code: int, payload: bytes) -> Raw:
    """An extension of any code (msgpack.ExtType refuses the reserved negative ones)."""
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    n = len(payload)
    head = bytes([fixed[n]]) if n in fixed else b"\xc7" + bytes([n])
    return Raw(head + struct.pack("b", code) + payload)


def _bomb(marker: int, length: int) -> bytes:
    """A msgpack header declaring ``length`` items or bytes (the payload is not there)."""
    width = {0xDD: 4, 0xDF: 4, 0xDB: 4, 0xC6: 4, 0xC9: 4,
             0xDC: 2, 0xDE: 2, 0xDA: 2, 0xC5: 2, 0xC8: 2}[marker]
    out = bytes([marker]) + min(length, (1 << (8 * width)) - 1).to_bytes(width, "big")
    return out + (b"\x02" if marker in (0xC9, 0xC8) else b"")


def _nested_tuples(depth: int, leaf: bytes = b"\xc0") -> bytes:
    """``depth`` tuple extensions, each holding a one-element array of the next."""
    inner = leaf
    for _ in range(depth):
        inner = bytes(msgpack.packb(msgpack.ExtType(2, b"\x91" + inner)))
    return inner


# --------------------------------------------------------------------------- strategies

ODD_NAMES = (
    "", ".", "..", "../", "../../etc/passwd", "a/../../b", "/", "/abs/path", "//x", "C:\\x",
    "\x00", "a\x00b", "nul\x00/../x", "\n", "R\n", "S0\n", "\t", " ", "\u202eevil", "e\u0301",
    "\ufeff", "\u200b", "\uffff", "\U0001f600", "\U0010ffff", "\uff21", "\u0130", "ß", "\u2028",
    "x" * 64, "x" * 65, "x" * 128, "x" * 129, "y" * MAX_PATH_LEN, "y" * (MAX_PATH_LEN + 1),
    "cpu", "cuda:0", "cuda:x", "meta", "format", "kind",
)
names = st.sampled_from(ODD_NAMES) | st.text(max_size=12)


def _names_up_to(n: int, *, nonempty: bool = False) -> st.SearchStrategy[str]:
    """Names of at most ``n`` characters (picked without filtering, which is slow)."""
    pool = [s for s in ODD_NAMES if len(s) <= n and (s or not nonempty)]
    return st.sampled_from(pool) | st.text(min_size=int(nonempty), max_size=min(n, 12))


device_names = st.from_regex(r"[a-z]{2,16}(:[0-9]{1,4})?", fullmatch=True)  # str(torch.device)
path_names = _names_up_to(MAX_PATH_LEN)
save_ids = _names_up_to(128, nonempty=True)

INTERESTING_INTS = (0, 1, 2, -1, -2, 7, 4095, 4096, 4097, 8192, 2**31 - 1, 2**31, 2**32 - 1,
                    2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, U64, -(2**63), -(2**31),
                    MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1)
ints = st.sampled_from(INTERESTING_INTS) | st.integers(-(2**63), U64)

BOMB_MARKERS = (0xDD, 0xDF, 0xDB, 0xC6, 0xC9, 0xDC, 0xDE, 0xDA, 0xC5, 0xC8)
bomb_headers = st.builds(_bomb, st.sampled_from(BOMB_MARKERS),
                         st.sampled_from([2**32 - 1, 2**31, 2**16 - 1, 2**20]))

raw_junk = st.sampled_from([
    Raw(b"\xa3\xed\xa0\x80"),  # str holding an encoded surrogate: not UTF-8
    Raw(b"\xa2\xff\xfe"),  # str of invalid UTF-8
    Raw(b"\xc1"),  # the never-used msgpack byte
    Raw(b""),  # a missing value: shifts the rest of the document
    Raw(b"\xd4\x01\x00"),  # tensor reference with a 1-byte payload
    Raw(b"\xd5\x02\x00\x00"),  # tuple extension holding no array
    Raw(b"\xd6\xff\xff\xff\xff\xff"),  # timestamp of 4 bytes
    Raw(b"\xd8\xff" + b"\xff" * 16),  # timestamp of 16 bytes
    Raw(_nested_tuples(SAFE_TUPLE_DEPTH)),
]) | st.builds(Raw, bomb_headers)

hostile_leaf = st.one_of(
    st.none(), st.booleans(), ints, st.floats(), names, st.binary(max_size=16),
    st.builds(TensorRef, st.integers(0, U64)),
    st.builds(_ext, st.integers(-128, 127), st.binary(max_size=12)),
    raw_junk,
)
odd_keys = names | ints | st.sampled_from([None, True, 1.5, b"k", (1,)])
hostile_keys = odd_keys | st.just(Raw(b"\xc1"))
hostile = st.recursive(
    hostile_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(names | ints, inner, max_size=3)
    | st.lists(st.tuples(hostile_keys, inner), max_size=3).map(lambda kv: Pairs(tuple(kv))),
    max_leaves=8,
)

plain_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), U64), st.floats(allow_nan=False), names,
    st.binary(max_size=12),
)
plain = st.recursive(
    plain_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(names | st.integers(-(2**63), U64), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    """A valid encoding with 1 to 4 mutations: bit flips, overwrites, truncation, extension,
    insertion, deletion, a length bomb spliced in, a slice duplicated."""
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "flip", "byte", "truncate", "extend", "insert",
                                   "delete", "bomb", "dup")))
        n = len(data)
        at = draw(st.integers(0, max(n - 1, 0)))
        if op == "flip" and n:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and n:
            data[at] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[at:]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=16))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and n:
            del data[at:at + draw(st.integers(1, 16))]
        elif op == "bomb":
            data[at:at] = draw(bomb_headers)
        elif op == "dup" and n:
            data[at:at] = data[at:at + draw(st.integers(1, 32))]
    return bytes(data)


@st.composite
def dist_layouts(draw: st.DrawFn, ndim: int) -> DistLayout:
    mesh = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))
    choices = ["R"] + [f"S{d}" for d in range(min(ndim, 100))]
    placements = [draw(st.sampled_from(choices)) for _ in mesh]
    gshape = draw(st.lists(st.integers(0, U64), min_size=ndim, max_size=ndim))
    gstride = draw(st.lists(st.integers(0, U64), min_size=ndim, max_size=ndim))
    return DistLayout(tuple(mesh), tuple(placements), tuple(gshape), tuple(gstride))


@st.composite
def shard_headers(draw: st.DrawFn) -> ShardHeader:
    """A valid shard header: consistent records, hostile-but-legal names and values."""
    chunk = draw(st.sampled_from([ALIGN, 2 * ALIGN, 16 * ALIGN]))
    world = draw(st.integers(1, 8) | st.integers(1, U64))
    cursor = PREAMBLE_SIZE
    records: list[TensorRecord] = []
    for _ in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 6), max_size=4))
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        offset = align_up(cursor) + ALIGN * draw(st.integers(0, 2))
        cursor = offset + nbytes
        sums = draw(st.lists(st.integers(0, U64), min_size=chunk_count(nbytes, chunk),
                             max_size=chunk_count(nbytes, chunk)))
        dist = draw(st.none() | dist_layouts(len(shape)))
        records.append(TensorRecord(draw(path_names), dtype, tuple(shape), offset, nbytes,
                                    tuple(sums), draw(device_names), dist))
    return ShardHeader(
        step=draw(st.integers(0, U64)), rank=draw(st.integers(0, world - 1)), world_size=world,
        save_id=draw(save_ids),
        created_unix=draw(st.floats(allow_nan=False, allow_infinity=False)), chunk_bytes=chunk,
        data_offset=PREAMBLE_SIZE, data_length=cursor - PREAMBLE_SIZE, tensors=tuple(records),
        tree=draw(st.binary(max_size=32)),
        train_state=draw(st.dictionaries(st.one_of(names, st.integers(0, 9)), plain,
                                         max_size=3)),
    )


def _geometry(h: ShardHeader, raw: bytes) -> tuple[int, int]:
    """(file size, header offset) of a shard holding this header."""
    offset = align_up(h.data_offset + h.data_length)
    return offset + len(raw), offset


HEADER_KEYS = ("format", "kind", "step", "rank", "world_size", "save_id", "created_unix",
               "chunk_bytes", "data_offset", "data_length", "tensors", "tree", "train_state")
PLACEMENTS = ("R", "S0", "S1", "S9", "S99", "S100", "S-1", "s0", "r", "", "S", "RR", "S00",
              "S 0", " S0", "\uff330", "S\u0660", "S0\x00", "S0\n", "R\n")


@st.composite
def hostile_map(draw: st.DrawFn, base: dict[Any, Any], keys: tuple[str, ...]) -> Any:
    """``base`` (a decoded map) with one or two hostile edits: a field replaced by a value of
    the wrong type, removed, duplicated, an unknown or odd key added, or the whole replaced."""
    doc: Any = dict(base)
    for _ in range(draw(st.integers(1, 2))):
        if not isinstance(doc, dict):
            break
        op = draw(st.sampled_from(("replace", "replace", "replace", "delete", "unknown",
                                   "duplicate", "whole", "format")))
        key = draw(st.sampled_from(keys))
        if op == "replace":
            doc[key] = draw(hostile)
        elif op == "delete":
            doc.pop(key, None)
        elif op == "unknown":
            doc[draw(names | ints)] = draw(hostile)
        elif op == "duplicate":
            return Pairs((*doc.items(), (key, draw(hostile | st.just(doc.get(key))))))
        elif op == "format":
            doc["format"] = draw(st.sampled_from([0, 2, 1.0, True, "1", None, [1], -1, U64]))
            doc["kind"] = draw(st.sampled_from(["shard", "manifest", "commit", "SHARD", ""]))
        else:
            return draw(hostile)
    if isinstance(doc, dict) and draw(st.booleans()) and len(doc) > 1:
        items = list(doc.items())
        draw(st.randoms(use_true_random=False)).shuffle(items)  # field order must not matter
        return Pairs(tuple(items))
    return doc


@st.composite
def hostile_header_doc(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    """A decoded shard header with hostile edits, also inside the tensor index and layouts."""
    tensors = base.get("tensors")
    where = draw(st.sampled_from(("top", "top", "record", "record", "dist", "tensors")))
    if where == "top" or not isinstance(tensors, list) or not tensors:
        return draw(hostile_map(base, HEADER_KEYS))
    doc = dict(base)
    records: list[Any] = [list(r) for r in tensors]
    i = draw(st.integers(0, len(records) - 1))
    if where == "record":
        slot = draw(st.integers(0, 7))
        value: Any = draw(hostile | st.sampled_from([
            "object", "float", "torch.float32", "float32\x00", "int4", "complex32", "qint8",
            "uint1", "", "FLOAT32", "bfloat16 "]) if slot == 1 else hostile)
        if draw(st.integers(0, 9)) == 0:
            records[i] = draw(hostile)  # the record itself
        elif draw(st.integers(0, 9)) == 0:
            records[i] = [*records[i], value]  # one field too many
        else:
            records[i][slot] = value
    elif where == "dist":
        ndim = len(records[i][2]) if isinstance(records[i][2], list) else 0
        layout: Any = [[1], ["R"], [0] * ndim, [1] * ndim]
        part = draw(st.integers(0, 4))
        if part == 4:
            layout = draw(hostile)
        elif part == 1:
            layout[1] = draw(st.lists(st.sampled_from(PLACEMENTS) | hostile, max_size=3))
            layout[0] = [1] * (len(layout[1]) if draw(st.booleans()) else 1)
        else:
            layout[part] = draw(hostile | st.lists(ints, max_size=MAX_NDIM + 2))
        records[i][7] = layout
    else:
        records = draw(st.sampled_from([records * 2, records[:i], [records[i]] * 65,
                                        [*records, draw(hostile)]]))
    doc["tensors"] = records
    return doc


@st.composite
def hostile_record_numbers(draw: st.DrawFn) -> tuple[Any, Any, Any, Any]:
    """(dtype, shape, offset, length) aimed at overflow and bounds arithmetic."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    item = DTYPES[dtype].itemsize
    shape = draw(st.one_of(
        st.just([2**32, 2**32]), st.just([2**63, 2]), st.just([U64] * MAX_NDIM),
        st.just([1] * (MAX_NDIM + 1)), st.just([1] * MAX_NDIM), st.just([-1, -8]),
        st.just([0, U64]), st.just([2**62, 4]),
        st.lists(st.sampled_from(INTERESTING_INTS), max_size=4),
    ))
    exact = math.prod(shape) * item
    length = draw(st.sampled_from([n for n in (exact % 2**64, exact, exact + 1, 0, 8, U64, -8)
                                   if -(2**63) <= n <= U64]))
    offset = draw(st.sampled_from([ALIGN, 2 * ALIGN, 0, ALIGN - 1, ALIGN + 1, -ALIGN,
                                   2**64 - ALIGN, 2**63, 100 * ALIGN]))
    return dtype, shape, offset, length


# --------------------------------------------------------------------------- checks of results


def _assert_tree_valid(tree: Any, tensor_count: int | None) -> None:
    """Top level a map of names; keys str or int; references inside the index (iterative)."""
    assert isinstance(tree, dict)
    assert all(isinstance(k, str) for k in tree)
    stack: list[Any] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            assert all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in node)
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, TensorRef) and tensor_count is not None:
            assert 0 <= node.index < tensor_count


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _assert_header_valid(h: ShardHeader, file_size: int, header_offset: int) -> None:
    assert isinstance(h, ShardHeader)
    for value in (h.step, h.rank, h.world_size, h.chunk_bytes, h.data_offset, h.data_length):
        assert _is_int(value) and value >= 0
    assert 0 <= h.rank < h.world_size
    assert isinstance(h.save_id, str) and 0 < len(h.save_id) <= 128
    assert isinstance(h.created_unix, float)
    assert h.chunk_bytes >= ALIGN and h.chunk_bytes % ALIGN == 0
    assert h.data_offset == PREAMBLE_SIZE
    assert h.header_offset == header_offset <= file_size
    assert isinstance(h.tree, bytes) and isinstance(h.train_state, dict)
    end = h.data_offset + h.data_length
    for r in h.tensors:
        assert isinstance(r.path, str) and len(r.path) <= MAX_PATH_LEN
        assert r.dtype in DTYPES
        assert len(r.shape) <= MAX_NDIM and all(_is_int(d) and d >= 0 for d in r.shape)
        assert math.prod(r.shape) * DTYPES[r.dtype].itemsize == r.nbytes
        assert _is_int(r.offset) and _is_int(r.nbytes)
        assert r.offset % ALIGN == 0 and h.data_offset <= r.offset <= r.offset + r.nbytes <= end
        assert len(r.checksums) == chunk_count(r.nbytes, h.chunk_bytes)
        assert all(_is_int(s) and 0 <= s <= U64 for s in r.checksums)
        assert isinstance(r.device, str) and re.fullmatch(r"[a-z]{2,16}(:[0-9]{1,4})?", r.device)
        if r.dist is not None:
            d = r.dist
            assert d.mesh_shape and all(_is_int(m) and m > 0 for m in d.mesh_shape)
            assert len(d.placements) == len(d.mesh_shape)
            assert all(p == "R" or (p[0] == "S" and int(p[1:]) < len(r.shape))
                       for p in d.placements)
            assert len(d.global_shape) == len(d.global_stride) == len(r.shape)


def _assert_train_state_valid(ts: TrainState) -> None:
    assert isinstance(ts, TrainState)
    for value in (ts.step, ts.consumed_train_samples, ts.skipped_train_samples):
        assert _is_int(value) and value >= 0
    flops = ts.floating_point_operations_so_far
    assert isinstance(flops, (int, float)) and not isinstance(flops, bool)
    assert not flops < 0
    assert all(isinstance(k, str) for k in ts.extra)
    rng = ts.rng
    if rng is not None:
        assert rng.python is None or (len(rng.python) == 3
                                      and all(isinstance(x, int) for x in rng.python[1]))
        assert rng.numpy is None or (len(rng.numpy) == 5 and isinstance(rng.numpy[1], bytes))
        assert rng.torch_cpu is None or isinstance(rng.torch_cpu, bytes)
        assert rng.torch_cuda is None or all(isinstance(b, bytes) for b in rng.torch_cuda)


def _assert_placement_valid(rec: Manifest | CommitRecord) -> None:
    for value in (rec.step, rec.rank, rec.world_size):
        assert _is_int(value) and value >= 0
    assert rec.rank < rec.world_size
    assert isinstance(rec.save_id, str) and 0 < len(rec.save_id) <= 128


def _assert_manifest_valid(m: Manifest) -> None:
    assert isinstance(m, Manifest)
    _assert_placement_valid(m)
    for value in (m.shard_size, m.header_checksum, m.data_bytes):
        assert _is_int(value) and value >= 0


def _assert_commit_valid(c: CommitRecord) -> None:
    assert isinstance(c, CommitRecord)
    _assert_placement_valid(c)
    assert isinstance(c.committed_unix, float)


# --------------------------------------------------------------------------- preamble

_PRE = struct.Struct("<8sHHIQQQ")


@st.composite
def preamble_inputs(draw: st.DrawFn) -> tuple[bytes, int]:
    """(raw bytes, file size): random, crafted field by field, or a valid one mutated."""
    offset = ALIGN * draw(st.integers(1, 2**20))
    length = draw(st.integers(1, 4096))
    kind = draw(st.sampled_from(("random", "crafted", "mutated")))
    if kind == "random":
        raw = draw(st.binary(max_size=64) | st.binary(max_size=48).map(b"CKPTSHRD".__add__))
    elif kind == "crafted":
        u64 = st.sampled_from([0, ALIGN, offset, offset + 1, length, MAX_HEADER_BYTES,
                               MAX_HEADER_BYTES + 1, 2**63, U64, U64 - ALIGN + 1])
        raw = _PRE.pack(draw(st.sampled_from([b"CKPTSHRD", b"CKPTSHRE", b"ckptshrd",
                                              b"\x00" * 8])),
                        draw(st.sampled_from([0, 1, 2, 0xFFFF])), draw(st.integers(0, 0xFFFF)),
                        draw(st.integers(0, 2**32 - 1)), draw(u64), draw(u64),
                        draw(st.integers(0, U64)))
        raw += draw(st.binary(max_size=8))
    else:
        raw = draw(mutated(st.just(encode_preamble(offset, bytes(length))[:64])))
    size = draw(st.sampled_from([offset + length, offset + length + 1, offset, 0, 2**64,
                                 2**64 + ALIGN]) | st.integers(0, 2**66))
    return raw, size


@fuzz("preamble")
@given(preamble_inputs())
def test_fuzzed_preamble_never_points_outside_the_file(case: tuple[bytes, int]) -> None:
    raw, size = case
    got = _outcome(lambda: decode_preamble(raw, size, "x"))
    if got is not None:
        offset, length, digest = got
        assert offset >= PREAMBLE_SIZE and offset % ALIGN == 0
        assert 0 < length <= MAX_HEADER_BYTES and offset + length == size
        assert 0 <= digest <= U64
        assert raw[:8] == b"CKPTSHRD" and raw[8:10] == b"\x01\x00"


@fuzz("preamble_round_trip")
@given(st.integers(1, 2**40), st.binary(min_size=1, max_size=256))
def test_valid_preamble_round_trips(blocks: int, header: bytes) -> None:
    offset = blocks * ALIGN
    raw = encode_preamble(offset, header)
    assert len(raw) == PREAMBLE_SIZE
    assert decode_preamble(raw, offset + len(header), "x") == (offset, len(header),
                                                                checksum(header))


# --------------------------------------------------------------------------- shard header


def _decode_header_checked(raw: bytes, file_size: int, header_offset: int) -> None:
    h = _outcome(lambda: decode_header(raw, "x", file_size=file_size,
                                       header_offset=header_offset))
    if h is not None:
        _assert_header_valid(h, file_size, header_offset)


@fuzz("header_bytes")
@given(st.binary(max_size=1024) | hostile.map(enc),
       st.sampled_from([ALIGN, 2 * ALIGN]) | st.integers(0, U64),
       st.integers(0, 2**65))
def test_random_bytes_as_shard_header(raw: bytes, header_offset: int, file_size: int) -> None:
    _decode_header_checked(raw, file_size, header_offset)


@fuzz("header_mutated")
@given(st.data())
def test_mutated_valid_shard_header(data: st.DataObject) -> None:
    h = data.draw(shard_headers())
    raw = data.draw(mutated(st.just(encode_header(h))))
    size, offset = _geometry(h, raw)
    _decode_header_checked(raw, size, offset)


@fuzz("header_fields")
@given(st.data())
def test_shard_header_with_hostile_fields(data: st.DataObject) -> None:
    h = data.draw(shard_headers())
    doc = data.draw(hostile_header_doc(_plain_of(encode_header(h))))
    raw = enc(doc)
    size, offset = _geometry(h, raw)
    _decode_header_checked(raw, size, offset)


@fuzz("header_numbers")
@given(hostile_record_numbers(), st.integers(0, 3), st.sampled_from([ALIGN, 8 * ALIGN]),
       st.sampled_from([0, 8, ALIGN, 2**40, U64]))
def test_tensor_records_with_overflowing_or_outside_numbers(
        numbers: tuple[Any, Any, Any, Any], extra_blocks: int, chunk: int,
        data_length: int) -> None:
    dtype, shape, offset, length = numbers
    count = chunk_count(length, chunk) if length >= 0 else 1
    sums = [0] * (count if count <= 1024 else 1)
    doc = {"format": 1, "kind": "shard", "step": 1, "rank": 0, "world_size": 1,
           "save_id": "s-1", "created_unix": 0.0, "chunk_bytes": chunk,
           "data_offset": PREAMBLE_SIZE, "data_length": data_length,
           "tensors": [["t", dtype, shape, offset, length, sums, "cpu", None]],
           "tree": b"\x80", "train_state": {}}
    raw = enc(doc)
    header_offset = align_up(PREAMBLE_SIZE + data_length) + ALIGN * (extra_blocks == 3)
    _decode_header_checked(raw, header_offset + len(raw) + ALIGN * extra_blocks, header_offset)


@fuzz("header_round_trip")
@given(shard_headers())
def test_valid_shard_header_round_trips(h: ShardHeader) -> None:
    raw = encode_header(h)
    size, offset = _geometry(h, raw)
    back = decode_header(raw, "x", file_size=size, header_offset=offset)
    assert back == h
    _assert_header_valid(back, size, offset)


# --------------------------------------------------------------------------- state tree

tree_keys = names | st.integers(-(2**63), U64)


@functools.cache
def trees(tensor_count: int) -> st.SearchStrategy[dict[str, Any]]:
    """Valid state trees: plain leaves, lists, tuples, maps and tensor references."""
    leaf = plain_leaf | (st.builds(TensorRef, st.integers(0, tensor_count - 1))
                         if tensor_count else st.none())
    node = st.recursive(
        leaf,
        lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(tree_keys, inner, max_size=4),
        max_leaves=10,
    )
    return st.dictionaries(names, node, max_size=4)


@st.composite
def tree_inputs(draw: st.DrawFn) -> tuple[bytes, int | None]:
    count = draw(st.integers(0, 5))
    kind = draw(st.sampled_from(("random", "hostile", "mutated", "refs", "tuples")))
    if kind == "random":
        raw = draw(st.binary(max_size=512))
    elif kind == "hostile":
        raw = enc(draw(hostile | st.dictionaries(hostile_keys, hostile, max_size=4)
                       .map(lambda d: Pairs(tuple(d.items())))))
    elif kind == "mutated":
        raw = draw(mutated(trees(count).map(encode_tree)))
    elif kind == "refs":  # references at and beyond the end of the index
        index = draw(st.sampled_from([count, count + 1, 2**63, U64]) | st.integers(0, U64))
        raw = enc({draw(names): [TensorRef(index)]})
    else:  # tuple extensions nested and holding odd payloads
        payload = draw(st.sampled_from([b"\x80", b"\xc0", b"\x90", b"\x92\xc0", b"\x91\x91\xc0",
                                        b"\x91", b"", b"\x91\xd4\x01\x00"]))
        depth = draw(st.integers(1, SAFE_TUPLE_DEPTH))
        raw = b"\x81\xa1t" + _nested_tuples(depth, payload)
    return raw, draw(st.none() | st.just(count))


@fuzz("tree")
@given(tree_inputs())
def test_fuzzed_state_tree(case: tuple[bytes, int | None]) -> None:
    raw, count = case
    tree = _outcome(lambda: decode_tree(raw, "x", count))
    if tree is not None:
        _assert_tree_valid(tree, count)


@fuzz("tree_round_trip")
@given(st.data())
def test_valid_state_tree_round_trips(data: st.DataObject) -> None:
    count = data.draw(st.integers(0, 5))
    tree = data.draw(trees(count))
    back = decode_tree(encode_tree(tree), "x", count)
    assert back == tree
    _assert_tree_valid(back, count)


# --------------------------------------------------------------------------- TrainState


@st.composite
def rng_states(draw: st.DrawFn) -> RNGState:
    """Valid generator states (from seeded generators), each present or not."""
    import numpy as np

    seed = draw(st.integers(0, 2**32 - 1))
    python = None
    if draw(st.booleans()):
        version, internal, _ = random.Random(seed).getstate()
        gauss = draw(st.none() | st.floats(allow_nan=False, allow_infinity=False))
        python = (version, internal, gauss)
    numpy = None
    if draw(st.booleans()):
        name, keys, pos, has_gauss, cached = np.random.RandomState(seed).get_state(legacy=True)
        numpy = (str(name), np.asarray(keys, dtype=np.uint32).tobytes(), int(pos),
                 int(has_gauss), float(cached))
    cpu = None
    if draw(st.booleans()):
        cpu = bytes(torch.Generator().manual_seed(seed).get_state().numpy().tobytes())
    cuda = draw(st.none() | st.lists(  # Philox: seed and an offset that is a multiple of 4
        st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**40))
        .map(lambda so: struct.pack("<Qq", so[0], 4 * so[1])), max_size=2).map(tuple))
    return RNGState(python=python, numpy=numpy, torch_cpu=cpu, torch_cuda=cuda)


train_states = st.builds(
    TrainState,
    step=st.integers(0, U64), consumed_train_samples=st.integers(0, U64),
    skipped_train_samples=st.integers(0, U64),
    floating_point_operations_so_far=(st.integers(0, U64)
                                      | st.floats(0, allow_nan=False, allow_infinity=False)),
    extra=st.dictionaries(names, plain, max_size=3), rng=st.none() | rng_states(),
)
TRAIN_STATE_KEYS = ("step", "consumed_train_samples", "skipped_train_samples",
                    "floating_point_operations_so_far", "extra", "rng")
RNG_KEYS = ("python", "numpy", "torch_cpu", "torch_cuda")


@st.composite
def hostile_train_state_doc(draw: st.DrawFn) -> Any:
    base = _plain_of(enc(draw(train_states).to_plain()))
    where = draw(st.sampled_from(("top", "top", "rng", "rng_inner", "extra")))
    if where == "top":
        return draw(hostile_map(base, TRAIN_STATE_KEYS))
    doc = dict(base)
    rng: dict[Any, Any] = doc["rng"] if isinstance(doc.get("rng"), dict) else _plain_of(
        enc(RNGState(python=(3, (1, 2), None), numpy=("MT19937", b"k", 0, 0, 0.0),
                     torch_cpu=b"", torch_cuda=(b"",)).to_plain()))
    if where == "rng":
        doc["rng"] = draw(hostile_map(rng, RNG_KEYS))
    elif where == "rng_inner":
        field = draw(st.sampled_from(RNG_KEYS))
        value = rng.get(field)
        if isinstance(value, list) and value:
            value = list(value)
            value[draw(st.integers(0, len(value) - 1))] = draw(hostile)
        else:
            value = draw(hostile)
        doc["rng"] = {**rng, field: value}
    else:
        doc["extra"] = draw(st.dictionaries(odd_keys,
                                            hostile, max_size=3))
    return doc


def _status(header: ShardHeader) -> StepStatus:
    return StepStatus(header.step, "step-x", "x", complete=True, valid=True, reason=None,
                      header=header)


def _header_around(train_state: Any, tree: bytes = b"\x80", step: int = 0) -> ShardHeader:
    return ShardHeader(step=step, rank=0, world_size=1, save_id="s-1", created_unix=0.0,
                       chunk_bytes=ALIGN, data_offset=PREAMBLE_SIZE, data_length=0, tensors=(),
                       tree=tree, train_state=train_state)


@fuzz("train_state")
@given(hostile_train_state_doc(), st.binary(max_size=64) | trees(0).map(encode_tree))
def test_fuzzed_train_state(doc: Any, tree: bytes) -> None:
    decoded = _outcome(lambda: decode_message(enc({"ts": doc}), "train state"))
    if decoded is None:
        return
    plain_ts = decoded["ts"]
    ts = _outcome(lambda: TrainState.from_plain(plain_ts), refusal=StateError)
    if ts is not None:
        _assert_train_state_valid(ts)
    # the path restore takes: the header's train_state map and tree, decoded and checked
    step = ts.step if ts is not None else 0
    contents = _outcome(lambda: decode_contents(_status(_header_around(plain_ts, tree, step)),
                                                0))
    if contents is not None:
        _assert_tree_valid(contents[0], 0)
        _assert_train_state_valid(contents[1])
        assert ts is not None and enc(contents[1].to_plain()) == enc(ts.to_plain())


@fuzz("train_state_round_trip")
@given(train_states, trees(0))
def test_valid_train_state_round_trips_through_a_header(ts: TrainState,
                                                        tree: dict[str, Any]) -> None:
    h = _header_around(ts.to_plain(), encode_tree(tree), ts.step)
    raw = encode_header(h)
    size, offset = _geometry(h, raw)
    back = decode_header(raw, "x", file_size=size, header_offset=offset)
    got_tree, got_ts = decode_contents(_status(back), 0)
    assert got_ts == ts and got_tree == tree


def test_captured_rng_state_round_trips() -> None:
    ts = TrainState(step=3, extra={"k": [1, (2, b"x")]}).with_rng(RNGState.capture())
    h = _header_around(ts.to_plain(), step=3)
    raw = encode_header(h)
    size, offset = _geometry(h, raw)
    _, back = decode_contents(_status(decode_header(raw, "x", file_size=size,
                                                    header_offset=offset)), 0)
    assert back == ts


# --------------------------------------------------------------------------- manifest, commit

placements_of_a_rank = st.integers(1, U64).flatmap(
    lambda world: st.tuples(st.integers(0, U64), st.integers(0, world - 1), st.just(world),
                            save_ids))
manifests = placements_of_a_rank.flatmap(lambda p: st.builds(
    Manifest, st.just(p[0]), st.just(p[1]), st.just(p[2]), st.just(p[3]), st.integers(0, U64),
    st.integers(0, U64), st.integers(0, U64)))
commits = placements_of_a_rank.flatmap(lambda p: st.builds(
    CommitRecord, st.just(p[0]), st.just(p[1]), st.just(p[2]), st.just(p[3]),
    st.floats(allow_nan=False)))
MANIFEST_KEYS = ("format", "kind", "step", "rank", "world_size", "save_id", "shard_size",
                 "header_checksum", "data_bytes")
COMMIT_KEYS = ("format", "kind", "step", "rank", "world_size", "save_id", "committed_unix")


def small_file_inputs(valid: st.SearchStrategy[bytes], keys: tuple[str, ...]
                      ) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=256),
        hostile.map(enc),
        mutated(valid),
        valid.flatmap(lambda raw: hostile_map(_plain_of(raw), keys)).map(enc),
    )


@fuzz("manifest")
@given(small_file_inputs(manifests.map(encode_manifest), MANIFEST_KEYS))
def test_fuzzed_manifest(raw: bytes) -> None:
    m = _outcome(lambda: decode_manifest(raw, "x"))
    if m is not None:
        _assert_manifest_valid(m)


@fuzz("commit")
@given(small_file_inputs(commits.map(encode_commit), COMMIT_KEYS))
def test_fuzzed_commit_record(raw: bytes) -> None:
    c = _outcome(lambda: decode_commit(raw, "x"))
    if c is not None:
        _assert_commit_valid(c)


@fuzz("small_round_trip")
@given(manifests, commits)
def test_valid_manifest_and_commit_record_round_trip(m: Manifest, c: CommitRecord) -> None:
    assert decode_manifest(encode_manifest(m), "x") == m
    assert decode_commit(encode_commit(c), "x") == c


@pytest.mark.parametrize("decode", [decode_manifest, decode_commit])
def test_small_files_over_the_limit_are_refused_before_decoding(
        decode: Callable[[bytes, str], object]) -> None:
    raw = b"\x80" + bytes(MAX_SMALL_FILE_BYTES)
    with pytest.raises(CheckpointIntegrityError, match="too large"):
        decode(raw, "x")


# --------------------------------------------------------------------------- bombs, nesting

BYTE_DECODERS: dict[str, Callable[[bytes], object]] = {
    "tree": lambda raw: decode_tree(raw, "x"),
    "tree_indexed": lambda raw: decode_tree(raw, "x", 4),
    "header": lambda raw: decode_header(raw, "x", file_size=2**40, header_offset=ALIGN),
    "manifest": lambda raw: decode_manifest(raw, "x"),
    "commit": lambda raw: decode_commit(raw, "x"),
    "message": lambda raw: decode_message(raw, "message"),
}


@st.composite
def bomb_documents(draw: st.DrawFn) -> bytes:
    """A length bomb (2**16-1 .. 2**32-1 declared, a few bytes there) inside 0-3 containers."""
    inner = draw(bomb_headers) + draw(st.binary(max_size=16))
    for wrapper in draw(st.lists(st.sampled_from(("array", "map", "tuple", "ref")), max_size=3)):
        if wrapper == "array":
            inner = b"\x92\xc0" + inner
        elif wrapper == "map":
            inner = b"\x82\xa1a\xc0\xa1b" + inner
        elif wrapper == "tuple":
            inner = bytes(msgpack.packb(msgpack.ExtType(2, b"\x91" + inner)))
        else:
            inner = b"\x92\xd7\x01" + bytes(8) + inner
    return draw(st.sampled_from([b"", b"\x81\xa4tree", b"\x81\xa6format"])) + inner


def _decode_into(out: list[object], decode: Callable[[bytes], object], raw: bytes) -> None:
    out.append(_outcome(functools.partial(decode, raw)))


@fuzz("bombs")
@given(bomb_documents())
def test_length_bombs_are_refused_in_bounded_memory(raw: bytes) -> None:
    for name, decode in BYTE_DECODERS.items():
        result: list[object] = []
        peak = _alloc_peak(functools.partial(_decode_into, result, decode, raw))
        assert result == [None], f"{name} accepted a length bomb"
        assert peak < BOMB_PEAK_BYTES, f"{name}: {peak} bytes for a {len(raw)}-byte input"


@pytest.mark.parametrize("marker", [0xDD, 0xDF, 0xDB, 0xC6, 0xC9])
@pytest.mark.parametrize("name", sorted(BYTE_DECODERS))
def test_declared_length_of_four_billion_is_refused_in_bounded_memory(marker: int,
                                                                      name: str) -> None:
    decode = BYTE_DECODERS[name]
    for raw in (_bomb(marker, 2**32 - 1), b"\x81\xa4tree" + _bomb(marker, 2**32 - 1) + b"x",
                b"\x91" * 100 + _bomb(marker, 2**32 - 1)):
        def run(raw: bytes = raw) -> None:
            with pytest.raises(CheckpointIntegrityError):
                decode(raw)
        assert _alloc_peak(run) < BOMB_PEAK_BYTES


@st.composite
def deep_documents(draw: st.DrawFn) -> bytes:
    """Arrays, maps and tuples nested up to thousands deep (tuples: SAFE_TUPLE_DEPTH)."""
    depth = draw(st.integers(1, 5000) | st.sampled_from([1022, 1023, 1024, 1025, 2000, 5000]))
    levels = {"array": b"\x91", "array16": b"\xdc\x00\x01", "map": b"\x81\xa1k",
              "intmap": b"\x81\x01", "array2": b"\x92\xc0"}
    pattern = draw(st.lists(st.sampled_from(sorted(levels)), min_size=1, max_size=4))
    leaf = draw(st.sampled_from([b"\xc0", b"\x80", b"\xd7\x01" + bytes(8), b"\xc1", b"",
                                 _nested_tuples(SAFE_TUPLE_DEPTH)]))
    body = b"".join(levels[pattern[i % len(pattern)]] for i in range(depth)) + leaf
    if draw(st.booleans()):
        body = _nested_tuples(draw(st.integers(1, SAFE_TUPLE_DEPTH)), body)
    return draw(st.sampled_from([b"", b"\x81\xa4tree"])) + body


@fuzz("deep")
@given(deep_documents())
def test_deep_nesting_is_decoded_or_refused(raw: bytes) -> None:
    for name, decode in BYTE_DECODERS.items():
        value = _outcome(functools.partial(decode, raw))
        if value is not None and name.startswith("tree"):
            _assert_tree_valid(value, 4 if name == "tree_indexed" else None)


# --------------------------------------------------------------------------- end to end

STEPS = (10, 20)
NEW = f"step-{STEPS[1]:010d}"


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step)), "ids": torch.arange(10) * step,
            "opt": {"lr": 0.25 * step, "betas": (0.9, 0.99)}}


def _live() -> dict[str, Any]:
    return {"w": torch.zeros(256), "ids": torch.zeros(10, dtype=torch.int64),
            "opt": {"lr": 0.0, "betas": (0.0, 0.0)}}


@dataclass(frozen=True)
class Template:
    """Two committed steps, saved once for the module and copied for every example."""

    root: Path
    scratch: Path
    shard: bytes
    manifest: bytes
    commit: bytes
    header_offset: int

    @property
    def header(self) -> bytes:
        return self.shard[self.header_offset:]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    base = tmp_path_factory.mktemp("fuzz-template")
    root = base / "ckpt"
    with cp.CheckpointPipeline(root, keep_last=5, chunk_bytes=ALIGN, direct_io=False) as pipe:
        for step in STEPS:
            pipe.save(step, _state(step), cp.TrainState(step=step)).result(30)
    files = root / NEW
    shard = (files / "rank-00000.shard").read_bytes()
    offset, _, _ = decode_preamble(shard[:PREAMBLE_SIZE], len(shard), "x")
    scratch = base / "scratch"
    scratch.mkdir()
    return Template(root, scratch, shard, (files / "rank-00000.manifest").read_bytes(),
                    (files / "rank-00000.commit").read_bytes(), offset)


@contextlib.contextmanager
def _copy_of(t: Template) -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(dir=t.scratch))
    try:
        root = work / "ckpt"
        shutil.copytree(t.root, root)
        yield root
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _install_header(t: Template, root: Path, header: bytes, fix: str) -> None:
    """Put ``header`` in the newest shard; ``fix`` says what is made to agree with it:
    "all" (preamble and manifest: only the decoder stands in the way), "preamble", "none"."""
    pre = t.shard[:PREAMBLE_SIZE]
    if fix != "none":
        pre = encode_preamble(t.header_offset, header)
    shard = pre + t.shard[PREAMBLE_SIZE:t.header_offset] + header
    _write(root / NEW / "rank-00000.shard", shard)
    if fix == "all":
        m = decode_manifest(t.manifest, "x")
        _write(root / NEW / "rank-00000.manifest", encode_manifest(Manifest(
            m.step, m.rank, m.world_size, m.save_id, len(shard), checksum(header),
            m.data_bytes)))


def _restore(root: Path, *, restore_rng: bool = False
             ) -> tuple[cp.RestoreResult | None, dict[str, Any], list[cp.Event]]:
    live = _live()
    events: list[cp.Event] = []
    with _time_limit(RESTORE_S), cp.CheckpointPipeline(root, restore_rng=restore_rng,
                                                       direct_io=False) as pipe:
        pipe.subscribe(events.append)
        result = pipe.restore_latest(live)
    return result, live, events


def _same_tensors(live: dict[str, Any], step: int) -> bool:
    want = _state(step)
    return torch.equal(live["w"], want["w"]) and torch.equal(live["ids"], want["ids"])


def _same_state(live: dict[str, Any], step: int) -> bool:
    return _same_tensors(live, step) and live["opt"] == _state(step)["opt"]


def _check_restore(root: Path, accepted: Callable[[], bool]) -> None:
    """The newest step was fuzzed: restore loads it only if it still decodes to what was
    saved (``accepted``), else falls back to the older step and reports the rejection, or
    raises a CheckpointError. Never another exception."""
    try:
        result, live, events = _restore(root)
    except CheckpointError as exc:
        event(f"restore raised {type(exc).__name__}")
        return
    assert result is not None
    if result.step == STEPS[1]:
        event("restored the fuzzed step (it still decodes to what was saved)")
        assert accepted(), "restore used a step whose fuzzed file does not decode"
        # a re-signed header may change plain values (the tree's "lr"), never tensor data
        assert _same_tensors(live, STEPS[1])
        return
    event("fell back to the older step")
    assert result.step == STEPS[0]
    assert _same_state(live, STEPS[0])
    assert [r.step for r in result.rejected] == [STEPS[1]]
    assert [e.step for e in events if isinstance(e, cp.CheckpointRejected)] == [STEPS[1]]


@st.composite
def fuzzed_headers(draw: st.DrawFn, t: Template) -> tuple[bytes, str]:
    """(new header bytes, what was fixed up to agree with them)."""
    base = _plain_of(t.header)
    what = draw(st.sampled_from(("bytes", "fields", "fields", "tree", "train_state", "benign")))
    if what == "benign":  # still valid once re-signed: restore must then use it
        header = enc({**base, "created_unix": draw(st.floats()),
                      "train_state": {**base["train_state"], "extra": draw(
                          st.dictionaries(names, plain, max_size=2))}})
    elif what == "bytes":
        header = draw(mutated(st.just(t.header)) | st.binary(max_size=256))
    elif what == "fields":
        header = enc(draw(hostile_header_doc(base)))
    elif what == "tree":
        raw, _ = draw(tree_inputs())
        header = enc({**base, "tree": raw})
    else:
        header = enc({**base, "train_state": draw(hostile_train_state_doc())})
    fix = draw(st.sampled_from(("all", "all", "all", "preamble", "none")))
    return header, fix


def _preamble_kept(t: Template, shard: bytes) -> bool:
    """The mutated preamble still says what the original said (flags and reserved bytes are
    not checked by the reader)."""
    try:
        got = decode_preamble(shard[:PREAMBLE_SIZE], len(shard), "x")
    except CheckpointIntegrityError:
        return False
    return len(shard) == len(t.shard) and got == decode_preamble(
        t.shard[:PREAMBLE_SIZE], len(t.shard), "x")


def _header_still_valid(t: Template, header: bytes, fix: str) -> bool:
    if fix != "all":
        return header == t.header
    try:
        h = decode_header(header, "x", file_size=t.header_offset + len(header),
                          header_offset=t.header_offset)
    except CheckpointIntegrityError:
        return False
    saved = decode_header(t.header, "x", file_size=len(t.shard), header_offset=t.header_offset)
    return (h.step, h.rank, h.world_size, h.save_id) == (
        saved.step, saved.rank, saved.world_size, saved.save_id)


@fuzz("e2e_header")
@given(st.data())
def test_restore_with_a_fuzzed_shard_header(template: Template, data: st.DataObject) -> None:
    header, fix = data.draw(fuzzed_headers(template))
    with _copy_of(template) as root:
        if data.draw(st.integers(0, 9)) == 0:  # the preamble itself
            shard = data.draw(mutated(st.just(template.shard[:64]))) + template.shard[64:]
            _write(root / NEW / "rank-00000.shard", shard)
            _check_restore(root, lambda: _preamble_kept(template, shard))
        else:
            _install_header(template, root, header, fix)
            _check_restore(root, lambda: _header_still_valid(template, header, fix))


@st.composite
def fuzzed_small_file(draw: st.DrawFn, valid: bytes, keys: tuple[str, ...]) -> bytes:
    return draw(st.one_of(
        mutated(st.just(valid)),
        hostile_map(_plain_of(valid), keys).map(enc),
        st.binary(max_size=128),
        st.sampled_from([b"", valid + b"\xc0", valid[:-1], valid * 2]),
    ))


def _placement_kept(decode: Callable[[bytes, str], Manifest | CommitRecord], raw: bytes,
                    original: bytes) -> bool:
    try:
        new = decode(raw, "x")
    except CheckpointIntegrityError:
        return False
    old = decode(original, "x")
    same = (new.step, new.rank, new.world_size, new.save_id) == (
        old.step, old.rank, old.world_size, old.save_id)
    if isinstance(new, Manifest) and isinstance(old, Manifest):
        same = same and (new.shard_size, new.header_checksum) == (old.shard_size,
                                                                  old.header_checksum)
    return same


@fuzz("e2e_manifest")
@given(st.data())
def test_restore_with_a_fuzzed_manifest(template: Template, data: st.DataObject) -> None:
    raw = data.draw(fuzzed_small_file(template.manifest, MANIFEST_KEYS))
    with _copy_of(template) as root:
        _write(root / NEW / "rank-00000.manifest", raw)
        _check_restore(root, lambda: _placement_kept(decode_manifest, raw, template.manifest))


@fuzz("e2e_commit")
@given(st.data())
def test_restore_with_a_fuzzed_commit_record(template: Template, data: st.DataObject) -> None:
    raw = data.draw(fuzzed_small_file(template.commit, COMMIT_KEYS))
    with _copy_of(template) as root:
        _write(root / NEW / "rank-00000.commit", raw)
        _check_restore(root, lambda: _placement_kept(decode_commit, raw, template.commit))


def test_harness_resigned_header_reaches_the_decoder(template: Template) -> None:
    """The fix-up of _install_header works: a re-signed benign change is restored, a
    re-signed wrong step is refused by the header check (not by a checksum)."""
    doc = _plain_of(template.header)
    with _copy_of(template) as root:
        _install_header(template, root, enc({**doc, "created_unix": 1.5}), "all")
        result, live, _ = _restore(root)
        assert result is not None and result.step == STEPS[1] and _same_state(live, STEPS[1])
    with _copy_of(template) as root:
        _install_header(template, root, enc({**doc, "step": 7}), "all")
        result, _, _ = _restore(root)
        assert result is not None and result.step == STEPS[0]
        assert "does not match its manifest" in result.rejected[0].reason


@pytest.mark.parametrize(("length", "offset"), [
    (U64, ALIGN), (2**40, ALIGN), (MAX_HEADER_BYTES, ALIGN), (100, U64 - ALIGN + 1),
    (100, 2**63), (2**63, 2**63),
])
def test_preamble_declaring_a_huge_header_is_refused_without_allocating_it(
        template: Template, length: int, offset: int) -> None:
    with _copy_of(template) as root:
        pre = _PRE.pack(b"CKPTSHRD", 1, 0, 0, offset, length, 0).ljust(PREAMBLE_SIZE, b"\0")
        _write(root / NEW / "rank-00000.shard", pre + template.shard[PREAMBLE_SIZE:])
        got: list[tuple[cp.RestoreResult | None, dict[str, Any], list[cp.Event]]] = []
        peak = _alloc_peak(lambda: got.append(_restore(root)))
        result, live, _ = got[0]
        assert result is not None and result.step == STEPS[0] and _same_state(live, STEPS[0])
        assert peak < 32 * 1024 * 1024


@pytest.mark.parametrize("name", ["rank-00000.manifest", "rank-00000.commit"])
def test_metadata_file_of_more_than_a_mebibyte_is_refused_without_reading_it(
        template: Template, name: str) -> None:
    with _copy_of(template) as root:
        with open(root / NEW / name, "r+b") as f:
            f.truncate(64 * 1024 * 1024)  # sparse: the size alone must refuse it
        got: list[tuple[cp.RestoreResult | None, dict[str, Any], list[cp.Event]]] = []
        peak = _alloc_peak(lambda: got.append(_restore(root)))
        result, _, _ = got[0]
        assert result is not None and result.step == STEPS[0]
        assert peak < 32 * 1024 * 1024


# --------------------------------------------------------------------------- known bugs


def _one_record_header(record: list[Any]) -> tuple[bytes, int, int]:
    doc = {"format": 1, "kind": "shard", "step": 1, "rank": 0, "world_size": 1,
           "save_id": "s-1", "created_unix": 0.0, "chunk_bytes": ALIGN,
           "data_offset": PREAMBLE_SIZE, "data_length": 8, "tensors": [record],
           "tree": b"\x80", "train_state": {}}
    raw = enc(doc)
    return raw, 2 * ALIGN + len(raw), 2 * ALIGN


@pytest.mark.parametrize("dtype", [["float32"], {"a": 1}])
def test_fixed_unhashable_dtype_escapes_decode_header(dtype: Any) -> None:
    raw, size, offset = _one_record_header(["w", dtype, [2], ALIGN, 8, [0], "cpu", None])
    with pytest.raises(CheckpointIntegrityError):
        decode_header(raw, "x", file_size=size, header_offset=offset)


def test_fixed_unhashable_dtype_escapes_restore_latest(template: Template) -> None:
    doc = _plain_of(template.header)
    doc["tensors"][0][1] = ["float32"]
    with _copy_of(template) as root:
        _install_header(template, root, enc(doc), "all")
        result, _, _ = _restore(root)
    assert result is not None and result.step == STEPS[0]


def test_fixed_placement_r_newline_escapes_decode_header() -> None:
    raw, size, offset = _one_record_header(
        ["w", "float32", [2], ALIGN, 8, [0], "cpu", [[1], ["R\n"], [2], [1]]])
    with pytest.raises(CheckpointIntegrityError):
        decode_header(raw, "x", file_size=size, header_offset=offset)


def test_fixed_placement_with_trailing_newline_is_accepted() -> None:
    raw, size, offset = _one_record_header(
        ["w", "float32", [2], ALIGN, 8, [0], "cpu", [[1], ["S0\n"], [2], [1]]])
    with pytest.raises(CheckpointIntegrityError):
        decode_header(raw, "x", file_size=size, header_offset=offset)


_CHILD_PRELUDE = textwrap.dedent("""
    import threading
    import msgpack
    from ckpt_pipeline import CheckpointError

    def nested(depth):
        inner = b"\\xc0"
        for _ in range(depth):
            inner = msgpack.packb(msgpack.ExtType(2, b"\\x91" + inner))
        return inner

    threading.stack_size(8 * 1024 * 1024)  # the usual default (ulimit -s 8192), pinned
""")


def _run_child(body: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=240, cwd=cwd)


def test_fixed_nested_tuple_extensions_crash_the_interpreter(tmp_path: Path) -> None:
    proc = _run_child("""
        from ckpt_pipeline._format.documents import decode_commit, decode_tree
        raw = nested(300)
        def run():
            for decode in (decode_tree, decode_commit):
                try:
                    decode(b"\\x81\\xa1t" + raw, "x")
                except CheckpointError:
                    print("refused")
        t = threading.Thread(target=run)
        t.start()
        t.join()
    """, tmp_path)
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stderr[-400:]}"
    assert proc.stdout.split() == ["refused", "refused"]


def test_fixed_nested_tuples_in_a_commit_record_kill_pipeline_open(
        template: Template) -> None:
    with _copy_of(template) as root:
        _write(root / NEW / "rank-00000.commit", b"\x81\xa1t" + _nested_tuples(300))
        # The child only opens: tensor work in the same process can leave larger thread
        # stacks in glibc's cache, which a new worker thread may reuse (a flaky crash).
        proc = _run_child(f"""
            import ckpt_pipeline as cp
            with cp.CheckpointPipeline({str(root)!r}, direct_io=False):
                print("opened")
        """, root.parent)
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stderr[-400:]}"
    assert "opened" in proc.stdout


def test_fixed_deep_state_tree_escapes_restore_latest(template: Template) -> None:
    doc = _plain_of(template.header)
    tree = _plain_of(doc["tree"])
    tree["opt"]["deep"] = "PLACEHOLDER"
    doc["tree"] = enc(tree).replace(enc("PLACEHOLDER"), b"\x91" * 1000 + b"\xc0")
    with _copy_of(template) as root:
        _install_header(template, root, enc(doc), "all")
        result, _, _ = _restore(root)
    assert result is not None and result.step == STEPS[0]


def test_fixed_timestamp_extension_is_accepted_in_the_state_tree() -> None:
    with pytest.raises(CheckpointIntegrityError):
        decode_tree(bytes(msgpack.packb({"lr": msgpack.Timestamp(5, 0)})), "x")


BAD_RNG = {
    "python: 3 words instead of 625": {"python": [3, [1, 2, 3], None]},
    "python: version is a str": {"python": ["x", [0] * 625, None]},
    "numpy: 1 key byte": {"numpy": ["MT19937", b"k", 0, 0, 0.0]},
    "torch_cpu: 1 byte": {"torch_cpu": b"x"},
}


@pytest.mark.parametrize("rng", list(BAD_RNG.values()), ids=list(BAD_RNG))
def test_fixed_rng_state_of_the_wrong_size_is_accepted(rng: dict[str, Any]) -> None:
    with pytest.raises(StateError):
        TrainState.from_plain({"step": 1, "rng": rng})


@pytest.fixture
def saved_global_rng() -> Iterator[None]:
    import numpy as np

    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


@pytest.mark.usefixtures("saved_global_rng")
def test_fixed_bad_rng_state_escapes_restore_latest(template: Template) -> None:
    doc = _plain_of(template.header)
    doc["train_state"]["rng"]["torch_cpu"] = b"x"
    with _copy_of(template) as root:
        _install_header(template, root, enc(doc), "all")
        result, _, _ = _restore(root, restore_rng=True)
    assert result is not None and result.step == STEPS[0]


def test_fixed_unparsable_cuda_device_escapes_restore_latest(
        template: Template, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _plain_of(template.header)
    doc["tensors"][0][6] = "cuda:x"
    with _copy_of(template) as root:
        _install_header(template, root, enc(doc), "all")
        live = _live()
        with cp.CheckpointPipeline(root, restore_rng=False, direct_io=False) as pipe:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
            try:
                result = pipe.restore_latest(live)
            finally:
                monkeypatch.undo()
    assert result is not None and result.step == STEPS[0]
