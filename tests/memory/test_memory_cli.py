"""``ckpt-pipeline ls`` and ``clean`` on a memory tier's directory, and its per-rank lock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.cli import main

pytestmark = pytest.mark.timeout(60)


def test_ls_shows_memory_steps_and_usage_and_clean_removes_them(
        tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = cp.MemoryConfig(str(shm_dir), keep_files=True, disk_every=100)
    with cp.CheckpointPipeline(tmp_path / "root", memory=config) as pipe:
        for step in (1, 2, 3):
            pipe.save(step, {"w": torch.full((4096,), float(step))}).result(30)
        pipe.wait(30)
        assert main(["ls", str(shm_dir), "--json"]) == 0
        listing = json.loads(capsys.readouterr().out)
        assert [s["step"] for s in listing["steps"]] == [3]  # keep=1
        assert listing["steps"][0]["status"] == "complete"
        usage = listing["memory_tier"]
        assert usage["ranks"] == [0] and usage["bytes_in_use"] > 0 and usage["free_bytes"] > 0
        assert main(["clean", str(shm_dir)]) == 1  # rank 0's pipeline is open: left alone
        assert "in use by a running pipeline" in capsys.readouterr().out
        assert (shm_dir / "step-0000000003").is_dir()
    assert main(["ls", str(tmp_path / "root"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_tier"] is None  # a disk root
    assert main(["clean", str(shm_dir)]) == 0
    assert "rank 0: removed" in capsys.readouterr().out
    assert not shm_dir.exists()


def test_clean_refuses_a_directory_that_is_not_a_memory_tier(tmp_path: Path) -> None:
    with cp.CheckpointPipeline(tmp_path) as pipe:
        pipe.save(1, {"w": torch.ones(10)}).result(30)
    assert main(["clean", str(tmp_path)]) == 2
    assert (tmp_path / "step-0000000001").is_dir()


def test_two_pipelines_cannot_share_one_rank_of_a_memory_directory(
        tmp_path: Path, shm_dir: Path) -> None:
    with cp.CheckpointPipeline(tmp_path / "a", memory=str(shm_dir)):
        other = cp.CheckpointPipeline(tmp_path / "b", memory=str(shm_dir))
        with pytest.raises(cp.RootInUseError, match="in use by another open pipeline"):
            other.__enter__()


def test_a_memory_directory_reads_as_a_root_with_load_and_verify(
        tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = cp.MemoryConfig(str(shm_dir), keep_files=True, disk_every=100)
    with cp.CheckpointPipeline(tmp_path / "root", memory=config) as pipe:
        for step in (1, 2, 3):
            pipe.save(step, {"w": torch.full((64,), float(step))}).result(30)
        pipe.wait(30)
        loaded = cp.load(shm_dir)  # the newest memory step, every byte verified
        assert loaded.step == 3 and torch.equal(loaded.tree["w"], torch.full((64,), 3.0))
        assert main(["verify", str(shm_dir)]) == 0
    assert "OK" in capsys.readouterr().out
