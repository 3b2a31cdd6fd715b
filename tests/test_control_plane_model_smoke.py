"""The control-plane model (benchmarks/model_control_plane.py): it runs, it reproduces what it
was calibrated on, and its protocols grow the way their structure says."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "model_control_plane.py"
SCALE = BENCH.parent / "results" / "scale.json"

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("model_control_plane", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def calibrated(model: ModuleType) -> tuple[Any, dict[str, Any]]:
    params, fit = model.calibrate(json.loads(SCALE.read_text()))
    return params, fit


def _commit(model: ModuleType, protocol: str, ranks: int, params: Any) -> float:
    seconds: float = model.simulate(protocol, ranks, 8, "commit", params)["seconds"]
    return seconds


@pytest.mark.slow  # simulates up to 1,000 ranks of every protocol: a second of the fast suite
def test_the_model_runs_for_a_few_sizes_and_prints_json(
        model: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.json"
    assert model.main(["--ranks", "8,64,1000", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert [row["ranks"] for row in printed["results"]] == [8, 64, 1000]
    for row in printed["results"]:
        for protocol in ("flat", "hier", "hier-log"):
            assert 0 < row[protocol]["commit_s"] < row[protocol]["restore_s"], (row, protocol)
    assert printed["parameters"]["alpha_s"]["source"].startswith("fitted")


def test_the_flat_model_reproduces_the_votes_it_was_fitted_on_within_2_ms(
        calibrated: tuple[Any, dict[str, Any]]) -> None:
    params, fit = calibrated
    fitted = [pt for pt in fit["points"] if pt["in_fit"]]
    assert sorted(pt["ranks"] for pt in fitted) == [8, 16, 32]
    for pt in fitted:  # the tolerance docs/scale.md states: 2 ms, 35 % at 8 ranks
        assert abs(pt["residual_s"]) <= 2e-3, pt
        assert abs(pt["residual_s"]) <= 0.35 * pt["measured_s"], pt
    assert 100e-6 < params.alpha_s < 500e-6  # a ring step, fitted: about 0.25 ms
    restore = [pt for pt in fit["points"] if pt["figure"] == "restore"
               and pt["replicas"] == 0 and pt["ranks"] in (8, 32)]
    assert all(abs(pt["residual_s"]) <= 2e-3 for pt in restore), restore
    # 64 ranks ran 2 processes per core: the model, fitted below that, stays under it
    assert all(pt["residual_s"] > 0 for pt in fit["points"] if pt["ranks"] == 64)


def test_gloo_ring_finishes_on_every_rank_a_full_ring_after_the_last_entry(
        model: ModuleType) -> None:
    rng = random.Random(28)
    for n in (2, 5, 9):
        entries = [rng.uniform(0.0, 1.0) for _ in range(n)]
        finish = model.ring_allgather_finish(entries, 0.01)
        closed = max(entries) + model.ring_allgather_s(n, 0, 0.01, 0.0)
        assert finish == pytest.approx([closed] * n)


def test_hierarchical_commit_and_restore_grow_with_the_number_of_nodes(
        model: ModuleType, calibrated: tuple[Any, dict[str, Any]]) -> None:
    params, _ = calibrated
    for protocol in ("hier", "hier-log"):
        for operation in ("commit", "restore"):
            times = [model.simulate(protocol, 8 * nodes, 8, operation, params)["seconds"]
                     for nodes in (1, 2, 4, 16, 125)]
            assert times == sorted(times) and times[0] < times[-1], (protocol, times)


def test_flat_grows_with_the_ranks_and_the_hierarchy_cuts_it(
        model: ModuleType, calibrated: tuple[Any, dict[str, Any]]) -> None:
    params, _ = calibrated
    flat_64, flat_1000 = (_commit(model, "flat", n, params) for n in (64, 1000))
    assert flat_1000 > 10 * flat_64  # a ring step per rank: linear, no plateau
    hier, log = (_commit(model, p, 1000, params) for p in ("hier", "hier-log"))
    assert log < hier < flat_1000 / 4


def test_the_node_stage_fit_recovers_the_hop_and_the_message_cost_it_was_made_from(
        model: ModuleType) -> None:
    hop, message, base = 90e-6, 9e-6, 0.3e-3  # a probe's medians by the hier-sockets model
    rows = {f"one+N {n}": {"layout": "one+N", "n": n,
                           "median_s": base + (0.0 if n == 1 else 2 * hop + 2 * (n - 1) * message)}
            for n in (1, 2, 4, 8)}
    rows["2xN 4"] = {"layout": "2xN", "n": 4, "median_s": 1.0}  # other layouts: not fitted
    fit = model.fit_node_stage({"medians": rows})
    assert fit["node_hop_s"] == pytest.approx(hop)
    assert fit["message_s"] == pytest.approx(message)
    with pytest.raises(SystemExit, match="one\\+N"):
        model.fit_node_stage({"medians": {"one+N 2": rows["one+N 2"]}})


def test_the_node_stage_over_sockets_costs_its_hops_and_grows_with_the_node(
        model: ModuleType, calibrated: tuple[Any, dict[str, Any]]) -> None:
    params, _ = calibrated
    slow = model.Params(**{**{f: getattr(params, f) for f in params.__slots__},
                           "node_hop_s": 10 * params.node_hop_s})
    for ranks in (16, 1000):  # sockets cost less than gloo's hops, and more with slower hops
        sockets = _commit(model, "hier-sockets", ranks, params)
        assert sockets < _commit(model, "hier-runs", ranks, params)
        assert _commit(model, "hier-sockets", ranks, slow) > sockets
    grows = [model.simulate("hier-sockets", 2 * size, size, "commit", params)["seconds"]
             for size in (2, 4, 8, 16)]
    assert grows == sorted(grows) and grows[0] < grows[-1], grows
