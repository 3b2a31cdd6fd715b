"""Helpers of the limit, dtype and round-trip tests: save, restore, compare exactly."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp

STEP = 1


def step_dirs(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-")) if root.exists() else []


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as bytes (a uint8 tensor), for any dtype: NaNs compare too."""
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, where: str = "") -> None:
    assert isinstance(got, torch.Tensor), (where, type(got))
    assert got.dtype == want.dtype, (where, got.dtype, want.dtype)
    assert got.shape == want.shape, (where, got.shape, want.shape)
    assert got.device == want.device, (where, got.device, want.device)
    assert torch.equal(raw_bytes(got), raw_bytes(want)), where


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Exactly equal: tensors bit for bit, plain values with their types, tuples as tuples.

    A saved OrderedDict comes back as a dict, a Parameter as a tensor, bytearray as bytes.
    """
    if isinstance(want, torch.Tensor):
        assert_bit_equal(got, want, where)
        return
    if isinstance(want, Mapping):
        assert type(got) is dict, (where, type(got))
        assert list(got) == list(want), (where, list(got), list(want))
        for key, value in want.items():
            assert_same(got[key], value, f"{where}/{key}")
        return
    if isinstance(want, (list, tuple)):
        assert type(got) is type(want), (where, type(got), type(want))
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}/{i}")
        return
    if isinstance(want, (bytearray, memoryview)):
        want = bytes(want)
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), (where, got, want)
    else:
        assert got == want, (where, got, want)


def save(root: Path, state: Mapping[str, Any], ts: cp.TrainState | None = None, *,
         step: int = STEP, **options: Any) -> None:
    options.setdefault("capture_rng", False)
    with cp.CheckpointPipeline(root, **options) as pipe:
        pipe.save(step, state, ts).result(600)


def restore(root: Path, live: dict[str, Any], **options: Any) -> cp.RestoreResult:
    options.setdefault("restore_rng", False)
    with cp.CheckpointPipeline(root, **options) as pipe:
        result = pipe.restore_latest(live)
    assert result is not None
    assert not result.rejected, result.rejected
    return result


def round_trip(root: Path, state: Mapping[str, Any], ts: cp.TrainState | None = None, *,
               step: int = STEP, **options: Any) -> cp.RestoreResult:
    """Save, then restore into empty maps (``{name: {}}``: every value is materialized) and
    check that everything came back exactly. The state's values must be mappings."""
    save(root, state, ts, step=step, **options)
    live: dict[str, Any] = {name: {} for name in state}
    result = restore(root, live)
    assert result.step == step
    for name, value in state.items():
        assert_same(live[name], value, name)
    if ts is not None:
        assert_same(dict(result.train_state.extra), dict(ts.extra), "train_state/extra")
    return result


def assert_refused(root: Path, state: Mapping[str, Any], ts: cp.TrainState | None = None, *,
                   path: str | None, match: str, step: int = STEP,
                   **options: Any) -> cp.StateError:
    """save() raises StateError naming ``path`` (and matching ``match``), writing nothing."""
    options.setdefault("capture_rng", False)
    with cp.CheckpointPipeline(root, **options) as pipe:
        with pytest.raises(cp.StateError) as info:
            pipe.save(step, state, ts)
        assert step_dirs(root) == [], "nothing is written"
    error = info.value
    assert error.path == path, (error.path, path)
    assert error.step == step
    assert re.search(match, str(error)), str(error)
    assert error.hint or "limit" in error.message, str(error)
    assert step_dirs(root) == []
    return error
