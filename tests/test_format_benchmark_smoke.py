"""The format benchmark at its quick size: it runs, checks what it restored, and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_format_cpu.py"

pytestmark = pytest.mark.slow  # a few dozen saves and restores in a child process


def test_the_format_benchmark_runs_quick(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--cases", "count_100", "--cases", "view",
         "--cases", "tied", "--dir", str(tmp_path / "work"), "--out", str(out)],
        cwd=BENCH.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert set(cases) == {"count_100", "view", "tied"}
    for name, case in cases.items():
        assert not case.get("errors"), (name, case.get("errors"))
        assert all(case["restore_check"].values()), (name, case["restore_check"])
        for method in ("ckpt_save_commit", "ckpt_restore_cold", "ckpt_restore_warm",
                       "torch_save", "torch_load_warm", "plain_read_fresh_cold",
                       "direct_write_threads"):
            assert method in case["results"], (name, method)
    for name in ("view", "tied"):
        alias = cases[name]["alias"]
        assert alias["ckpt_restore"]["aliased"] is True, alias
    assert cases["view"]["ratios"]["shard_less_header_over_unique"] <= 1.05
