"""The reshard benchmark: its check of the restored bytes, and a small run (no timing checked)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
BENCH = BENCHMARKS / "bench_reshard.py"


@pytest.mark.timeout(60)
def test_the_reshard_check_catches_a_flipped_bit_a_shifted_slice_and_a_wrong_shape(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    worker = importlib.import_module("_reshard_worker")
    spec = next(s for s in worker.layout(64 << 20) if s.shape[0] % 4 == 1)  # uneven over 4
    start, end = worker.rows_of(spec.shape[0], 4, 1)
    local = torch.empty((end - start, *spec.shape[1:]))
    worker.fill(local, spec, 4, 1)
    assert worker.mismatch(local, spec, 4, 1) is None
    flipped = local.clone()
    flipped.view(torch.int32).view(-1)[12345] ^= 1
    assert worker.mismatch(flipped, spec, 4, 1) is not None
    shifted = torch.empty_like(local)
    worker.fill(shifted, spec, 4, 0)  # rank 0's rows, where rank 1's belong
    assert worker.mismatch(shifted, spec, 4, 1) is not None
    assert "local shape" in str(worker.mismatch(local[1:], spec, 4, 1))

@pytest.mark.slow  # two saves and four restores, each a job of 2 or 4 ranks
@pytest.mark.timeout(300)
def test_the_reshard_benchmark_runs_small(tmp_path: Path) -> None:
    out = tmp_path / "reshard.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--total-mib", "4", "--repeats", "1",
         "--cases", "4to2,2to2", "--root", str(tmp_path / "work"), "--out", str(out)],
        cwd=BENCH.parent, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == []
    for case in ("4to2", "2to2"):
        for lib in ("ckpt_pipeline", "dcp"):
            (sample,) = report["samples"][case][lib]
            assert sample["problems"] == [] and sample["seconds"] > 0, (case, lib)
    assert set(report["ratios"]) >= {"ckpt_pipeline_4to2_over_2to2",
                                     "dcp_over_ckpt_pipeline_4to2"}
    assert "ckpt_pipeline_4to2_over_2to2" in proc.stdout
    assert not list((tmp_path / "work").glob("**/*.shard")), "the benchmark removes its files"
