"""Large CPU tensors take the restored memory instead of a copy, and give it back on failure.

A CPU tensor of at least 1 MiB that alone uses memory of exactly its size (no view of it, not
shared with another process, not pinned, not a file) is given the memory its checkpoint values
were read and verified into: no backup copy, no copy into it. Its old memory is its backup: a
failed restore gives it back, so the live state is as it was, pointers included. A tensor that
others look into (a view) is written in place as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_pipeline as cp
import ckpt_pipeline._restore.recovery as restore_module
from tests._support.children import child_script, load_script

Flaky = load_script(child_script("restore_atomic_worker.py")).Flaky

BIG = 512 * 1024  # float32 elements: 2 MiB


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 8))


def _state(seed: int, **extra: Any) -> dict[str, Any]:
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return {"w": torch.full((BIG,), float(seed)), "model": model, "optimizer": opt, **extra}


def _save(root: Path, state: dict[str, Any]) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(10, state, cp.TrainState(step=10)).result(60)


def _pointers(state: dict[str, Any]) -> dict[str, int]:
    out = {"w": state["w"].data_ptr()}
    out.update({k: p.data_ptr() for k, p in state["model"].named_parameters()})
    return out


def test_large_cpu_tensors_take_the_restored_memory(root: Path) -> None:
    saved = _state(1)
    _save(root, saved)
    live = _state(2)
    w, params = live["w"], list(live["model"].parameters())
    before = _pointers(live)
    with cp.CheckpointPipeline(root) as pipe:
        assert pipe.restore_latest(live) is not None
    assert live["w"] is w and list(live["model"].parameters()) == params
    assert torch.equal(live["w"], saved["w"])
    for (k, a), b in zip(saved["model"].state_dict().items(), live["model"].state_dict().values()):
        assert torch.equal(a, b), k
    after = _pointers(live)
    assert after["w"] != before["w"] and after["0.weight"] != before["0.weight"]
    assert after["1.weight"] == before["1.weight"]  # 16 KiB: copied into, as always
    # the optimizer still holds the parameters, and training goes on from the restored values
    opt = live["optimizer"]
    assert opt.param_groups[0]["params"][0] is params[0]
    weight = params[0].detach().clone()
    live["model"](torch.randn(4, 1024)).sum().backward()
    opt.step()
    assert not torch.equal(params[0], weight)


def test_a_failed_restore_gives_every_tensor_its_old_memory_back(root: Path) -> None:
    _save(root, _state(1, custom=Flaky(1.0)))
    live = _state(2, custom=Flaky(2.0, fail=True))
    before = _pointers(live)
    values = {k: v.clone() for k, v in live["model"].state_dict().items()}
    w = live["w"].clone()
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.StateError, match="injected"):
        pipe.restore_latest(live)
    assert _pointers(live) == before
    assert torch.equal(live["w"], w)
    for k, v in live["model"].state_dict().items():
        assert torch.equal(v, values[k]), k


def test_another_ranks_failure_gives_the_old_memory_back(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = restore_module.agree_outcome

    async def other_rank_failed(*args: Any, what: str, **kwargs: Any
                                ) -> tuple[dict[int, str], bool]:
        failures, fatal = await original(*args, what=what, **kwargs)
        if what == "restore apply":
            failures[1] = "injected: rank 1 could not load"
        return failures, fatal

    _save(root, _state(1))
    monkeypatch.setattr(restore_module, "agree_outcome", other_rank_failed)
    live = _state(2)
    before = _pointers(live)
    w = live["w"].clone()
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.RestoreError, match="rank 1"):
        pipe.restore_latest(live)
    assert _pointers(live) == before and torch.equal(live["w"], w)


@pytest.mark.parametrize("kind", ["view", "shared"])
def test_a_tensor_others_look_into_is_written_in_place(root: Path, kind: str) -> None:
    _save(root, {"w": torch.full((BIG,), 1.0)})
    live = {"w": torch.full((BIG,), 2.0)}
    if kind == "shared":
        live["w"].share_memory_()
    head = live["w"][:10]  # a view held elsewhere
    pointer = live["w"].data_ptr()
    with cp.CheckpointPipeline(root) as pipe:
        assert pipe.restore_latest(live) is not None
    assert live["w"].data_ptr() == pointer
    assert torch.equal(head, torch.ones(10))
    assert kind != "shared" or live["w"].is_shared()
