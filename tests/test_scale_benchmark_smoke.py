"""The scale benchmark at its smallest: four gloo ranks, three saves; it runs and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_scale.py"

pytestmark = pytest.mark.slow  # four processes that each import torch and join a gloo job

PER_SAVE = ("blocking_s", "save_call_s", "seal_s", "commit_stage_s", "durable_s")
ONCE = ("construct_s", "open_s", "restore_s", "close_s")


@pytest.mark.timeout(300)
def test_the_scale_benchmark_runs_four_ranks(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--ranks", "4", "--replicas", "0", "--saves", "3",
         "--dir", str(tmp_path / "work"), "--timeout-s", "240", "--out", str(out)],
        cwd=BENCH.parent, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_count"] >= 1
    assert report["machine"]["torch"]
    assert report["args"]["saves"] == 3
    [config] = report["configs"]
    assert (config["ranks"], config["replicas"], config["status"]) == (4, 0, "ok"), config
    assert config["exit_codes"] == [0, 0, 0, 0]
    assert config["ranks_reported"] == 4
    assert sorted(r["rank"] for r in config["per_rank"]) == [0, 1, 2, 3]
    assert config["restore_ok_all"] is True
    aggregates = config["aggregates"]
    for key in (*PER_SAVE, *ONCE):
        spread = aggregates[key]
        assert 0 < spread["min_over_ranks"] <= spread["median_over_ranks"] \
            <= spread["max_over_ranks"] < 60, (key, spread)
    for row in config["per_rank"]:
        assert row["saves_measured"] == 2  # the warm-up save left out
        assert row["restore_ok"] is True
        # the commit stage comes after the shard is sealed and before the commit is known
        assert row["commit_stage_s"] < row["durable_s"], row
        assert row["blocking_s"] <= row["durable_s"], row
    vote = config["cross_rank"]["commit_after_last_shard_s"]
    assert vote["samples"] == 2 and 0 < vote["median"] < 60
    assert config["memory"]["rss_peak_mib_max"] > 0
    assert "commit" in proc.stdout.splitlines()[-3]  # the table's header, then one row
    assert proc.stdout.splitlines()[-1].split()[:3] == ["4", "0", "ok"]
