"""``cp.load`` (a checkpoint read without live objects) and ``pipe.restore(state, step=N)``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _save(root: Path, steps: list[int], **options: Any) -> dict[int, dict[str, Any]]:
    """Save ``steps``, each with other weights, a loss in ``extra`` and its own RNG state."""
    saved: dict[int, dict[str, Any]] = {}
    options.setdefault("keep_last", 10)
    with cp.CheckpointPipeline(root, direct_io=False, **options) as pipe:
        for step in steps:
            model = _model(step)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(torch.randn(2, 16)).sum().backward()
            opt.step()
            torch.manual_seed(1000 + step)
            state = {"model": model, "optim": opt, "meta": {"name": f"s{step}", "ids": [1, 2]}}
            pipe.save(step, state, cp.TrainState(step=step, consumed_train_samples=8 * step,
                                                 extra={"loss": 1.0 / step})).result(60)
            saved[step] = {"model": {k: v.detach().clone()
                                     for k, v in model.state_dict().items()},
                           "rng": torch.get_rng_state()}
    return saved


def _files(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root``: (size, mtime_ns, mode)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            info = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (
                info.st_size, info.st_mtime_ns, info.st_mode)
    return out


# ------------------------------------------------------------------------------ cp.load


def test_load_gives_the_newest_step_as_saved_without_touching_root_or_rng(
    tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    saved = _save(root, [10, 20])
    before = _files(root)
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    loaded = cp.load(root)
    assert torch.equal(torch.get_rng_state(), rng)  # nothing was drawn or set
    assert _files(root) == before  # nothing written, renamed or removed
    assert loaded.step == 20 and loaded.rank == 0 and loaded.world_size == 1
    assert loaded.train_state.step == 20 and loaded.train_state.consumed_train_samples == 160
    assert loaded.train_state.extra == {"loss": 0.05}
    model = loaded.tree["model"]
    assert model.keys() == saved[20]["model"].keys()
    assert all(torch.equal(model[k], saved[20]["model"][k]) for k in model)
    assert all(t.device.type == "cpu" for t in model.values())
    assert loaded.tree["meta"] == {"name": "s20", "ids": [1, 2]}
    optim = loaded.tree["optim"]
    assert set(optim) == {"state", "param_groups"} and len(optim["state"]) == 4
    # The RNG state saved with the step is in the TrainState, not applied.
    assert loaded.train_state.rng is not None
    assert loaded.train_state.rng.torch_cpu == saved[20]["rng"].numpy().tobytes()


def test_load_a_chosen_step_and_errors_name_step_and_path(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved = _save(root, [10, 20])
    loaded = cp.load(root, 10)
    assert loaded.step == 10
    assert all(torch.equal(loaded.tree["model"][k], v) for k, v in saved[10]["model"].items())
    with pytest.raises(cp.CheckpointError) as info:
        cp.load(root, 15)
    assert info.value.step == 15 and str(root) in str(info.value)
    assert "20, 10" in str(info.value)  # what there is
    with pytest.raises(cp.CheckpointError, match="no committed step of rank 3"):
        cp.load(root, rank=3)
    with pytest.raises(cp.CheckpointError, match="not a checkpoint root"):
        cp.load(tmp_path / "nothing-here")


def test_load_verifies_every_byte(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, [10])
    shard = root / "step-0000000010" / "rank-00000.shard"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0x01  # inside the data region, away from preamble and header
    shard.write_bytes(bytes(data))
    with pytest.raises(cp.CheckpointIntegrityError) as info:
        cp.load(root)
    assert info.value.step == 10 and "checksum" in str(info.value)


def test_load_works_while_a_pipeline_has_the_root_open(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, [10])
    with cp.CheckpointPipeline(root, direct_io=False) as pipe:
        assert cp.load(root).step == 10
        pipe.save(11, {"w": torch.ones(3)}, cp.TrainState(step=11)).result(60)
        loaded = cp.load(root)
        assert loaded.step == 11 and torch.equal(loaded.tree["w"], torch.ones(3))


@pytest.mark.asyncio
async def test_load_runs_inside_an_event_loop(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, [10])
    assert cp.load(root).step == 10  # not "cannot be called from a running event loop"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_to_the_gpu_with_map_location(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved = _save(root, [10])
    loaded = cp.load(root, map_location="cuda")
    model = loaded.tree["model"]
    assert all(t.is_cuda for t in model.values())
    assert all(torch.equal(model[k].cpu(), v) for k, v in saved[10]["model"].items())


# ---------------------------------------------------------------------- restore(step=N)


def test_restore_a_chosen_step_moves_newer_ones_aside_and_the_run_goes_on(
    tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    saved = _save(root, [10, 20, 30])
    model = _model(999)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with cp.CheckpointPipeline(root, direct_io=False, keep_last=10) as pipe:
        result = pipe.restore({"model": model, "optim": opt, "meta": {}}, step=20)
        assert result is not None and result.step == 20
        assert result.train_state.extra == {"loss": 0.05}
        assert all(torch.equal(model.state_dict()[k], v)
                   for k, v in saved[20]["model"].items())
        assert torch.equal(torch.get_rng_state(), saved[20]["rng"])  # restore_rng default
        names = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
        assert names[:2] == ["step-0000000010", "step-0000000020"]
        assert len(names) == 3 and names[2].startswith("step-0000000030.rewound-0000000020-")
        # The run goes on from step 20: the next save may be step 30 again.
        pipe.save(30, {"model": model, "optim": opt, "meta": {}},
                  cp.TrainState(step=30)).result(60)
    assert cp.load(root).step == 30


def test_restore_rng_per_call(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved = _save(root, [10])
    model = _model(1)
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters()), "meta": {}}
    with cp.CheckpointPipeline(root, direct_io=False) as pipe:
        torch.manual_seed(5)
        mine = torch.get_rng_state()
        pipe.restore_latest(state, restore_rng=False)
        assert torch.equal(torch.get_rng_state(), mine)
        pipe.restore(state, 10, restore_rng=True)
        assert torch.equal(torch.get_rng_state(), saved[10]["rng"])
    with cp.CheckpointPipeline(root, direct_io=False, restore_rng=False) as pipe:
        torch.manual_seed(6)
        mine = torch.get_rng_state()
        pipe.restore_latest(state)  # the pipeline's setting
        assert torch.equal(torch.get_rng_state(), mine)
        pipe.restore_latest(state, restore_rng=True)  # the call's, over the pipeline's
        assert torch.equal(torch.get_rng_state(), saved[10]["rng"])


def test_restore_of_a_step_that_is_not_there_fails_and_changes_nothing(
    tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    _save(root, [10, 20])
    before = _files(root)
    model = _model(999)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with cp.CheckpointPipeline(root, direct_io=False) as pipe:
        with pytest.raises(cp.RestoreError) as info:
            pipe.restore({"model": model}, step=15)
        with pytest.raises(cp.StepOrderError):
            pipe.restore({"model": model}, step=-1)
    assert info.value.step == 15 and "20, 10" in str(info.value)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    after = _files(root)
    assert {k for k in after if k.startswith("step-")} == {
        k for k in before if k.startswith("step-")}
