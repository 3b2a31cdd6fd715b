"""Property: whatever save() accepts, restore gives back exactly.

Random states of nested dicts, lists and tuples holding plain values and tensors (every allowed
dtype; zero-size, 0-dim and strided views included) are saved, then restored into empty maps,
where every value is materialized: tensors must come back bit for bit (NaNs included), plain
values equal and of the same type, tuples as tuples. A state save() refuses must be refused with
a StateError and nothing written; the strategies generate only accepted states, so a refusal
fails the test too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt_pipeline as cp
from ckpt_pipeline._format.limits import DTYPES, INT_MAX, INT_MIN
from tests._support.roundtrip import assert_same, restore, save

DTYPE_LIST = list(DTYPES.values())


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPE_LIST))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
    seed = draw(st.integers(0, 2**31 - 1))
    count = 1
    for d in shape:
        count *= d
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (count * dtype.itemsize,),
                        dtype=torch.uint8, generator=gen)
    t = raw.view(dtype).reshape(shape)
    view = draw(st.sampled_from(["plain", "transposed", "sliced", "expanded", "conj"]))
    if view == "transposed" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif view == "sliced" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1:]
    elif view == "expanded" and t.dim() >= 1:
        t = t[:1].expand(3, *t.shape[1:]) if t.shape[0] >= 1 else t
    elif view == "conj" and t.is_complex():
        t = t.conj()
    return t


keys = st.text(max_size=6) | st.integers(INT_MIN, INT_MAX)
plain = (st.none() | st.booleans() | st.integers(INT_MIN, INT_MAX)
         | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=10)
         | st.binary(max_size=16))
values = st.recursive(
    plain | tensors(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12,
)
extra = st.dictionaries(st.text(max_size=6), st.recursive(
    plain, lambda inner: st.lists(inner, max_size=3) | st.tuples(inner)
    | st.dictionaries(keys, inner, max_size=3), max_leaves=8), max_size=3)


def _expected(value: Any) -> Any:
    """What a restore gives back: views resolved to their values."""
    if isinstance(value, torch.Tensor):
        return value.resolve_conj().resolve_neg()
    if isinstance(value, dict):
        return {k: _expected(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expected(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_expected(v) for v in value)
    return value


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(state=st.dictionaries(st.text(min_size=1, max_size=6),
                             st.dictionaries(keys, values, max_size=4), min_size=1, max_size=3),
       extra_values=extra)
@pytest.mark.slow
def test_whatever_save_accepts_restore_gives_back_exactly(state: dict[str, Any],
                                                          extra_values: dict[str, Any]) -> None:
    ts = cp.TrainState(step=1, extra=extra_values)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        save(root, state, ts)
        live: dict[str, Any] = {name: {} for name in state}
        result = restore(root, live)
    assert list(live) == list(state)
    for name, value in state.items():
        assert_same(live[name], _expected(value), name)
    assert_same(dict(result.train_state.extra), extra_values, "train_state/extra")
