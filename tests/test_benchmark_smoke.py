"""The training benchmark at its small size on the CPU: it runs and reports, no timing checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_training.py"
# dcp_async_save_pinned needs an accelerator for its non-blocking staging copies.
VARIANTS = ("ckpt_pipeline", "ckpt_pipeline_2slots", "ckpt_pipeline_streamed", "torch_save",
            "dcp_save", "dcp_async_save")

pytestmark = pytest.mark.slow  # trains every variant in child processes: the slow suite


def test_the_training_benchmark_runs_small_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "small.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--small", "--variants", ",".join(VARIANTS),
         "--pipeline-chunk-mb", "1", "--streamed-buffer-mb", "2", "--dir", str(tmp_path / "work"),
         "--out", str(out)],
        cwd=BENCH.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {} or report["errors"] == [], report["errors"]
    for key in ("none", *VARIANTS, "none_end"):
        variant = report["variants"][key]
        assert len(variant["step_end_s"]) == report["config"]["steps"], key
    for key in VARIANTS:
        assert report["summary"][key]["saves"] == report["config"]["steps"] // report[
            "config"]["every"], key
    pipeline = report["variants"]["ckpt_pipeline"]
    assert pipeline["restore_check"]["ok"] is True
    assert set(report["targets"]) == {"overhead", "blocking", "snapshot", "durable", "restore",
                                      "memory"}
    assert set(report["targets_by_variant"]) == {k for k in VARIANTS if k.startswith("ckpt")}
    assert "targets (ckpt_pipeline, default configuration)" in proc.stdout
    assert not list((tmp_path / "work").glob("**/*.shard")), "the benchmark removes its files"
