"""Resharding CUDA DTensors (issue 26): two gloo ranks sharing the one GPU save, one rank
restores (tests/children/reshard_gpu_worker.py says how the ranks share the device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._support.children import child_script
from tests.coordination.test_fsdp import _run_ranks

WORKER = child_script("reshard_gpu_worker.py")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(("saved", "live"), [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_cuda_dtensors_reshard_onto_another_number_of_gpu_ranks(
        tmp_path: Path, saved: int, live: int) -> None:
    """Every element of the row-split (uneven), column-split and replicated matrices lands
    where it belongs, on the GPU."""
    _run_ranks(WORKER, saved, "save", "--root", tmp_path / "ckpt")
    outs = [tmp_path / f"out-{r}.json" for r in range(live)]
    _run_ranks(WORKER, live, "restore", "--root", tmp_path / "ckpt",
               per_rank=lambda rank: ["--out", outs[rank]])
    for out in outs:
        result = json.loads(out.read_text())
        assert result["resharded_from"] == saved and result["step"] == 1
        assert all(result["right"].values()), result
