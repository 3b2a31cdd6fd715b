"""A restore that exchanges bits instead of copying (``backups.SwappedBackup``): a large live
tensor that does not own its memory (a view, an FSDP2 shard, a module parameter made from a
flat buffer) gets the checkpoint's bits by an exchange with the restored tensor, which then
holds the old bits and is the rollback backup: nothing is copied to fresh memory, and a rollback
still leaves the live state bit-identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_pipeline as cp
import ckpt_pipeline._restore.backups as backups
from ckpt_pipeline._restore.apply import apply_state
from ckpt_pipeline._restore.validate import validate_state
from ckpt_pipeline._tree import flatten_state
from tests.restore.test_restore_atomic import Flaky, Snapshot, restore_fails, save

pytestmark = pytest.mark.timeout(60)

ROWS, COLS = 640, 1000  # 2.56 MB a tensor: above ADOPT_MIN_BYTES


def _viewed_module(flat: torch.Tensor) -> nn.Module:
    """A module whose weight and bias are contiguous views of ``flat`` (as a flat parameter
    or an FSDP2 shard is): they do not own their memory, so they cannot be adopted."""
    module = nn.Linear(COLS, ROWS)
    module.weight = nn.Parameter(flat[:ROWS * COLS].view(ROWS, COLS))
    module.bias = nn.Parameter(flat[ROWS * COLS:ROWS * COLS + ROWS])
    return module


def _state(seed: float, **extra: Any) -> dict[str, Any]:
    base = torch.full((3 * ROWS, COLS), seed)
    base[1].add_(1)
    flat = torch.full((ROWS * COLS + ROWS + 8,), seed + 0.5)
    return {"views": {"first": base[:ROWS], "second": base[ROWS:2 * ROWS]},
            "model": _viewed_module(flat), **extra}


def _clones(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte size of every backup copy the restore makes from now on."""
    sizes: list[int] = []
    original = backups.exact_clone

    def counted(t: torch.Tensor, device: Any = None) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return original(t, device)

    monkeypatch.setattr(backups, "exact_clone", counted)
    return sizes


def test_views_and_module_views_take_the_checkpoint_by_exchange_and_undo_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    saved = _state(1.0)
    flat = flatten_state(saved, step=1)
    live = _state(2.0)
    before = Snapshot(live)
    tensors = [t.clone() for t in flat.tensors]  # private to the restore, as a read's are
    validate_state(live, flat.skeleton, tensors, step=1)
    old = {"views/first": live["views"]["first"].clone(),
           "views/second": live["views"]["second"].clone(),
           "model/weight": live["model"].weight.detach().clone()}
    clones = _clones(monkeypatch)
    applied = apply_state(live, flat.skeleton, tensors, step=1)
    swapped = [b for b in applied._journal if isinstance(b, backups.SwappedBackup)]
    # the bias is below ADOPT_MIN_BYTES: copied, as small tensors are
    assert sorted(b.path for b in swapped) == ["model/weight", "views/first", "views/second"]
    assert [n for n in clones if n >= backups.ADOPT_MIN_BYTES] == []  # nothing large copied
    assert Snapshot(live).values == Snapshot(saved).values
    for b in swapped:  # the restored memory now holds the old bits
        assert torch.equal(b.old, old[b.path])
    applied.undo()
    before.assert_unchanged(live)


def test_a_failed_restore_after_exchanges_leaves_the_live_state_bit_identical(
        root: Path) -> None:
    save(root, _state(1.0, custom=Flaky(1.0)))
    live = _state(2.0, custom=Flaky(2.0, fail=True))  # fails after the exchanges
    error = restore_fails(root, live, "injected: version 1, this object takes version 2")
    assert error.path == "custom"
    with cp.CheckpointPipeline(root) as pipe:  # and a restore that works loads it all
        live = _state(3.0, custom=Flaky(3.0))
        assert pipe.restore_latest(live) is not None
    assert Snapshot({k: v for k, v in live.items() if k != "custom"}).values == \
        Snapshot(_state(1.0)).values


def test_a_restored_tensor_used_twice_is_copied_not_exchanged(root: Path) -> None:
    """Tied entries: both live slots hold one view, saved once; an exchange would hand the
    second slot the old bits."""
    base = torch.full((2 * ROWS, COLS), 1.0)
    tied = base[:ROWS]
    save(root, {"a": tied, "b": tied, "other": base[ROWS:]})
    live_base = torch.zeros(2 * ROWS, COLS)
    live_tied = live_base[:ROWS]
    live = {"a": live_tied, "b": live_tied, "other": live_base[ROWS:]}
    with cp.CheckpointPipeline(root) as pipe:
        assert pipe.restore_latest(live) is not None
    assert torch.equal(live_base, base)
    assert live["a"] is live_tied and live["b"] is live_tied


class _DataStateDict(nn.Linear):
    """A module whose ``state_dict()`` gives its parameters' ``.data``: the same memory with a
    version counter of its own (as FSDP2's sharded parameters do), so the counter an exchange
    advances is not the one the backup reads."""

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        for name, param in self._parameters.items():
            if param is not None:
                destination[prefix + name] = param if keep_vars else param.data


def test_a_module_whose_state_dict_has_other_version_counters_is_not_copied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def module(value: float) -> nn.Module:
        flat = torch.full((ROWS * COLS + ROWS,), value)
        m = _DataStateDict(COLS, ROWS)
        m.weight = nn.Parameter(flat[:ROWS * COLS].view(ROWS, COLS))
        m.bias = nn.Parameter(flat[ROWS * COLS:])
        return m

    saved = {"model": module(1.0)}
    flat = flatten_state(saved, step=1)
    live = {"model": module(2.0)}
    before = Snapshot(live)
    tensors = [t.clone() for t in flat.tensors]
    validate_state(live, flat.skeleton, tensors, step=1)
    clones = _clones(monkeypatch)
    applied = apply_state(live, flat.skeleton, tensors, step=1)
    assert [b.path for b in applied._journal if isinstance(b, backups.SwappedBackup)] == \
        ["model/weight"]
    # the weight's old bits are the exchanged memory: no copy of it, whatever its counter
    assert [n for n in clones if n >= backups.ADOPT_MIN_BYTES] == []
    assert Snapshot(live).values == Snapshot(saved).values
    applied.undo()
    before.assert_unchanged(live)
