"""A reshard's reads straight into the live tensors (``_restore/inplace.py``): each region is
copied aside before it is written, the apply takes those copies into its journal instead of
exchanging bits, and every way a restore can fail after the writes puts the live bits back.
The reshards themselves (DTensors over real gloo ranks) are in ``tests/reshard``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_pipeline._format.documents import TensorRef
from ckpt_pipeline._restore.apply import apply_state
from ckpt_pipeline._restore.inplace import Prewrites, overlapping
from ckpt_pipeline.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)

N = 1 << 19  # 2 MiB of float32: above ADOPT_MIN_BYTES


class Refuses:
    """A stateful object whose load_state_dict refuses the checkpoint's value (its own, from
    the rollback, it takes): the apply must undo what it did before."""

    def state_dict(self) -> dict[str, Any]:
        return {"x": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state != {"x": 1}:
            raise ValueError("refused")


def _written(live: torch.Tensor, new: torch.Tensor) -> Prewrites:
    """``live`` read into as a reshard does: two ranges, each copied aside first."""
    prewrites = Prewrites()
    before = prewrites.add(0, live, "a")
    for part in (slice(0, N // 2), slice(N // 2, N)):
        before(live[part])
        live[part].copy_(new[part])
    return prewrites


def test_a_failed_apply_puts_back_what_the_reshard_read_into() -> None:
    original = torch.randn(N)
    live: dict[str, Any] = {"a": original.clone(), "obj": Refuses()}
    new = torch.randn(N)
    prewrites = _written(live["a"], new)
    assert torch.equal(live["a"], new)
    with pytest.raises(CheckpointError, match="every change was undone"):
        apply_state(live, {"a": TensorRef(0), "obj": {"x": 2}}, [live["a"]], step=5,
                    prewrites=prewrites)
    assert torch.equal(live["a"], original)


def test_an_applied_reshard_is_undone_later_and_kept_when_released() -> None:
    original = torch.randn(N)
    for keep in (False, True):
        live: dict[str, Any] = {"a": original.clone()}
        memory = live["a"].data_ptr()
        new = torch.randn(N)
        applied = apply_state(live, {"a": TensorRef(0)}, [live["a"]], step=5,
                              prewrites=_written(live["a"], new))
        assert live["a"].data_ptr() == memory and torch.equal(live["a"], new)
        assert applied.backup_bytes == 4 * N  # the copies taken before the writes
        if keep:
            applied.release()
            assert torch.equal(live["a"], new)
        else:
            applied.undo()
            assert torch.equal(live["a"], original)


def test_undo_puts_back_only_the_regions_written() -> None:
    """A reshard that failed half way: the half written is put back, the other half (never
    copied aside) is left as it is, not overwritten with the backup's unset memory."""
    original = torch.randn(N)
    live = original.clone()
    prewrites = Prewrites()
    before = prewrites.add(0, live, "a")
    before(live[:N // 4])
    live[:N // 4].fill_(7.0)
    assert prewrites.written_bytes == N
    prewrites.undo(step=5, rank=0)
    assert torch.equal(live, original)
    assert prewrites.written_bytes == 0  # nothing is left to undo twice


def test_an_undo_that_fails_for_one_tensor_names_it_and_puts_back_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Putting back tensor "a" fails (injected: a real copy between host tensors does not
    fail on demand): the error names "a" (its path too) and says the state is partly loaded,
    and "b" is put back all the same."""
    from ckpt_pipeline._restore import inplace

    originals = {name: torch.randn(N) for name in ("a", "b")}
    live = {name: t.clone() for name, t in originals.items()}
    prewrites = Prewrites()
    for index, name in enumerate(live):
        before = prewrites.add(index, live[name], name)
        before(live[name])
        live[name].fill_(7.0)
    real = inplace._Entry.restore

    def restore(entry: Any) -> None:
        if entry.path == "a":
            raise RuntimeError("injected: the copy back failed")
        real(entry)

    monkeypatch.setattr(inplace._Entry, "restore", restore)
    with pytest.raises(CheckpointError, match="partly loaded") as info:
        prewrites.undo(step=5, rank=1)
    assert info.value.path == "a" and info.value.step == 5 and info.value.rank == 1
    assert "a: RuntimeError: injected" in info.value.message
    assert torch.equal(live["b"], originals["b"])


def test_overlapping_ranges_are_found_in_one_sweep() -> None:
    """The live tensors a reshard may read straight into share memory with no other: every
    range that touches another is found, the ones that only abut are not, and a range listed
    twice (a tied weight reached twice) overlaps itself."""
    ranges = [(0, 100), (10, 20), (200, 300), (300, 400), (450, 460), (450, 460), (500, 500),
              (40, 55), (95, 210)]
    assert overlapping(ranges) == {(0, 100), (10, 20), (40, 55), (95, 210), (200, 300),
                                   (450, 460)}
    assert overlapping([(0, 10), (10, 20)]) == set()
    brute = {r for i, r in enumerate(ranges) if r[1] > r[0] and any(
        i != j and o[1] > o[0] and r[0] < o[1] and o[0] < r[1] for j, o in enumerate(ranges))}
    assert overlapping(ranges) == brute


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)).map(
    lambda p: (p[0], p[0] + p[1])), max_size=12))
def test_overlapping_agrees_with_comparing_every_pair(ranges: list[tuple[int, int]]) -> None:
    brute = {r for i, r in enumerate(ranges) if r[1] > r[0] and any(
        i != j and o[1] > o[0] and r[0] < o[1] and o[0] < r[1] for j, o in enumerate(ranges))}
    assert overlapping(ranges) == brute
