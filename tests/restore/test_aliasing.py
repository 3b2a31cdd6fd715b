"""Restoring into live tensors that share memory: the examples behind the property test.

(``test_aliasing_property.py`` covers random views, dtypes and aliasing; these name the cases.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp

pytestmark = pytest.mark.timeout(60)


def _save(root: Path, state: dict[str, Any]) -> None:
    with cp.CheckpointPipeline(root, capture_rng=False) as pipe:
        pipe.save(1, state).result(30)


def _restore(root: Path, live: dict[str, Any]) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        assert pipe.restore_latest(live, restore_rng=False) is not None


def test_a_bool_view_of_a_byte_tensor_gets_back_every_byte(root: Path) -> None:
    saved = torch.tensor([0, 1, 2, 255, 7, 3, 128, 64], dtype=torch.uint8)
    _save(root, {"bytes": saved, "flags": saved.view(torch.bool)[::2],
                 "alone": saved.clone().view(torch.bool)[1::3]})
    live_bytes = torch.zeros(8, dtype=torch.uint8)
    alone = torch.zeros(8, dtype=torch.uint8)
    live = {"bytes": live_bytes, "flags": live_bytes.view(torch.bool)[::2],
            "alone": alone.view(torch.bool)[1::3]}
    _restore(root, live)
    assert live_bytes.tolist() == saved.tolist()
    assert alone[1::3].tolist() == saved[1::3].tolist()  # 1, 7, 64: not made 0 or 1


def test_float_and_int_views_keep_nan_payloads(root: Path) -> None:
    bits = torch.tensor([0x7FC00001, 0x7F800001, -0x400FFFFF, 0x3F800000], dtype=torch.int32)
    floats = bits.clone().view(torch.float32)  # NaNs with payloads, a signalling one too
    _save(root, {"f": floats, "i": floats.view(torch.int32)})
    memory = torch.zeros(4, dtype=torch.float32)
    _restore(root, {"f": memory, "i": memory.view(torch.int32)})
    assert memory.view(torch.int32).tolist() == bits.tolist()


def test_live_tensors_that_alias_unlike_the_saved_ones_are_refused_untouched(
        root: Path) -> None:
    _save(root, {"a": torch.arange(4.0), "b": torch.arange(4, dtype=torch.int32)})
    memory = torch.full((4,), 9.0)
    live = {"a": memory, "b": memory.view(torch.int32)}
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.StateError) as info:
        pipe.restore_latest(live, restore_rng=False)
    message = str(info.value)
    assert "'a'" in message and "'b'" in message and "share memory" in message
    assert info.value.path == "a" and info.value.step == 1
    assert memory.tolist() == [9.0] * 4  # nothing was written


def test_tensors_saved_apart_restore_into_tied_ones_when_their_bytes_agree(
        root: Path) -> None:
    weight = torch.randn(3, 4)
    _save(root, {"embed": weight, "head": weight.clone()})  # untied, equal
    tied = torch.zeros(3, 4)
    _restore(root, {"embed": tied, "head": tied})
    assert torch.equal(tied, weight)


def test_overlapping_slices_and_a_transposed_view_restore_exactly(root: Path) -> None:
    base = torch.randn(6, 4)
    _save(root, {"base": base, "rows": base[1:4], "t": base.t(), "col": base[:, 2]})
    memory = torch.zeros(6, 4)
    _restore(root, {"base": memory, "rows": memory[1:4], "t": memory.t(),
                    "col": memory[:, 2]})
    assert torch.equal(memory.view(torch.int32), base.view(torch.int32))


def test_an_expanded_live_tensor_takes_values_that_are_the_same_along_it(root: Path) -> None:
    _save(root, {"row": torch.tensor([[1.0, 2.0, 3.0]] * 4)})
    memory = torch.zeros(1, 3)
    _restore(root, {"row": memory.expand(4, 3)})
    assert memory.tolist() == [[1.0, 2.0, 3.0]]
