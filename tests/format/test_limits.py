"""Every limit a reader enforces is checked in save() first (the table in ckpt_pipeline._format.limits).

For each entry of the table: a state just over the limit is refused by save(), naming the path,
before anything is written; a state exactly at it is saved and restored exactly. A new entry
without a case here fails ``test_every_limit_has_a_case``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format import documents as _documents
from ckpt_pipeline._format import header as _header
from ckpt_pipeline._format import limits as _limits
from ckpt_pipeline._format import names as _names
from ckpt_pipeline._format import shard as _shard
from ckpt_pipeline._format.header import DistLayout
from ckpt_pipeline._format.layout import plan_layout
from ckpt_pipeline._format.limits import (
    ALIGN,
    DTYPES,
    INT_MAX,
    INT_MIN,
    LIMITS,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    MAX_NESTING,
    MAX_PATH_LEN,
    MAX_TENSORS,
)
from ckpt_pipeline._save import checks as _checks
from ckpt_pipeline._save.checks import check_save, small_file_bytes_bound
from ckpt_pipeline._tree import FlatState
from tests._support.roundtrip import STEP, assert_refused, restore, round_trip, save, step_dirs

Check = Callable[[Path, pytest.MonkeyPatch], None]


@dataclass(frozen=True)
class Case:
    over: Check
    """Just over the limit: save() refuses, naming the path, and writes nothing."""
    at: Check
    """At the limit: saved and restored exactly."""


def nested(levels: int, leaf: Any) -> Any:
    """``levels`` maps, each holding the next under "a"; the innermost holds ``leaf``."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def deep_path(prefix: str, levels: int) -> str:
    return prefix + "/a" * levels


def header_length(root: Path, step: int = STEP) -> int:
    """The header length recorded in the preamble of rank 0's shard of ``step``."""
    path = root / _names.step_dir_name(step) / _names.shard_name(0)
    with open(path, "rb") as f:
        raw = f.read(48)
    return int(struct.unpack_from("<8sHHIQQQ", raw)[5])


# --------------------------------------------------------------------------- path_length


def path_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    key = "k" * (MAX_PATH_LEN - 1)  # "m/" + key: one character too many
    assert_refused(root, {"m": {key: torch.ones(2)}}, path=f"m/{key}",
                   match=rf"is {MAX_PATH_LEN + 1} characters.*limit path_length")


def path_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    key = "k" * (MAX_PATH_LEN - 2)
    round_trip(root, {"m": {key: torch.arange(3.0), "other": "x"}})


# --------------------------------------------------------------------------- nesting
# The state tree: state["d"] is at depth 1, so nested(k) under it has its innermost map at k.


def nesting_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    assert_refused(root, {"d": nested(MAX_NESTING, torch.ones(1))},
                   path=deep_path("d", MAX_NESTING - 1),
                   match=rf"depth {MAX_NESTING} of the state tree.*limit nesting")


def nesting_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    round_trip(root, {"d": nested(MAX_NESTING - 1, torch.ones(1)),
                      "t": {"x": nested(MAX_NESTING - 4, (1, [2.5, "x"]))}})


# --------------------------------------------------------------------------- header_bytes


def _blob_overhead(root: Path) -> int:
    """Header bytes besides a blob's own (no tensors: the header size is exact)."""
    probe = 1 << 17  # the same msgpack header sizes (bin32) as a blob of 256 MiB
    save(root, {"blob": {"b": bytes(probe)}}, step=STEP)
    overhead = header_length(root, STEP) - probe
    assert 0 < overhead < 4096
    return overhead


def header_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    probe_root = root.parent / "probe"
    size = MAX_HEADER_BYTES - _blob_overhead(probe_root) + 1
    assert_refused(root, {"blob": {"b": bytes(size)}}, step=STEP + 1, path="blob/b",
                   match=rf"about {MAX_HEADER_BYTES + 1} bytes.*limit header_bytes")


def header_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    size = MAX_HEADER_BYTES - _blob_overhead(root)
    blob = bytes(range(256)) * (size // 256) + bytes(size % 256)
    state = {"blob": {"b": blob}}
    save(root, state, step=STEP + 1)  # the same length of save id as the probe's
    assert header_length(root, STEP + 1) == MAX_HEADER_BYTES
    live: dict[str, Any] = {"blob": {}}
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(live)
    assert result is not None and result.step == STEP + 1 and not result.rejected
    assert live["blob"]["b"] == blob


# --------------------------------------------------------------------------- tensor_count


def count_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    tensors = [torch.empty(0) for _ in range(MAX_TENSORS + 1)]
    assert_refused(root, {"x": tensors}, path=f"x/{MAX_TENSORS}",
                   match=rf"more than {MAX_TENSORS} tensors.*limit tensor_count")


def count_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    tensors = [torch.empty(0) for _ in range(MAX_TENSORS - 1)] + [torch.arange(3)]
    save(root, {"x": {"ts": tensors}})
    live: dict[str, Any] = {"x": {}}
    restore(root, live)
    got = live["x"]["ts"]
    assert type(got) is list and len(got) == MAX_TENSORS
    assert all(t.shape == (0,) and t.dtype == torch.float32 for t in got[:-1])
    assert torch.equal(got[-1], torch.arange(3))


# --------------------------------------------------------------------------- ndim


def ndim_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    assert_refused(root, {"m": {"t": torch.zeros((1,) * (MAX_NDIM + 1))}}, path="m/t",
                   match=rf"has {MAX_NDIM + 1} dimensions.*limit ndim")


def ndim_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    shape = (2,) + (1,) * (MAX_NDIM - 3) + (3, 2)
    round_trip(root, {"m": {"t": torch.randn(shape), "z": torch.zeros((1,) * MAX_NDIM)}})


# --------------------------------------------------------------------------- dtype


def _unsupported_dtype() -> torch.dtype:
    for name in ("float8_e8m0fnu", "complex32", "float4_e2m1fn_x2", "bits8", "uint4"):
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype) and dtype not in DTYPES.values():
            return dtype
    raise AssertionError("every candidate dtype is supported")


def dtype_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    dtype = _unsupported_dtype()
    assert_refused(root, {"m": {"t": torch.empty(4, dtype=dtype)}}, path="m/t",
                   match=rf"dtype {dtype} is not supported: supported dtypes are float64, ")


def dtype_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {"m": {}}
    for name, dtype in DTYPES.items():
        raw = torch.randint(0, 2 if dtype == torch.bool else 256, (24 * dtype.itemsize,),
                            dtype=torch.uint8, generator=gen)
        state["m"][name] = raw.view(dtype).reshape(2, 3, -1)
    round_trip(root, state)


# --------------------------------------------------------------------------- device


def device_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    assert_refused(root, {"m": {"t": torch.empty(3, device="meta")}}, path="m/t",
                   match=r"is on device meta.*limit device")


def device_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    state = {"m": {"cpu": torch.arange(4.0)}}
    if torch.cuda.is_available():
        state["m"]["cuda"] = torch.arange(4.0, device="cuda")
    round_trip(root, state)


# --------------------------------------------------------------------------- int_range


def int_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    assert_refused(root, {"m": {"big": INT_MAX + 1}}, path="m/big",
                   match=r"does not fit in 64 bits \(limit int_range\)")
    assert_refused(root, {"m": {"x": torch.ones(1)}},
                   cp.TrainState(step=STEP, extra={"low": [INT_MIN - 1]}),
                   path="train_state/extra/low/0", match=r"limit int_range")
    assert_refused(root, {"m": {}}, cp.TrainState(step=STEP, consumed_train_samples=INT_MAX + 1),
                   path="train_state/consumed_train_samples", match=r"limit int_range")
    assert_refused(root, {"m": {}}, step=INT_MAX + 1, path=None, match=r"limit int_range")


def int_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    ts = cp.TrainState(step=STEP, consumed_train_samples=INT_MAX,
                       extra={"ints": [INT_MIN, INT_MAX, {INT_MAX: INT_MIN}]})
    result = round_trip(root, {"m": {"ints": (INT_MIN, INT_MAX), INT_MIN: 0}}, ts)
    assert result.train_state.consumed_train_samples == INT_MAX
    big = root.parent / "big-step"
    round_trip(big, {"m": {"x": 1}}, step=INT_MAX)


# --------------------------------------------------------------------------- map_keys


def keys_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    assert_refused(root, {"m": {"x": torch.ones(1)}},
                   cp.TrainState(step=STEP, extra={"a": {"b": {1.5: "x"}}}),
                   path="train_state/extra/a/b", match=r"map key 1.5 of type float.*map_keys")
    assert_refused(root, {"m": {"x": torch.ones(1)}},
                   cp.TrainState(step=STEP, extra={"a": {True: "x"}}),
                   path="train_state/extra/a", match=r"map key True of type bool")
    assert_refused(root, {"m": {(1, 2): torch.ones(1)}}, path="m",
                   match=r"map key \(1, 2\) of type tuple.*map_keys")


def keys_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    ts = cp.TrainState(step=STEP, extra={"a": {1: "one", "1": "string one", -5: [0]}})
    round_trip(root, {"m": {0: torch.ones(1), "0": 1, -(2**63): None}}, ts)


# --------------------------------------------------------------------------- value_types


def values_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    assert_refused(root, {"m": {"x": torch.ones(1)}},
                   cp.TrainState(step=STEP, extra={"when": [msgpack.Timestamp(0)]}),
                   path="train_state/extra/when/0", match=r"msgpack.ext.Timestamp.*value_types")
    assert_refused(root, {"m": {"x": torch.ones(1)}},
                   cp.TrainState(step=STEP, extra={"ext": msgpack.ExtType(1, bytes(8))}),
                   path="train_state/extra/ext", match=r"ExtType.*value_types")
    assert_refused(root, {"m": {"s": {1, 2}}}, path="m/s", match=r"builtins.set")
    assert_refused(root, {"m": {"s": "\ud800"}}, path="m/s", match=r"UTF-8")


def values_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    plain = [None, True, False, 0, -1, 2.5, float("nan"), float("-inf"), -0.0, "", "ü€𝄞",
             b"", b"\x00\xff", [], (), {}, ((1,), [()], {"k": (None,)})]
    ts = cp.TrainState(step=STEP, extra={"plain": plain})
    round_trip(root, {"m": {"plain": plain}}, ts)


# --------------------------------------------------------------------------- save_id_length


def _run_id_length() -> int:
    return 16  # secrets.token_hex(8), agreed at open (see test below)


def save_id_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    length = len(f"{'0' * _run_id_length()}-{STEP}")
    mp.setattr(_checks, "MAX_SAVE_ID_LEN", length - 1)
    assert_refused(root, {"m": {"x": torch.ones(1)}}, path=None,
                   match=rf"is {length} characters.*limit save_id_length")


def save_id_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    length = len(f"{'0' * _run_id_length()}-{STEP}")
    mp.setattr(_checks, "MAX_SAVE_ID_LEN", length)
    round_trip(root, {"m": {"x": torch.ones(1)}})
    with cp.CheckpointPipeline(root) as pipe:
        assert len(pipe._pipe.admission.run_id) == _run_id_length()


# --------------------------------------------------------------------------- small_file_bytes


def _small_bound() -> int:
    save_id = f"{'0' * _run_id_length()}-{STEP}"
    return small_file_bytes_bound(step=STEP, rank=0, world_size=1, save_id=save_id)


def small_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    bound = _small_bound()
    mp.setattr(_checks, "MAX_SMALL_FILE_BYTES", bound - 1)
    assert_refused(root, {"m": {"x": torch.ones(1)}}, path=None,
                   match=rf"up to {bound} bytes.*limit small_file_bytes")


def small_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    bound = _small_bound()
    mp.setattr(_checks, "MAX_SMALL_FILE_BYTES", bound)
    round_trip(root, {"m": {"x": torch.ones(1)}})
    step_dir = root / _names.step_dir_name(STEP)
    for name in (_names.manifest_name(0), _names.commit_name(0)):
        assert os.path.getsize(step_dir / name) <= bound


# --------------------------------------------------------------------------- chunk_bytes


def chunk_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    for bad in (ALIGN + 1, ALIGN // 2, 0):
        with pytest.raises(cp.ConfigError, match="chunk_bytes"):
            cp.CheckpointPipeline(root, chunk_bytes=bad)
    assert step_dirs(root) == []


def chunk_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    round_trip(root, {"m": {"x": torch.randn(3 * ALIGN // 4 + 7)}}, chunk_bytes=ALIGN)


# --------------------------------------------------------------------------- dtensor_layout
# A DTensor needs a process group; the layout check is called directly, on a flat state
# holding the layout a DTensor would have given (tests/coordination/test_fsdp.py saves real ones).


def _flat_with(layout: DistLayout) -> FlatState:
    return FlatState({"w": _documents.TensorRef(0)}, ("w",), (torch.zeros(2, 4),), (layout,))


def _check(flat: FlatState) -> None:
    check_save(flat, _documents.encode_tree(flat.skeleton), cp.TrainState(step=STEP).to_plain(),
               step=STEP, rank=0, world_size=2, save_id="r-1", chunk_bytes=ALIGN,
               layout=plan_layout(flat.tensors))


def dtensor_over(root: Path, mp: pytest.MonkeyPatch) -> None:
    bad = [DistLayout((2,), ("S2",), (4, 4), (4, 1)),  # dim 2 of a 2-dim tensor
           DistLayout((2,), ("S-1",), (4, 4), (4, 1)),
           DistLayout((1,) * (MAX_NDIM + 1), ("R",) * (MAX_NDIM + 1), (2, 4), (4, 1)),
           DistLayout((2, 0), ("R", "R"), (2, 4), (4, 1)),
           DistLayout((2,), ("S0",), (4,), (1,))]
    for layout in bad:
        with pytest.raises(cp.StateError, match="limit dtensor_layout") as info:
            _check(_flat_with(layout))
        assert info.value.path == "w"
        with pytest.raises(cp.CheckpointIntegrityError):  # and a reader refuses it too
            _header.decode_dist(layout.to_plain(), 2, "w", "x")


def dtensor_at(root: Path, mp: pytest.MonkeyPatch) -> None:
    for layout in (DistLayout((2,), ("S1",), (2, 8), (8, 1)),
                   DistLayout((1,) * MAX_NDIM, ("R",) * MAX_NDIM, (2, 4), (4, 1))):
        _check(_flat_with(layout))
        assert _header.decode_dist(layout.to_plain(), 2, "w", "x") == layout


CASES: dict[str, Case] = {
    "path_length": Case(path_over, path_at),
    "nesting": Case(nesting_over, nesting_at),
    "header_bytes": Case(header_over, header_at),
    "tensor_count": Case(count_over, count_at),
    "ndim": Case(ndim_over, ndim_at),
    "dtype": Case(dtype_over, dtype_at),
    "device": Case(device_over, device_at),
    "int_range": Case(int_over, int_at),
    "map_keys": Case(keys_over, keys_at),
    "value_types": Case(values_over, values_at),
    "save_id_length": Case(save_id_over, save_id_at),
    "small_file_bytes": Case(small_over, small_at),
    "chunk_bytes": Case(chunk_over, chunk_at),
    "dtensor_layout": Case(dtensor_over, dtensor_at),
}
SLOW_AT = {"tensor_count", "header_bytes"}
"""At the limit, these take seconds to a minute (see the docstrings): the slow suite."""
SLOW_OVER = {"tensor_count", "header_bytes"}
"""Just over the limit, a million tensors (or a header of its maximum size) take seconds to
build: the slow suite."""


def test_every_limit_has_a_case() -> None:
    assert [limit.name for limit in LIMITS] == list(CASES)
    assert len({limit.name for limit in LIMITS}) == len(LIMITS)


def test_format_reads_its_limits_from_the_table() -> None:
    values = {limit.name: limit.value for limit in LIMITS}
    assert values["path_length"] == _header.MAX_PATH_LEN
    assert values["nesting"] == _documents.MAX_NESTING
    assert values["header_bytes"] == _shard.MAX_HEADER_BYTES
    assert values["tensor_count"] == _header.MAX_TENSORS
    assert values["ndim"] == _header.MAX_NDIM
    assert tuple(_header.DTYPES) == values["dtype"]
    assert values["small_file_bytes"] == _documents.MAX_SMALL_FILE_BYTES
    assert values["save_id_length"] == _documents.MAX_SAVE_ID_LEN
    assert _header.DEVICE is _limits.DEVICE_PATTERN
    assert _header.PLACEMENT is _limits.PLACEMENT_PATTERN


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_OVER else name for name in CASES])
def test_just_over_the_limit_is_refused_by_save(name: str, root: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    CASES[name].over(root, monkeypatch)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_AT else name for name in CASES])
def test_at_the_limit_is_saved_and_restored(name: str, root: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    CASES[name].at(root, monkeypatch)


# --------------------------------------------------------------------------- the four reports


def test_a_5000_character_key_is_refused(root: Path) -> None:
    key = "k" * 5000
    error = assert_refused(root, {"model": {key: torch.ones(2)}}, path=f"model/{key}",
                           match=r"5006 characters.*limit path_length")
    assert "shorter keys" in (error.hint or "")


def test_train_state_extra_nested_120_levels_is_refused(root: Path) -> None:
    ts = cp.TrainState(step=STEP, extra=nested(120, 1))
    # extra is depth 2 of the shard header: its 98th nested map is at depth 100
    error = assert_refused(root, {"m": {"x": torch.ones(1)}}, ts,
                           path=deep_path("train_state/extra", MAX_NESTING - 2),
                           match=r"depth 100 of the shard header.*limit nesting")
    assert error.rank == 0


def test_train_state_extra_nested_to_the_limit_round_trips(root: Path) -> None:
    # extra is depth 2: its innermost map at 97, the list at 98, the tuple at 99
    ts = cp.TrainState(step=STEP, extra=nested(MAX_NESTING - 4, [1, (2,)]))
    round_trip(root, {"m": {"x": torch.ones(1)}}, ts)
    over = cp.TrainState(step=STEP + 1, extra=nested(MAX_NESTING - 1, 1))
    assert_refused(root.parent / "over", {"m": {}}, over, step=STEP + 1,
                   path=deep_path("train_state/extra", MAX_NESTING - 2), match="limit nesting")


@pytest.mark.slow  # 270 MiB values (1.3 s and more); the header limit stays fast, just over it
@pytest.mark.parametrize("where", ["state", "train_state"])
def test_a_270_mib_bytes_value_is_refused(root: Path, where: str) -> None:
    blob = bytes(270 << 20)
    if where == "state":
        error = assert_refused(root, {"m": {"blob": blob}}, path="m/blob",
                               match=r"limit header_bytes")
    else:
        error = assert_refused(root, {"m": {}}, cp.TrainState(step=STEP, extra={"blob": blob}),
                               path="train_state/extra/blob", match=r"limit header_bytes")
    assert "torch.frombuffer" in (error.hint or "")


def test_the_planned_header_size_bounds_the_written_one(root: Path) -> None:
    """The bound check_save uses is the header serialize writes, checksums at most larger."""
    state = {"m": {f"t{i}": torch.randn(i % 5, 3) for i in range(50)},
             "big": {"x": torch.zeros(3 * ALIGN)}, "v": {"s": "x" * 1000}}
    ts = cp.TrainState(step=STEP, extra={"a": [1, 2.5, b"xyz"]})
    seen: dict[str, int] = {}
    real = _checks.header_bytes_bound

    def spy(*args: Any, **kwargs: Any) -> int:
        seen["bound"] = real(*args, **{**kwargs, "exact": True})
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_checks, "header_bytes_bound", spy)
        save(root, state, ts, chunk_bytes=ALIGN)
    written = header_length(root)
    data = sum(t.numel() * t.element_size() for part in ("m", "big")
               for t in state[part].values())
    checksums = -(-(_shard.PREAMBLE_SIZE + data) // ALIGN)  # one per page of the region
    assert checksums == 13
    # each checksum is counted at 9 bytes (its real encoding takes 1 to 9), and the bound
    # allows one more than the region has
    assert written <= seen["bound"] <= written + 8 * checksums + 9
