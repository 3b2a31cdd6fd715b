"""Format 2's data region: small tensors packed, shared storages written once, aliases kept.

A shard holds the state's unique bytes (each storage once) plus at most 5% of padding, the
preamble and the header; tensors that shared memory when saved share it again when restored
into empty containers, and live objects keep their own ties.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ckpt_pipeline as cp
from ckpt_pipeline._format.layout import LARGE_STORAGE, plan_layout
from ckpt_pipeline._format.limits import DTYPES
from ckpt_pipeline._format.shard import PREAMBLE_SIZE

SHARD = "step-{:010d}/rank-00000.shard"


def _save(root: Path, state: dict[str, Any], step: int = 1, **options: Any) -> Path:
    with cp.CheckpointPipeline(root, keep_last=5, **options) as pipe:
        pipe.save(step, state).result(60)
    return root / SHARD.format(step)


def _header_length(shard: Path) -> int:
    with open(shard, "rb") as f:
        return int(struct.unpack_from("<8sHHIQQQ", f.read(40))[5])


def _restore_into(root: Path, live: dict[str, Any]) -> cp.RestoreResult:
    with cp.CheckpointPipeline(root, restore_rng=False) as pipe:
        result = pipe.restore_latest(live)
    assert result is not None
    return result


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the union of the tensors' memory (each shared byte counted once)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        size = t.element_size()
        start = t.storage_offset() * size
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        key = t.untyped_storage().data_ptr()
        spans.setdefault(key, []).append((start, start + (last + 1) * size))
    total = 0
    for ranges in spans.values():
        reach = -1
        for start, end in sorted(ranges):
            total += max(0, end - max(start, reach))
            reach = max(reach, end)
    return total


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@st.composite
def tensor_mixes(draw: st.DrawFn) -> list[torch.Tensor]:
    """Tensors of many sizes and dtypes: scalars, odd lengths, a few large ones."""
    out = []
    for _ in range(draw(st.integers(1, 60))):
        dtype = draw(st.sampled_from(list(DTYPES.values())))
        kind = draw(st.sampled_from(["scalar", "small", "odd", "large"]))
        n = {"scalar": 1, "small": draw(st.integers(1, 64)), "odd": draw(st.integers(1, 5000)),
             "large": draw(st.integers(LARGE_STORAGE // dtype.itemsize,
                                       LARGE_STORAGE // dtype.itemsize + 5000))}[kind]
        t = torch.zeros(n, dtype=dtype)
        out.append(t.reshape(()) if kind == "scalar" else t)
    return out


@settings(max_examples=60, deadline=None)
@given(tensor_mixes())
@pytest.mark.slow
def test_any_mix_of_sizes_is_packed_within_5_percent_of_its_bytes(tensors: list[torch.Tensor]
                                                                  ) -> None:
    layout = plan_layout(tensors)
    unique = sum(t.numel() * t.element_size() for t in tensors)
    assert layout.stored_bytes == unique
    assert layout.data_length <= 1.05 * unique
    padding = sum(end - start for start, end in layout.gaps)
    assert layout.data_length == unique + padding
    # storages never overlap, each aligned to its element size, large ones to 4096
    end = PREAMBLE_SIZE
    for item, t in zip(sorted(layout.items, key=lambda i: i.offset),
                       [tensors[i.source] for i in sorted(layout.items, key=lambda i: i.offset)]):
        assert item.offset >= end and item.offset % t.element_size() == 0
        if item.nbytes >= LARGE_STORAGE:
            assert item.offset % 4096 == 0
        end = item.offset + item.nbytes


@pytest.mark.slow
def test_many_small_tensors_take_their_bytes_plus_the_header(root: Path) -> None:
    state = {"t": {str(i): torch.full((16,), float(i)) for i in range(5000)},
             "s": [torch.tensor(i, dtype=torch.int64) for i in range(300)],
             "h": [torch.ones(i % 7 + 1, dtype=torch.bfloat16) for i in range(300)]}
    tensors = [*state["t"].values(), *state["s"], *state["h"]]
    unique = _unique_bytes(tensors)
    shard = _save(root, state)
    size = shard.stat().st_size
    assert size <= 1.05 * unique + _header_length(shard) + PREAMBLE_SIZE
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(2, state).result(60)
        assert pipe.host_memory_bytes <= 1.05 * unique + 2 * 4096  # the buffer mirrors it
    live: dict[str, Any] = {"t": {}, "s": [torch.zeros((), dtype=torch.int64) for _ in range(300)],
            "h": [torch.zeros(i % 7 + 1, dtype=torch.bfloat16) for i in range(300)]}
    _restore_into(root, live)
    assert all(torch.equal(live["t"][k], v) for k, v in state["t"].items())
    assert all(torch.equal(a, b) for a, b in zip(live["s"], state["s"]))
    assert all(torch.equal(a, b) for a, b in zip(live["h"], state["h"]))


def _tied_model() -> nn.Module:
    model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.Linear(64, 1000))
    model[2].weight = model[0].weight
    return model


def test_a_tied_weight_is_written_once_and_the_live_tie_is_kept(root: Path) -> None:
    torch.manual_seed(0)
    model = _tied_model()
    shard = _save(root, {"model": model})
    unique = _unique_bytes(list(model.state_dict().values()))
    assert len(model.state_dict()) == 5  # the tied weight under two names
    assert shard.stat().st_size <= 1.05 * unique + _header_length(shard) + PREAMBLE_SIZE
    fresh = _tied_model()
    _restore_into(root, {"model": fresh})
    assert fresh[2].weight is fresh[0].weight
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_tensor_and_its_view_come_back_aliased_into_an_empty_container(root: Path) -> None:
    base = torch.arange(1000, dtype=torch.float32)
    state = {"d": {"base": base, "view": base[10:500], "other": base[600:700].view(torch.int32),
                   "t": base.reshape(10, 100).t()}}
    shard = _save(root, state)
    assert shard.stat().st_size <= base.numel() * 4 + _header_length(shard) + PREAMBLE_SIZE
    live: dict[str, Any] = {"d": {}}
    _restore_into(root, live)
    got = live["d"]
    for key, value in state["d"].items():
        assert torch.equal(got[key], value), key
        assert got[key].stride() == value.stride(), key
    assert all(_shares_memory(got["base"], got[k]) for k in ("view", "other", "t"))
    got["base"][20] = -1.0  # a write through one name shows through the other
    assert got["view"][10].item() == -1.0 and got["t"][0, 0].item() == 0.0
    assert got["t"][20, 0].item() == -1.0


def test_disjoint_views_of_one_storage_are_stored_apart(root: Path) -> None:
    """Only the bytes the state holds are written, not the whole storage."""
    big = torch.zeros(1 << 20)
    state = {"d": {"a": big[:10], "b": big[-10:]}}
    shard = _save(root, state)
    assert shard.stat().st_size - _header_length(shard) - PREAMBLE_SIZE == 80
    live: dict[str, Any] = {"d": {}}
    _restore_into(root, live)
    assert torch.equal(live["d"]["a"], big[:10]) and live["d"]["b"].numel() == 10


def test_strided_and_expanded_tensors_round_trip(root: Path) -> None:
    x = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4)
    state = {"d": {"perm": x.permute(2, 0, 1), "step": x[:, ::2, 1::2],
                   "expanded": torch.arange(3.0).expand(4, 3),
                   "channels_last": torch.arange(48.0).reshape(1, 3, 4, 4).to(
                       memory_format=torch.channels_last),
                   "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5)}}
    _save(root, state)
    live: dict[str, Any] = {"d": {}}
    _restore_into(root, live)
    for key, value in state["d"].items():
        assert torch.equal(live["d"][key], value), key
        assert live["d"][key].dtype == value.dtype and live["d"][key].shape == value.shape


@st.composite
def aliased_states(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Several bases, and views of them: slices, reshapes, other dtypes, transposes."""
    state: dict[str, torch.Tensor] = {}
    for b in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 64)) * 8
        base = torch.randint(-100, 100, (n,), dtype=torch.int64).to(torch.float64)
        state[f"b{b}"] = base
        for v in range(draw(st.integers(0, 4))):
            lo = draw(st.integers(0, n - 1))
            hi = draw(st.integers(lo + 1, n))
            kind = draw(st.sampled_from(["slice", "bytes", "pairs", "strided"]))
            view = base[lo:hi]
            if kind == "bytes":
                view = view.view(torch.uint8)
            elif kind == "pairs" and view.numel() % 2 == 0:
                view = view.reshape(-1, 2).t()
            elif kind == "strided":
                view = base[lo:hi:2]
            state[f"b{b}v{v}"] = view
    return state


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(aliased_states())
@pytest.mark.slow
def test_aliases_come_back_aliased_and_values_exact(tmp_path: Path,
                                                    state: dict[str, torch.Tensor]) -> None:
    root = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
    shard = _save(root, {"s": state})
    unique = _unique_bytes(list(state.values()))
    assert shard.stat().st_size <= unique + 16 + _header_length(shard) + PREAMBLE_SIZE
    live: dict[str, Any] = {"s": {}}
    _restore_into(root, live)
    got = live["s"]
    for key, value in state.items():
        assert torch.equal(got[key], value), key
    for a in state:
        for b in state:
            if state[a].untyped_storage().data_ptr() == state[b].untyped_storage().data_ptr():
                assert _shares_memory(got[a], got[b]), (a, b)


def test_a_checkpoint_of_a_view_does_not_keep_the_whole_read_alive(root: Path) -> None:
    """Storages of 1 MiB or more are read into memory of their own."""
    state = {"d": {"big": torch.ones(1 << 20), "small": torch.zeros(4)}}
    _save(root, state)
    live: dict[str, Any] = {"d": {}}
    _restore_into(root, live)
    assert not _shares_memory(live["d"]["big"], live["d"]["small"])
    assert live["d"]["small"].untyped_storage().nbytes() < 4096


@pytest.mark.parametrize("cap", [None, 1 << 20])
def test_shared_storages_are_kept_in_a_streamed_save(root: Path, cap: int | None) -> None:
    base = torch.arange(600_000, dtype=torch.float32)
    state = {"d": {"base": base, "head": base[:1000], "tail": base[-5:], "x": torch.ones(7)}}
    _save(root, state, host_buffer_bytes=cap, chunk_bytes=256 * 1024)
    live: dict[str, Any] = {"d": {}}
    _restore_into(root, live)
    assert all(torch.equal(live["d"][k], v) for k, v in state["d"].items())
    assert _shares_memory(live["d"]["base"], live["d"]["tail"])
