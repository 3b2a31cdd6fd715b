"""The multi-process launcher of the replication suites: one process per rank of
``tests/children/replica_worker.py``, with real gloo process groups, one root per rank."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests._support.children import free_port, spawn_child

__all__ = ("DEADLINE_S", "WORKER", "assert_restored", "launch", "step_dir")

WORKER = "replica_worker.py"
DEADLINE_S = 150.0


def launch(phase: str, root: Path, logs: Path, *, world: int = 4, nodes: int = 2,
           replicas: int = 1, steps: str = "10,20", args: Sequence[str] = (),
           env: Mapping[int, Mapping[str, str]] | None = None,
           codes: Mapping[int, int] | None = None) -> dict[int, dict[str, Any]]:
    """Run one phase on every rank; each must exit with ``codes`` (default 0); return each
    rank's JSON (ranks that wrote none are missing)."""
    logs.mkdir(parents=True, exist_ok=True)
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            procs.append(spawn_child(
                WORKER, "--phase", phase, "--root", root, "--nodes", nodes, "--replicas",
                replicas, "--steps", steps, *args, "--out", logs / f"rank-{rank}.json",
                stdout=logs / f"rank-{rank}.log", stderr=subprocess.STDOUT,
                env={**base, "RANK": str(rank), **((env or {}).get(rank, {}))}))
        started = time.monotonic()
        got = {}
        for rank, proc in enumerate(procs):
            try:
                got[rank] = proc.wait(max(1.0, started + DEADLINE_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still runs after {DEADLINE_S} s\n"
                            + _describe(logs, world))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    expected = {r: (codes or {}).get(r, 0) for r in range(world)}
    assert got == expected, _describe(logs, world)
    return {r: json.loads((logs / f"rank-{r}.json").read_text())
            for r in range(world) if (logs / f"rank-{r}.json").exists()}


def _describe(logs: Path, world: int) -> str:
    return "\n".join(f"--- rank {r}:\n"
                     + (logs / f"rank-{r}.log").read_text(errors="replace")[-3000:]
                     for r in range(world) if (logs / f"rank-{r}.log").exists())


def step_dir(root: Path, rank: int, step: int) -> Path:
    return root / f"rank-{rank}" / f"step-{step:010d}"


def assert_restored(results: dict[int, dict[str, Any]], saved: dict[int, dict[str, Any]],
                    step: int, fetched: Mapping[int, int]) -> None:
    """Every rank restored ``step`` exactly: values, TrainState, RNG; shards fetched as
    listed (the same list on every rank)."""
    for rank, out in sorted(results.items()):
        restore = out["restore"]
        assert restore["ok"], (rank, restore)
        assert restore["step"] == step, (rank, restore)
        assert restore["mismatches"] == [], (rank, restore)
        assert restore["train_state"] == {"step": step, "consumed": step * 16,
                                          "extra": {"tag": f"s{step}"}}
        assert restore["rng"] == saved[rank]["saves"][str(step)]["rng"], rank
        assert restore["fetched"] == {str(k): v for k, v in fetched.items()}, (rank, restore)
