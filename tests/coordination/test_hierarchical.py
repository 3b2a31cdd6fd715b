"""The hierarchical control plane on 16 ranks in pretend nodes of 4: the same agreements as the
flat one, and a dead rank (a leader or not) named on every other rank within a bounded time.

Each launch starts one ``tests/children/hier_worker.py`` per rank with the environment that
``torchrun`` would set, ``LOCAL_WORLD_SIZE=4`` included, so that each pipeline makes its
``HierarchicalCoordinator`` by itself; each rank has a root of its own. A launch that does not
finish by its deadline is killed and fails the test. A launch costs 16 imports of torch, so
the good-path tests share one.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests._support.children import child_script, free_port, load_script, spawn_child

pytestmark = pytest.mark.slow

WORKER_SCRIPT = child_script("hier_worker.py")
worker = load_script(WORKER_SCRIPT)
OLDER, NEWER = worker.SAVE_STEPS

WORLD, NODE = 16, 4
TIMEOUT_S = 4.0
"""The coordination timeout of every launch: small, so that a failing exchange ends fast."""
FAIL_BOUND_S = TIMEOUT_S + 3 * 1.0
"""``HierarchicalCoordinator.fail_bound_s`` at that timeout (grace_s defaults to 1 s)."""
REPORT_SLACK_S = 5.0
"""Beyond the bound: the save's own snapshot and write, and a loaded machine."""
LAUNCH_DEADLINE_S = 170.0
"""16 ranks importing torch on 2 cores take 30-70 s to start; this is far above."""
WORKER_MAX_S = 150.0


class Ranks:
    """The processes of one launch: one ``hier_worker.py`` per rank, on a fresh port."""

    def __init__(self, scenario: str, phases: Sequence[str], root: Path, logs: Path, *,
                 victim: int = -1, world: int = WORLD,
                 env_of: Mapping[int, Mapping[str, str]] | None = None) -> None:
        """``env_of``: environment variables of some ranks that replace the launch's."""
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = logs
        self.world = world
        self.started = time.monotonic()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(NODE)}
        args = [scenario, "--phase", ",".join(phases), "--root", str(root),
                "--victim", str(victim), "--coordination-timeout", str(TIMEOUT_S),
                "--max-seconds", str(WORKER_MAX_S)]
        self.processes: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(world):
                self.processes.append(spawn_child(
                    WORKER_SCRIPT, *args, "--out", self._out(rank), stdout=self._log(rank),
                    stderr=subprocess.STDOUT,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank % NODE),
                         **(env_of or {}).get(rank, {})}))
        except BaseException:
            self.kill()
            raise

    def _log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def _out(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.json"

    def wait(self) -> dict[int, int]:
        """Every rank's exit code; on the deadline, kill every rank and fail."""
        codes: dict[int, int] = {}
        for rank, process in enumerate(self.processes):
            left = max(0.0, self.started + LAUNCH_DEADLINE_S - time.monotonic())
            try:
                codes[rank] = process.wait(left)
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"rank {rank} still running after {LAUNCH_DEADLINE_S:g} s\n"
                            + self.describe())
        return codes

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    def results(self) -> dict[int, dict[str, Any]]:
        """The JSON of every rank that wrote one."""
        return {rank: json.loads(self._out(rank).read_text())
                for rank in range(self.world) if self._out(rank).exists()}

    def describe(self) -> str:
        return "\n".join(
            f"--- rank {rank} (exit {process.returncode}):\n"
            + self._log(rank).read_text(errors="replace")[-3000:]
            for rank, process in enumerate(self.processes))


def launch(scenario: str, phases: Sequence[str], root: Path, logs: Path, *,
           victim: int = -1, world: int = WORLD,
           env_of: Mapping[int, Mapping[str, str]] | None = None
           ) -> tuple[dict[int, int], dict[int, dict[str, Any]], str]:
    """Run every rank to its end: (exit codes, each rank's results, the ranks' logs)."""
    ranks = Ranks(scenario, phases, root, logs, victim=victim, world=world, env_of=env_of)
    try:
        codes = ranks.wait()
    finally:
        ranks.kill()
    return codes, ranks.results(), ranks.describe()


def run_clean(scenario: str, phases: Sequence[str], root: Path, logs: Path, *,
              victim: int = -1, world: int = WORLD,
              env_of: Mapping[int, Mapping[str, str]] | None = None
              ) -> dict[int, dict[str, Any]]:
    """A launch in which every rank exits 0 and writes its results."""
    codes, results, logs_text = launch(scenario, phases, root, logs, victim=victim,
                                       world=world, env_of=env_of)
    assert codes == dict.fromkeys(range(world), 0), logs_text
    assert sorted(results) == list(range(world)), logs_text
    return results


def phase(results: dict[int, dict[str, Any]], name: str) -> dict[int, dict[str, Any]]:
    return {rank: out["phases"][name] for rank, out in results.items()}


def commit_records(root: Path, step: int) -> list[str]:
    return sorted(p.name for p in root.glob(f"rank-*/step-{step:010d}/*.commit"))


def assert_restored(results: dict[int, dict[str, Any]], step: int) -> None:
    """Every rank restored ``step`` with exactly the values it saved there."""
    for rank, out in phase(results, "restore").items():
        assert out["error"] is None, (rank, out["error"])
        assert (out["step"], out["train_step"], out["exact"]) == (step, step, True), (rank, out)
        assert out["coordinator"] == "HierarchicalCoordinator", (rank, out)


# ---------------------------------------------------------------- the good path

@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """One launch of 16 ranks: the all-gathers side by side, two saves, a restore."""
    base = tmp_path_factory.mktemp("hier-good")
    results = run_clean("plain", ["gather", "save", "restore"], base / "root", base / "logs")
    return base / "root", results


@pytest.mark.timeout(240)
def test_the_layout_is_nodes_of_consecutive_ranks_from_local_world_size(
        good_run: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _root, results = good_run
    expected = [list(range(n, n + NODE)) for n in range(0, WORLD, NODE)]
    for rank, out in phase(results, "gather").items():
        assert out["layout"] == expected, rank


@pytest.mark.timeout(240)
def test_all_gather_returns_what_the_flat_coordinator_returns(
        good_run: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _root, results = good_run
    for rank, out in phase(results, "gather").items():
        assert len(out["exchanges"]) == 4, rank
        for i, exchange in enumerate(out["exchanges"]):
            assert exchange["equal_flat"], (rank, i, exchange)
            assert exchange["as_sent"], (rank, i, exchange)
            assert exchange["lengths"] == [len(worker.payload(r, i)) for r in range(WORLD)]
    lengths = phase(results, "gather")[0]["exchanges"]
    assert any(0 in e["lengths"] and max(e["lengths"]) > 0 for e in lengths), \
        "some exchange mixes empty and non-empty payloads"
    assert lengths[3]["lengths"] == [0] * WORLD, "one exchange is empty on every rank"


@pytest.mark.timeout(240)
def test_pieces_for_rank_0_reach_rank_0_alone(
        good_run: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    """``all_gather_root``: every rank gets every payload; rank 0 alone gets every rank's
    non-empty piece for it, as the flat coordinator hands them."""
    _root, results = good_run
    for rank, out in phase(results, "gather").items():
        assert len(out["rooted"]) == 3, rank
        for i, exchange in enumerate(out["rooted"]):
            assert exchange["as_sent"] and exchange["equal_flat"], (rank, i, exchange)
            want = {str(r): worker.payload(r, i + 4).hex() for r in range(WORLD)
                    if worker.payload(r, i + 4)} if rank == 0 else {}
            assert exchange["pieces"] == want, (rank, i)
    assert all(phase(results, "gather")[0]["rooted"][i]["pieces"] for i in range(3))


@pytest.mark.timeout(240)
def test_a_pipeline_of_a_multi_node_job_commits_every_step_per_node_first(
        good_run: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    root, results = good_run
    for rank, out in phase(results, "save").items():
        assert out["coordinator"] == "HierarchicalCoordinator", rank
        assert [(s["step"], s["ok"], s.get("committed_step")) for s in out["saves"]] == [
            (OLDER, True, OLDER), (NEWER, True, NEWER)], (rank, out["saves"])
    assert commit_records(root, NEWER) == [f"rank-{r:05d}.commit" for r in range(WORLD)]


@pytest.mark.timeout(240)
def test_restore_latest_restores_the_newest_step_on_every_rank(
        good_run: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _root, results = good_run
    assert_restored(results, NEWER)


@pytest.mark.timeout(240)
def test_the_pipeline_closes_the_group_and_the_sockets_of_the_coordinator_it_made(
        good_run: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _root, results = good_run
    for rank, out in phase(results, "save").items():
        # The leaders' group, on a leader only: a node's ranks talk over local sockets, a
        # connection to each other rank of the node on the leader, one to it on the others.
        leader = rank % NODE == 0
        assert out["groups_open"] == out["groups_before"] + (1 if leader else 0), (rank, out)
        assert out["groups_after_close"] == out["groups_before"], (rank, out)
        links = NODE - 1 if leader else 1
        assert out["sockets_open"] >= out["sockets_before"] + links, (rank, out)
        assert out["sockets_after_close"] == out["sockets_before"], (rank, out)


# ---------------------------------------------------------------- failures

@pytest.mark.timeout(400)
@pytest.mark.parametrize("victim", [5, 8], ids=["non-leader", "leader"])
def test_a_rank_dead_before_the_vote_is_named_on_every_other_rank_in_bounded_time(
        tmp_path: Path, victim: int) -> None:
    root = tmp_path / "root"
    codes, results, logs = launch("dies", ["save"], root, tmp_path / "save", victim=victim)
    assert codes == {r: -signal.SIGKILL if r == victim else 0 for r in range(WORLD)}, logs
    assert sorted(results) == [r for r in range(WORLD) if r != victim], logs
    for rank, out in phase(results, "save").items():
        older, newer = out["saves"]
        assert older["ok"], (rank, older)
        assert not newer["ok"] and newer["error"]["type"] == "CoordinationError", (rank, newer)
        assert newer["error"]["ranks"] == [victim], (rank, newer["error"]["message"])
        assert newer["error"]["step"] == NEWER, (rank, newer["error"])
        assert newer["seconds"] < FAIL_BOUND_S + REPORT_SLACK_S, (rank, newer)
        # The control plane is broken from then on: the next exchange raises at once.
        later = out["later"]
        assert later["error"]["type"] == "CoordinationError", (rank, later)
        assert "failed earlier" in later["error"]["message"], (rank, later)
        assert later["seconds"] < 1.0, (rank, later)
    assert commit_records(root, NEWER) == []

    # A fresh job of 16 ranks: the step committed before the death is whole.
    assert_restored(run_clean("plain", ["restore"], root, tmp_path / "restore"), OLDER)


@pytest.mark.timeout(240)
def test_rank_0_dead_fails_the_save_on_every_other_rank_without_naming(tmp_path: Path) -> None:
    """Rank 0 serves the job's store, which names the missing ranks: without it the exchange
    still fails on every other rank, in bounded time, and says why no rank is named."""
    codes, results, logs = launch("dies", ["save"], tmp_path / "root", tmp_path / "save",
                                  victim=0)
    assert codes == {r: -signal.SIGKILL if r == 0 else 0 for r in range(WORLD)}, logs
    assert sorted(results) == list(range(1, WORLD)), logs
    for rank, out in phase(results, "save").items():
        newer = out["saves"][1]
        assert not newer["ok"] and newer["error"]["type"] == "CoordinationError", (rank, newer)
        assert newer["error"]["ranks"] == [], (rank, newer["error"])
        assert "rank 0 may be gone" in newer["error"]["message"], (rank, newer["error"])
        assert newer["seconds"] < FAIL_BOUND_S + REPORT_SLACK_S, (rank, newer)


@pytest.mark.timeout(240)
def test_a_rank_of_a_node_saving_another_step_fails_the_save_on_every_rank(
        tmp_path: Path) -> None:
    """Rank 6 saves step 25 where every other rank saves step 20: the vote, per node first,
    reaches every rank, and no rank commits either step."""
    root, odd = tmp_path / "root", 6
    results = run_clean("ahead", ["save", "restore"], root, tmp_path / "run", victim=odd)
    for rank, out in phase(results, "save").items():
        older, newer = out["saves"]
        assert older["ok"], (rank, older)
        assert not newer["ok"] and newer["error"]["type"] == "SaveError", (rank, newer)
        if rank == odd:
            assert newer["step"] == worker.AHEAD_STEP, newer
            assert newer["error"]["ranks"] == [r for r in range(WORLD) if r != odd], newer
        else:
            assert newer["error"]["ranks"] == [odd], (rank, newer["error"])
            assert f"rank {odd}: was at step {worker.AHEAD_STEP}" in newer["error"]["message"]
    assert commit_records(root, NEWER) == []
    assert commit_records(root, worker.AHEAD_STEP) == []
    assert_restored(results, OLDER)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("env", "match"), [
    ({"LOCAL_WORLD_SIZE": "4"}, "the ranks disagree on which ranks share a node"),
    ({"LOCAL_WORLD_SIZE": "3"}, "rank\\(s\\) 3 have no node layout"),
], ids=["another-size", "not-dividing"])
def test_ranks_that_see_different_nodes_all_refuse_the_coordinator(
        tmp_path: Path, env: dict[str, str], match: str) -> None:
    """4 ranks in nodes of 2, but rank 3 is told another node size: every rank raises
    ConfigError when it makes the coordinator, none hangs."""
    nodes_of_2 = {"LOCAL_WORLD_SIZE": "2"}
    results = run_clean("plain", ["layout"], tmp_path / "root", tmp_path / "logs", world=4,
                        env_of={0: nodes_of_2, 1: nodes_of_2, 2: nodes_of_2, 3: env})
    for rank, out in phase(results, "layout").items():
        assert out["layout"] is None and out["error"]["type"] == "ConfigError", (rank, out)
        assert re.search(match, out["error"]["message"]), (rank, out["error"]["message"])


@pytest.mark.timeout(240)
def test_a_rank_that_cannot_reach_its_node_leader_fails_the_coordinator_on_every_rank(
        tmp_path: Path) -> None:
    """8 ranks in nodes of 4; rank 5's connection to its leader (rank 4) is refused, as for
    a rank given as one node with ranks of another host: every rank raises a ConfigError
    naming rank 5 and the node layout to check, and none hangs: the leader stops waiting
    for rank 5 when rank 5 says in the store that it cannot connect, instead of waiting out
    the coordination timeout."""
    results = run_clean("unreachable", ["layout"], tmp_path / "root", tmp_path / "logs",
                        world=8, victim=5)
    for rank, out in phase(results, "layout").items():
        error = out["error"]
        assert out["layout"] is None and error["type"] == "ConfigError", (rank, out)
        assert "rank 5 could not connect to its node's leader, rank 4" in error["message"], \
            (rank, error)
        assert "LOCAL_WORLD_SIZE" in error["hint"], (rank, error)
        assert "in time" not in error["message"], (rank, error)


@pytest.mark.timeout(240)
def test_a_pipeline_whose_ranks_see_different_node_sizes_agrees_on_the_flat_one(
        tmp_path: Path) -> None:
    """4 ranks, three told nodes of 2 and rank 3 nodes of 4 (no node layout for it): the
    pipelines choose together, every rank makes the flat coordinator, and every save
    commits (a rank that chose alone would make other groups than the rest)."""
    nodes_of_2 = {"LOCAL_WORLD_SIZE": "2"}
    results = run_clean("plain", ["save"], tmp_path / "root", tmp_path / "logs", world=4,
                        env_of={0: nodes_of_2, 1: nodes_of_2, 2: nodes_of_2,
                                3: {"LOCAL_WORLD_SIZE": "4"}})
    for rank, out in phase(results, "save").items():
        assert out["coordinator"] == "DistributedCoordinator", (rank, out)
        assert all(s["ok"] for s in out["saves"]), (rank, out["saves"])
