"""Several gloo ranks with the memory tier: a job killed after saves that are only in memory is
restored from memory by every rank, and when one rank's memory shard of the newest step is
corrupt, every rank falls back together to the same older step, exactly.

Each launch runs one ``tests/children/memory_rank_worker.py`` per rank with the environment that
``torchrun`` would set, on a fresh port. The ranks share one disk root and one memory directory
(one per job, in /dev/shm). A save job (killed with SIGKILL once every rank saved every step)
is shared by the tests of a world size; each test restores from its own copy of both roots.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_pipeline.testing import CRASH_ENV
from tests._support.children import child_script, load_script, spawn_child

# Child processes each: the whole module runs with the slow suites (in CI, after the
# fast suite), the tier's in-process tests and one crash restore in tests/memory/test_memory_tier.py
# run in the fast one.
pytestmark = pytest.mark.slow

WORKER_SCRIPT = child_script("memory_rank_worker.py")
worker = load_script(WORKER_SCRIPT)

LAUNCH_DEADLINE_S = 90.0
WORKER_MAX_S = 75.0
"""A worker dumps its stacks and exits by then, so that a hang shows where it waits."""
NEWEST = worker.SAVE_STEPS[-1]
OLDER_IN_MEMORY = worker.SAVE_STEPS[-worker.KEEP]
CORRUPT_RANK = 1
WORLD_SIZES = [2, pytest.param(4, marks=pytest.mark.slow)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _shm_dir(name: str) -> Path:
    path = Path("/dev/shm") / f"ckpt-test-{name}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    return path


def launch(phase: str, root: Path, memory: Path, world_size: int, logs: Path, *,
           crash: tuple[int, str] | None = None, saves: int | None = None
           ) -> dict[int, dict[str, Any]]:
    """Run one job of ``world_size`` ranks to its end; every rank's JSON output. A save job
    (or a resume job) must end with every rank SIGKILLed, a restore job with every rank
    exiting 0. ``crash``:
    (rank, crash point) armed in that rank; once it died the others are killed, and nothing
    is returned. ``saves``: of a resume job."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world_size)}
    outs = [logs / f"{phase}-rank-{r}.json" for r in range(world_size)]
    log_files = [logs / f"{phase}-rank-{r}.log" for r in range(world_size)]
    processes: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    try:
        for rank in range(world_size):
            armed = {CRASH_ENV: crash[1]} if crash is not None and crash[0] == rank else {}
            processes.append(spawn_child(
                WORKER_SCRIPT, phase, "--root", root, "--memory", memory, "--out", outs[rank],
                "--max-seconds", WORKER_MAX_S, *([] if saves is None else ["--saves", saves]),
                stdout=log_files[rank],
                stderr=subprocess.STDOUT, env={**env, "RANK": str(rank), **armed}))
        if crash is not None:
            code = processes[crash[0]].wait(LAUNCH_DEADLINE_S)
            assert code == -signal.SIGKILL, _describe(log_files)
            for process in processes:
                process.kill()  # the job dies with its rank
        codes = []
        for process in processes:
            left = max(0.0, started + LAUNCH_DEADLINE_S - time.monotonic())
            codes.append(process.wait(left))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{phase} job still running after {LAUNCH_DEADLINE_S:g} s\n"
                    + _describe(log_files))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    if crash is not None:
        # the others were killed, or saw the rank die first: their save failed (exit 1)
        assert set(codes) <= {-signal.SIGKILL, 1}, _describe(log_files)
        return {}
    expected = 0 if phase == "restore" else -signal.SIGKILL
    assert codes == [expected] * world_size, _describe(log_files)
    results = {r: json.loads(out.read_text()) for r, out in enumerate(outs) if out.exists()}
    assert sorted(results) == list(range(world_size)), _describe(log_files)
    for rank, out in results.items():
        assert "error" not in out, (rank, out["error"])
    return {rank: out["result"] for rank, out in results.items()}


def _describe(log_files: list[Path]) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-4000:]}"
                     for p in log_files if p.exists())


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def saved_job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[int, Path, Path]]:
    """(world size, disk root, memory dir) of a job killed after saving ``SAVE_STEPS``, only
    the first written through to disk (do not change them: copy them)."""
    world_size: int = request.param
    base = tmp_path_factory.mktemp(f"saved-by-{world_size}")
    memory = _shm_dir(f"saved-{base.name}")
    try:
        saves = launch("save", base / "root", memory, world_size, base / "logs")
        for rank, out in saves.items():
            got = [(s["step"], s["tier"], s["durable"]) for s in out["saves"]]
            want = [(step, "memory", "disk" if step == worker.SAVE_STEPS[0] else None)
                    for step in worker.SAVE_STEPS]
            assert got == want, (rank, got)
        yield world_size, base / "root", memory
    finally:
        shutil.rmtree(memory, ignore_errors=True)


@pytest.fixture
def job_copy(saved_job: tuple[int, Path, Path], tmp_path: Path
             ) -> Iterator[tuple[int, Path, Path]]:
    """This test's copy of the saved job's disk root and memory directory."""
    world_size, root, memory = saved_job
    mine = _shm_dir(tmp_path.name)
    try:
        shutil.copytree(root, tmp_path / "root")
        shutil.copytree(memory, mine)
        yield world_size, tmp_path / "root", mine
    finally:
        shutil.rmtree(mine, ignore_errors=True)


def _committed_steps(base: Path, rank: int) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1])
                  for p in base.glob(f"step-*/rank-{rank:05d}.commit"))


def assert_restored(results: dict[int, dict[str, Any]], step: int, *,
                    from_memory: bool) -> None:
    """Every rank restored ``step`` (from memory, or else from disk), with exactly what it
    saved there."""
    world_size = len(results)
    for rank, out in sorted(results.items()):
        assert out["step"] == step, (rank, out)
        assert out["mismatches"] == [], (rank, out["mismatches"])
        assert out["from_memory"] == (list(range(world_size)) if from_memory else []), (
            rank, out)
        assert out["train_state"] == {
            "step": step, "consumed_train_samples": step * worker.SAMPLES_PER_STEP,
            "extra": {"tag": f"s{step}"}}, rank


def flip_data_bytes(shard: Path) -> None:
    """Invert 16 bytes in the middle of the shard's data region (between its 64-byte preamble
    and its header, whose offset the preamble holds)."""
    with shard.open("r+b") as f:
        preamble = f.read(64)
        header_offset = struct.unpack_from("<8sHHIQ", preamble)[4]
        assert header_offset > 64 + 4096, header_offset
        at = (64 + header_offset) // 2
        f.seek(at)
        raw = f.read(16)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in raw))


@pytest.mark.timeout(300)
def test_every_rank_restores_the_newest_step_from_memory_after_the_job_is_killed(
    job_copy: tuple[int, Path, Path], tmp_path: Path,
) -> None:
    world_size, root, memory = job_copy
    for rank in range(world_size):
        assert _committed_steps(root, rank) == [worker.SAVE_STEPS[0]], rank
        assert _committed_steps(memory, rank) == [OLDER_IN_MEMORY, NEWEST], rank
    assert_restored(launch("restore", root, memory, world_size, tmp_path / "logs"), NEWEST,
                    from_memory=True)


@pytest.mark.timeout(300)
def test_a_corrupt_memory_shard_makes_every_rank_fall_back_to_the_same_older_step(
    job_copy: tuple[int, Path, Path], tmp_path: Path,
) -> None:
    world_size, root, memory = job_copy
    flip_data_bytes(memory / f"step-{NEWEST:010d}" / f"rank-{CORRUPT_RANK:05d}.shard")
    results = launch("restore", root, memory, world_size, tmp_path / "logs")
    # the newest step complete and valid on every rank: the older memory step
    assert_restored(results, OLDER_IN_MEMORY, from_memory=True)
    rejected = {rank: [r["step"] for r in out["rejected"]] for rank, out in results.items()}
    assert NEWEST in rejected[CORRUPT_RANK], rejected


@pytest.mark.timeout(300)
def test_corrupt_memory_shards_of_every_memory_step_make_every_rank_fall_back_to_disk(
    job_copy: tuple[int, Path, Path], tmp_path: Path,
) -> None:
    world_size, root, memory = job_copy
    for step in (OLDER_IN_MEMORY, NEWEST):
        flip_data_bytes(memory / f"step-{step:010d}" / f"rank-{CORRUPT_RANK:05d}.shard")
    results = launch("restore", root, memory, world_size, tmp_path / "logs")
    # the newest step complete and valid on every rank: the one written through to disk
    assert_restored(results, worker.SAVE_STEPS[0], from_memory=False)
    rejected = {rank: [r["step"] for r in out["rejected"]] for rank, out in results.items()}
    assert {OLDER_IN_MEMORY, NEWEST} <= set(rejected[CORRUPT_RANK]), rejected


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_that_fell_back_from_a_corrupt_memory_step_saves_over_it_and_restores_that(
    job_copy: tuple[int, Path, Path], tmp_path: Path,
) -> None:
    world_size, root, memory = job_copy
    flip_data_bytes(memory / f"step-{NEWEST:010d}" / f"rank-{CORRUPT_RANK:05d}.shard")
    resumed = launch("resume", root, memory, world_size, tmp_path / "resume")
    # the corrupt step was dropped at the restore, and saved again by the resumed job
    steps = [OLDER_IN_MEMORY + 1 + i for i in range(worker.RESUME_SAVES)]
    for rank, out in resumed.items():
        assert out["resumed"] == OLDER_IN_MEMORY, (rank, out)
        assert [s["step"] for s in out["saves"]] == steps, (rank, out)
    for rank in range(world_size):
        assert _committed_steps(memory, rank) == steps[-worker.KEEP:], rank
    assert_restored(launch("restore", root, memory, world_size, tmp_path / "restore"),
                    steps[-1], from_memory=True)


@pytest.mark.timeout(300)
def test_a_corrupt_memory_shard_of_a_step_also_on_disk_is_read_from_disk(
    job_copy: tuple[int, Path, Path], tmp_path: Path,
) -> None:
    world_size, root, memory = job_copy
    resumed = launch("resume", root, memory, world_size, tmp_path / "resume", saves=1)
    newest = NEWEST + 1  # the resumed job's first save: written through, so on disk too
    for rank, out in resumed.items():
        assert [(s["step"], s["durable"]) for s in out["saves"]] == [(newest, "disk")], rank
    flip_data_bytes(memory / f"step-{newest:010d}" / f"rank-{CORRUPT_RANK:05d}.shard")
    results = launch("restore", root, memory, world_size, tmp_path / "restore")
    for rank, out in sorted(results.items()):
        assert out["step"] == newest, (rank, out)
        assert out["mismatches"] == [], (rank, out["mismatches"])
        assert out["from_memory"] == [r for r in range(world_size) if r != CORRUPT_RANK], (
            rank, out)


JOB_KILLS = 16
JOB_SEED = 77
MAX_JOB_ACKS = 6
MAX_JOB_KILL_DELAY_S = 0.03


def _log_lines(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text(errors="replace").splitlines(True)
            if line.endswith("\n") and line.split()[:1] in (["resumed"], ["acked"])]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_killed_at_random_moments_resumes_on_every_rank_from_an_acknowledged_step(
    tmp_path: Path,
) -> None:
    """Every rank of a job that saves until killed is SIGKILLed at a random moment, again and
    again; each new job restores a step no older than any rank acknowledged, the same on every
    rank, exactly."""
    world_size, root, memory = 2, tmp_path / "root", _shm_dir(tmp_path.name)
    rng = random.Random(JOB_SEED)
    floor, previous = 0, 0
    try:
        for kill in range(JOB_KILLS):
            logs = tmp_path / f"job-{kill}"
            logs.mkdir()
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                   "WORLD_SIZE": str(world_size)}
            log_files = [logs / f"rank-{r}.log" for r in range(world_size)]
            processes = [spawn_child(
                WORKER_SCRIPT, "resume", "--saves", 0, "--root", root, "--memory", memory,
                "--out", logs / f"rank-{r}.json", "--max-seconds", WORKER_MAX_S,
                stdout=log_files[r], stderr=subprocess.STDOUT,
                env={**env, "RANK": str(r)}) for r in range(world_size)]
            acks, delay = rng.randint(0, MAX_JOB_ACKS), rng.uniform(0, MAX_JOB_KILL_DELAY_S)
            where = f"job {kill} ({acks} acks, {delay:.3f} s; logs {logs})"
            try:
                deadline = time.monotonic() + LAUNCH_DEADLINE_S
                while True:
                    lines = [_log_lines(p) for p in log_files]
                    if all(lines) and sum(w == "acked" for w, *_ in lines[0]) >= acks:
                        break
                    assert all(p.poll() is None for p in processes), \
                        f"{where}: a rank exited\n{_describe(log_files)}"
                    assert time.monotonic() < deadline, f"{where}: stuck\n{_describe(log_files)}"
                    time.sleep(0.002)
                time.sleep(delay)
            finally:
                for process in processes:
                    process.kill()
                for process in processes:
                    process.wait()
            lines = [_log_lines(p) for p in log_files]
            resumed = {int(rank_lines[0][1]) for rank_lines in lines}
            assert len(resumed) == 1, f"{where}: ranks resumed {resumed}"
            step = resumed.pop()
            for rank, rank_lines in enumerate(lines):
                assert rank_lines[0][2] == "0", f"{where}: rank {rank}: {rank_lines[0]}"
            assert step >= floor and step >= previous, (
                f"{where}: resumed {step}, acknowledged {floor}, previous restore {previous}")
            previous = step
            floor = max([floor, step, *(int(s) for rank_lines in lines
                                         for w, s, *_ in rank_lines if w == "acked")])
        results = launch("restore", root, memory, world_size, tmp_path / "last")
        step = results[0]["step"]
        assert step >= floor, (step, floor)
        assert_restored(results, step, from_memory=True)
    finally:
        shutil.rmtree(memory, ignore_errors=True)


# With durable() awaited after each save, a rank's commits come in this order: step 1 in
# memory, step 1 on disk, then steps 2, 3, 4 in memory.
RANK_CRASHES = [
    pytest.param("commit.voted:4", id="voted"),  # every rank voted for step 3, no record
    pytest.param("commit.record_published:4", id="record_published", marks=pytest.mark.slow),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("crash_at", RANK_CRASHES)
def test_a_rank_killed_in_a_memory_commit_makes_every_rank_restore_the_same_step(
    tmp_path: Path, crash_at: str,
) -> None:
    world_size, root, memory = 2, tmp_path / "root", _shm_dir(tmp_path.name)
    try:
        launch("save", root, memory, world_size, tmp_path / "save", crash=(CORRUPT_RANK,
                                                                           crash_at))
        log = (tmp_path / "save" / f"save-rank-{CORRUPT_RANK}.log").read_text()
        acked = [int(line.split()[1]) for line in log.splitlines() if line.startswith("acked")]
        assert acked == [1, 2], log
        results = launch("restore", root, memory, world_size, tmp_path / "restore")
        steps = {out["step"] for out in results.values()}
        assert len(steps) == 1, results
        step = steps.pop()
        # step 3 counts only where every rank's record is durable; the crash point before the
        # record (voted) leaves it on no rank or on the others only: never chosen
        assert step in ((2,) if crash_at.startswith("commit.voted") else (2, 3)), results
        assert_restored(results, step, from_memory=True)
    finally:
        shutil.rmtree(memory, ignore_errors=True)
