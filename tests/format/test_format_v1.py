"""Checkpoints written in format 1 (before 2026-12) still restore, verify and list.

``fixtures/format-v1/`` was written by ``fixtures/make_v1.py`` with the code of that time: a
model with a tied weight, AdamW state, a tensor and a view of it, several dtypes, an empty
tensor, plain values, a TrainState with ``extra`` and the RNG states. ``expected.json`` holds
the sha256 of every tensor's bytes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_pipeline as cp
from ckpt_pipeline.cli import main as cli_main
from tests._support.states import tensor_hashes

FIXTURE = Path(__file__).parent / "fixtures" / "format-v1"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A private copy of the fixture (restore may move steps aside; git keeps no modes)."""
    target = tmp_path / "root"
    shutil.copytree(FIXTURE / "root", target)
    for dirpath, _dirs, files in os.walk(target):
        os.chmod(dirpath, 0o700)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o600)
    return target


def _fresh_state() -> dict[str, Any]:
    torch.manual_seed(99)  # other values than the saved ones
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8),
                          nn.Linear(8, 16))
    model[3].weight = model[0].weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt, "extras": {}}


@pytest.mark.slow
def test_a_format_1_checkpoint_restores_bit_exact(root: Path) -> None:
    expected = json.loads((FIXTURE / "expected.json").read_text())
    state = _fresh_state()
    random.seed(12345)
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(state)
    assert result is not None and result.step == expected["step"] and not result.rejected
    assert result.train_state.extra == {"loss": 0.25, "note": "v1"}
    assert result.train_state.consumed_train_samples == 112
    assert random.random() == expected["python_random_next"]  # the RNG states came back
    assert tensor_hashes(state) == expected["tensors"]
    model = state["model"]
    assert model[3].weight is model[0].weight  # the live tie is kept
    extras = state["extras"]
    assert extras["plain"] == [1, "two", 3.0, None, (4, b"five")]
    assert extras["scalar"].dtype == torch.float64 and extras["scalar"].dim() == 0


def test_a_format_1_checkpoint_verifies_and_lists(root: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["verify", str(root)]) == 0
    assert cli_main(["ls", str(root), "--json"]) == 0
    listed = capsys.readouterr().out
    assert '"step": 7' in listed or '"step":7' in listed


@pytest.mark.slow
def test_a_new_save_next_to_a_format_1_step_is_format_2(root: Path) -> None:
    state = _fresh_state()
    with cp.CheckpointPipeline(root, keep_last=5) as pipe:
        assert pipe.restore_latest(state) is not None
        pipe.save(8, state, cp.TrainState(step=8)).result(30)
    shard = root / "step-0000000008" / "rank-00000.shard"
    with open(shard, "rb") as f:
        assert int.from_bytes(f.read(10)[8:10], "little") == 2
    again = _fresh_state()
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(again)
    assert result is not None and result.step == 8
    assert tensor_hashes(again) == tensor_hashes(state)
