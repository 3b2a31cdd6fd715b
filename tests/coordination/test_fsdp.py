"""FSDP2 (DTensor) and DDP state through the pipeline, with real process groups."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.children import child_script, free_port, spawn_child

WORKER = child_script("fsdp_worker.py")


def _run_ranks(script: Path, world: int, *args: object, per_rank: Any = None) -> None:
    """Run ``world`` processes of ``script`` as the ranks of one gloo/NCCL job and wait for
    all; ``per_rank(rank)`` gives a rank's extra arguments."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        extra = [] if per_rank is None else per_rank(rank)
        procs.append(spawn_child(script, *args, *extra, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]


def _launch(kind: str, root: Path, world: int, device: str = "cpu",
            *extra: str) -> list[dict[str, Any]]:
    outs = [root / f"out-{r}.json" for r in range(world)]
    _run_ranks(WORKER, world, kind, "--root", root / "ckpt", "--device", device, *extra,
               per_rank=lambda rank: ["--out", outs[rank]])
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.slow
def test_fsdp2_sharded_state_restores_into_the_same_mesh(tmp_path: Path) -> None:
    results = _launch("fsdp", tmp_path, world=2)
    for r in results:
        assert r["restored_step"] == 2
        assert r["param_type"] == "DTensor" and r["optim_state_type"] == "DTensor"
        assert r["equal_after_restore"] and r["equal_after_next_step"]


@pytest.mark.slow
def test_load_consolidates_fsdp2_shards_into_full_tensors(tmp_path: Path) -> None:
    """Two gloo ranks save FSDP2 (DTensor) shards into one root, each keeping a copy of the
    other's (``replicas=1``); ``cp.load(consolidate=True)`` in this process assembles every
    parameter and optimizer moment in full, bit-exact, and still does with rank 1's own files
    gone (its node lost), from the copy rank 0 holds."""
    import numpy as np

    import ckpt_pipeline as cp

    results = _launch("fsdp", tmp_path, 2, "cpu", "--shared-root", "--replicas", "1")
    assert all(r["restored_step"] == 2 for r in results)
    full = np.load(tmp_path / "full.npz")
    loaded = cp.load(tmp_path / "ckpt", consolidate=True)
    assert loaded.step == 2 and loaded.rank is None and loaded.world_size == 2
    model = loaded.tree["model"]
    assert set(model) == set(full.files)
    for name in full.files:
        assert model[name].shape == full[name].shape, name
        assert torch.equal(model[name], torch.from_numpy(full[name])), name
    # One rank's own tree holds its shard only.
    shard = cp.load(tmp_path / "ckpt", rank=1).tree["model"]
    assert any(shard[n].shape != model[n].shape for n in model)
    moments = loaded.tree["optim"]["state"]
    assert all(v["exp_avg"].shape == model[k].shape
               for k, v in zip(model, moments.values(), strict=False))
    assert dict(loaded.copies) == {}

    step_dir = tmp_path / "ckpt" / "step-0000000002"
    assert sorted(p.name for p in step_dir.glob("replica-*.commit")) == [
        "replica-00000-on-00001.commit", "replica-00001-on-00000.commit"]
    for own in step_dir.glob("rank-00001.*"):
        own.unlink()
    survived = cp.load(tmp_path / "ckpt", consolidate=True)
    assert (survived.step, dict(survived.copies)) == (2, {1: 0})
    for name in full.files:
        assert torch.equal(survived.tree["model"][name], torch.from_numpy(full[name])), name
    for key, moment in survived.tree["optim"]["state"].items():
        assert torch.equal(moment["exp_avg"], moments[key]["exp_avg"]), key


@pytest.mark.slow
def test_load_consolidates_dtensors_of_a_two_dimensional_mesh(tmp_path: Path) -> None:
    """Four gloo ranks on a 2x2 DeviceMesh save DTensors sharded on rows and columns, HSDP
    style (replicated on one mesh dimension), uneven and with an empty shard;
    ``cp.load(consolidate=True)`` assembles each bit-exact, a tensor dimension sharded by both
    mesh dimensions too."""
    import numpy as np

    import ckpt_pipeline as cp

    _run_ranks(child_script("mesh_worker.py"), 4, "--root", tmp_path / "ckpt")
    full = np.load(tmp_path / "full.npz")
    loaded = cp.load(tmp_path / "ckpt", consolidate=True)
    assert (loaded.step, loaded.world_size) == (5, 4)
    model = loaded.tree["model"]
    for name in full.files:
        assert torch.equal(model[name], torch.from_numpy(full[name])), name
    assert torch.equal(model["plain"], torch.arange(4.0))
    shard = cp.load(tmp_path / "ckpt", rank=3).tree["model"]
    assert shard["rows_and_cols"].shape == (3, 2) and shard["one_row"].shape == (0, 3)
    twice = cp.load(tmp_path / "ckpt-twice", consolidate=True).tree["w"]
    assert torch.equal(twice, torch.arange(22.0).view(11, 2))  # nested splits of one dimension
    assert cp.load(tmp_path / "ckpt-twice", rank=3).tree["w"].shape == (2, 2)  # rows 9-10


@pytest.mark.slow
def test_ddp_state_restores_on_every_rank(tmp_path: Path) -> None:
    results = _launch("ddp", tmp_path, world=2)
    for r in results:
        assert r["restored_step"] == 2
        assert r["equal_after_restore"] and r["equal_after_next_step"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fsdp2_on_two_gpus_with_nccl_training_and_gloo_control_plane(tmp_path: Path) -> None:
    results = _launch("fsdp", tmp_path, world=2, device="cuda")
    for r in results:
        assert r["restored_step"] == 2
        assert r["param_device"].startswith(f"cuda:{r['rank']}")
        assert r["equal_after_restore"] and r["equal_after_next_step"]
    print("blocking seconds per rank:", {r["rank"]: r["blocking_s"] for r in results})
