"""Several ranks on real gloo process groups: agreed commits, agreed restores, dead or stuck ranks.

Each test launches one process per rank (``tests/children/dist_worker.py``) with the environment
that ``torchrun`` would set, on a fresh port, and reads the JSON each rank writes. Between launches
the test changes files on disk the way a failure would. A launch that does not finish by its
deadline is killed and fails the test. Every launch costs each rank an import of torch, so a
few launches (a finished save, in one or more roots) are shared by the tests that start from it;
each test works on its own copy.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests._support.children import child_script, free_port, load_script, spawn_child

pytestmark = pytest.mark.slow

WORKER_SCRIPT = child_script("dist_worker.py")

LAUNCH_DEADLINE_S = 90.0
WORKER_MAX_S = 75.0
"""A worker dumps its stacks and exits by then, so that a hang shows where it waits."""
KILLED_TIMEOUT_S = 10.0
STUCK_TIMEOUT_S = 5.0
REPORT_SLACK_S = 5.0

TEMP_FILE = re.compile(r"^\.rank-[0-9]{5,}\.(shard|manifest|commit)\.tmp-")


worker = load_script(WORKER_SCRIPT)
OLDER, NEWER = worker.SAVE_STEPS
FAULTY = worker.FAULTY_RANK
STEP_DIR = f"step-{NEWER:010d}"


# ---------------------------------------------------------------- launching ranks

class Ranks:
    """The processes of one launch: one ``dist_worker.py`` per rank, on a fresh port."""

    def __init__(self, scenario: str, phases: Sequence[str], root: Path, world_size: int,
                 logs: Path, *, shared: bool,
                 coordination_timeout: float = 30.0) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = logs
        self.started = time.monotonic()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": str(world_size)}
        args = [scenario, "--phase", ",".join(phases), "--root", str(root),
                "--coordination-timeout", str(coordination_timeout),
                "--max-seconds", str(WORKER_MAX_S)]
        if shared:
            args.append("--shared")
        self.processes: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(world_size):
                self.processes.append(spawn_child(
                    WORKER_SCRIPT, *args, "--out", self._out(rank), stdout=self._log(rank),
                    stderr=subprocess.STDOUT, env={**env, "RANK": str(rank)}))
        except BaseException:
            self.kill()
            raise

    def _log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def _out(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.json"

    def wait(self, ranks: Sequence[int] | None = None,
             deadline_s: float = LAUNCH_DEADLINE_S) -> dict[int, int]:
        """Exit codes of ``ranks`` (default: all); on the deadline, kill every rank and fail."""
        chosen = range(len(self.processes)) if ranks is None else ranks
        codes: dict[int, int] = {}
        for rank in chosen:
            left = max(0.0, self.started + deadline_s - time.monotonic())
            try:
                codes[rank] = self.processes[rank].wait(left)
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"rank {rank} still running after {deadline_s:g} s\n"
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
                for rank in range(len(self.processes)) if self._out(rank).exists()}

    def describe(self) -> str:
        parts = []
        for rank, process in enumerate(self.processes):
            text = self._log(rank).read_text(errors="replace")[-4000:]
            parts.append(f"--- rank {rank} (exit {process.returncode}):\n{text}")
        return "\n".join(parts)


def run(scenario: str, phases: Sequence[str], root: Path, world_size: int, logs: Path, *,
        shared: bool) -> dict[int, dict[str, Any]]:
    """Launch every rank, wait for all to exit 0, return each rank's results."""
    ranks = Ranks(scenario, phases, root, world_size, logs, shared=shared)
    try:
        codes = ranks.wait()
    finally:
        ranks.kill()
    assert codes == dict.fromkeys(range(world_size), 0), ranks.describe()
    results = ranks.results()
    assert sorted(results) == list(range(world_size)), ranks.describe()
    return results


def phase(results: dict[int, dict[str, Any]], name: str) -> dict[int, dict[str, Any]]:
    return {rank: out["phases"][name] for rank, out in results.items()}


# ---------------------------------------------------------------- checks

def assert_saved(results: dict[int, dict[str, Any]]) -> None:
    for rank, saved in phase(results, "save").items():
        outcomes = [(s["step"], s["ok"], s.get("error")) for s in saved["saves"]]
        assert outcomes == [(OLDER, True, None), (NEWER, True, None)], (rank, outcomes)


def assert_restored(results: dict[int, dict[str, Any]], step: int) -> None:
    """Every rank restored ``step``, with exactly the values it saved there, and one TrainState."""
    restored = phase(results, "restore")
    for rank, out in restored.items():
        assert out["error"] is None, (rank, out["error"])
        assert out["step"] == step, (rank, out)
        assert out["mismatches"] == [], (rank, out["mismatches"])
        assert out["train_state"] == {
            "step": step, "consumed_train_samples": step * worker.SAMPLES_PER_STEP,
            "extra": {"tag": f"s{step}"}}, rank


def valid_by_rank(out: dict[str, Any]) -> dict[int, list[int]]:
    return {int(rank): steps for rank, steps in out["valid_by_rank"].items()}


def files(root: Path) -> list[str]:
    """Everything under the root but the pipelines' lock files (one job per root and rank)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if not p.name.startswith(".lock-"))


def temporaries(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if TEMP_FILE.match(p.name)]


def commit_records_of(root: Path, step: int) -> list[str]:
    return [str(p) for p in root.rglob(f"step-{step:010d}/*.commit")]


# ---------------------------------------------------------------- saved sets, shared by tests

@pytest.fixture(scope="module")
def saved_by_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 10 and 20 saved by 2 ranks in one shared root (do not change it: copy it)."""
    base = tmp_path_factory.mktemp("saved-by-2")
    assert_saved(run("plain", ["save"], base / "root", 2, base / "logs", shared=True))
    return base / "root"


@pytest.fixture(scope="module")
def saved_by_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 10 and 20 saved by 4 ranks in one shared root (do not change it: copy it)."""
    base = tmp_path_factory.mktemp("saved-by-4")
    assert_saved(run("plain", ["save"], base / "root", 4, base / "logs", shared=True))
    return base / "root"


def copy_root(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    return root


def flip_data_byte(shard: Path) -> None:
    """Corrupt a byte of tensor data (the data region of a shard starts at 4096)."""
    with shard.open("r+b") as f:
        f.seek(4096 + 8)
        byte = f.read(1)
        f.seek(4096 + 8)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_two_ranks_with_separate_roots_restore_their_own_values(tmp_path: Path) -> None:
    root = tmp_path / "root"
    # The restore runs in a pipeline of its own, into a state of zeros: all it has is the disk.
    results = run("plain", ["save", "restore"], root, 2, tmp_path / "run", shared=False)
    assert_saved(results)
    assert sorted(p.name for p in root.iterdir()) == ["rank-0", "rank-1"]
    assert_restored(results, NEWER)
    for out in phase(results, "restore").values():
        assert valid_by_rank(out) == {0: [NEWER, OLDER], 1: [NEWER, OLDER]}


def test_two_ranks_sharing_a_root_restore_their_own_values(saved_by_2: Path,
                                                           tmp_path: Path) -> None:
    root = copy_root(saved_by_2, tmp_path)
    results = run("plain", ["restore"], root, 2, tmp_path / "restore", shared=True)
    assert_restored(results, NEWER)
    for out in phase(results, "restore").values():
        assert valid_by_rank(out) == {0: [NEWER, OLDER], 1: [NEWER, OLDER]}
        assert out["rejected"] == []


def test_four_ranks_sharing_a_root_restore_their_own_values(saved_by_4: Path,
                                                            tmp_path: Path) -> None:
    root = copy_root(saved_by_4, tmp_path)
    results = run("plain", ["restore"], root, 4, tmp_path / "restore", shared=True)
    assert_restored(results, NEWER)
    for out in phase(results, "restore").values():
        assert valid_by_rank(out) == {r: [NEWER, OLDER] for r in range(4)}


# ---------------------------------------------------------------- falling back together

def test_corrupt_shard_of_one_rank_makes_every_rank_fall_back(saved_by_4: Path,
                                                              tmp_path: Path) -> None:
    root = copy_root(saved_by_4, tmp_path)
    flip_data_byte(root / STEP_DIR / "rank-00002.shard")
    results = run("plain", ["restore"], root, 4, tmp_path / "restore", shared=True)
    assert_restored(results, OLDER)
    for rank, out in phase(results, "restore").items():
        # The header is intact, so every rank listed step 20; loading it failed on rank 2.
        assert valid_by_rank(out) == {r: [NEWER, OLDER] for r in range(4)}, rank
        assert [r["step"] for r in out["rejected"]] == [NEWER], rank
        assert "rank 2" in out["rejected"][0]["reason"], out["rejected"]
        assert "checksum" in out["rejected"][0]["reason"], out["rejected"]
    assert not (root / STEP_DIR).exists(), "every rank moved its step 20 aside"
    kept = list(root.glob(f"{STEP_DIR}.rejected-r00002-*/rank-00002.shard"))
    assert len(kept) == 1, files(root)  # the evidence is kept


@pytest.mark.parametrize("files_swapped", [("shard",), ("shard", "manifest")])
def test_a_shard_swapped_between_ranks_makes_every_rank_fall_back(
        saved_by_4: Path, tmp_path: Path, files_swapped: tuple[str, ...]) -> None:
    """Rank 1's files of step 20 copied over rank 2's: the sizes and the checksums inside the
    copied files are right, but not for rank 2 (its manifest's record, or the rank the header
    names)."""
    root = copy_root(saved_by_4, tmp_path)
    for kind in files_swapped:
        (root / STEP_DIR / f"rank-00002.{kind}").write_bytes(
            (root / STEP_DIR / f"rank-00001.{kind}").read_bytes())
    results = run("plain", ["restore"], root, 4, tmp_path / "restore", shared=True)
    assert_restored(results, OLDER)
    for rank, out in phase(results, "restore").items():
        assert NEWER not in valid_by_rank(out)[2], (rank, valid_by_rank(out))
        assert valid_by_rank(out)[2] == [OLDER], rank


def test_diverged_ranks_restore_the_newest_step_they_all_hold(saved_by_2: Path,
                                                              tmp_path: Path) -> None:
    root = copy_root(saved_by_2, tmp_path)
    (root / STEP_DIR / "rank-00001.commit").unlink()  # as if rank 1 died before its commit
    results = run("plain", ["restore"], root, 2, tmp_path / "restore", shared=True)
    assert_restored(results, OLDER)
    for out in phase(results, "restore").values():
        assert valid_by_rank(out) == {0: [NEWER, OLDER], 1: [OLDER]}
    assert not (root / STEP_DIR).exists(), "rank 0 moved its step 20 aside, rank 1 scrubbed it"


def test_ranks_sharing_a_root_move_a_step_aside_together(saved_by_2: Path,
                                                          tmp_path: Path) -> None:
    root = copy_root(saved_by_2, tmp_path)
    flip_data_byte(root / STEP_DIR / "rank-00001.shard")  # both ranks move step 20 aside
    # Rank 1 moves its files out first; rank 0 moves its own and removes the empty directory;
    # then rank 1 flushes the directory it moved out of. Any order must work.
    results = run("move-aside-race", ["restore"], root, 2, tmp_path / "restore", shared=True)
    assert_restored(results, OLDER)
    assert not (root / STEP_DIR).exists()


@pytest.mark.parametrize("world_size", [1, 4])
def test_a_world_size_change_with_per_rank_values_is_refused_on_every_rank(
        saved_by_2: Path, tmp_path: Path, world_size: int) -> None:
    """Each rank saved its rank number (``meta/rank``): resharding onto another number of
    ranks cannot map it, so every rank refuses, naming the value, and moves nothing."""
    root = copy_root(saved_by_2, tmp_path)
    before = files(root)
    results = run("plain", ["restore"], root, world_size, tmp_path / "restore", shared=True)
    for rank, out in phase(results, "restore").items():
        error = out["error"]
        assert error is not None and error["type"] == "ReshardError", (rank, out)
        assert "meta/rank: the saved ranks hold different values (rank 0: 0, rank 1: 1)" \
            in error["message"], error
        assert "per-rank value" in error["message"], error
    assert files(root) == before, "a refused restore moves nothing"


# ---------------------------------------------------------------- failing ranks

def test_failed_write_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = run("failing-fsync", ["save", "restore"], root, 2, tmp_path / "run",
                  shared=False)
    for rank, saved in phase(results, "save").items():
        older, newer = saved["saves"]
        assert older["ok"], (rank, older)
        assert not newer["ok"] and newer["error"]["step"] == NEWER, (rank, newer)
    other = phase(results, "save")[0]["saves"][1]["error"]
    assert other["type"] == "SaveError" and other["ranks"] == [FAULTY], other
    # The failing rank reports its own error, the one the others name.
    own = phase(results, "save")[FAULTY]["saves"][1]["error"]
    assert own["type"] == "StorageError" and "injected" in own["message"], own
    assert "injected" in other["message"], other
    assert commit_records_of(root, NEWER) == []
    assert temporaries(root) == []
    assert_restored(results, OLDER)  # a restore after the failure, in the same processes


def test_killed_rank_fails_the_save_on_the_others_within_the_timeout(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ranks = Ranks("killed-mid-save", ["save"], root, 2, tmp_path / "save", shared=False,
                  coordination_timeout=KILLED_TIMEOUT_S)
    try:
        codes = ranks.wait()  # rank 0 exits by itself, or the deadline fails the test
    finally:
        ranks.kill()
    assert codes == {0: 0, FAULTY: -signal.SIGKILL}, ranks.describe()
    saves = phase(ranks.results(), "save")[0]["saves"]
    assert saves[0]["ok"], saves
    failed = saves[1]
    assert not failed["ok"] and failed["error"]["type"] in ("CoordinationError", "SaveError"), \
        failed
    assert failed["error"]["ranks"] in (None, [], [FAULTY]), failed
    assert failed["seconds"] < KILLED_TIMEOUT_S + REPORT_SLACK_S, failed
    assert commit_records_of(root, NEWER) == []
    assert [Path(p).parent.parent.name for p in temporaries(root)] == ["rank-1"], \
        "the killed rank left the temporary of its shard"

    results = run("plain", ["restore"], root, 2, tmp_path / "restore", shared=False)
    assert_restored(results, OLDER)
    assert temporaries(root) == [], "the killed rank's temporaries are scrubbed at open"


def test_stuck_rank_fails_the_save_on_the_others_within_the_timeout(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ranks = Ranks("stuck-mid-save", ["save"], root, 2, tmp_path / "save", shared=True,
                  coordination_timeout=STUCK_TIMEOUT_S)
    try:
        codes = ranks.wait([0])
        assert ranks.processes[FAULTY].poll() is None, "the stuck rank is still stuck"
    finally:
        ranks.kill()
    assert codes == {0: 0}, ranks.describe()
    saves = phase(ranks.results(), "save")[0]["saves"]
    assert saves[0]["ok"], saves
    failed = saves[1]
    assert not failed["ok"] and failed["error"]["type"] == "CoordinationError", failed
    assert failed["error"]["ranks"] == [FAULTY], failed
    assert failed["seconds"] < STUCK_TIMEOUT_S + REPORT_SLACK_S, failed
    assert commit_records_of(root, NEWER) == []
