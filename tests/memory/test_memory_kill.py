"""The memory tier survives SIGKILL: a process that saves with ``memory=`` is killed at random
moments and at labelled crash points, and a pipeline opened on the same root and memory
directory restores a step no older than the last acknowledged one, exactly, never a torn one.

The child is ``tests/children/memory_child.py``; it prints ``acked STEP`` once a save's
``result()`` (its memory commit) returned. After each kill the test opens a pipeline on the same
root and memory directory in this process (``keep_files=True``, so that its clean close leaves
the memory files for the next child, as a crashed job leaves them), checks what the start-up
left in both roots and restores into a fresh state. The next child resumes from that step, as
a restarted job would.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

import ckpt_pipeline as cp
from tests._support.children import child_script, load_script, spawn_child

# Child processes each: the whole module runs with the slow suites (in CI, after the
# fast suite), the tier's in-process tests and one crash restore in tests/memory/test_memory_tier.py
# run in the fast one.
pytestmark = pytest.mark.slow

CHILD_SCRIPT = child_script("memory_child.py")
child = load_script(CHILD_SCRIPT)

SEED = 2024
SLOW_KILLS = 60
FAST_KILLS = 3
LINE_DEADLINE_S = 60.0
STARTED_AHEAD = 3
"""Children started (importing torch) before they are needed: a start costs ~2 s of CPU."""
MAX_EARLY_DELAY_S = 0.03
MAX_LATE_DELAY_S = 0.02
MAX_LATE_ACKS = 12
MAX_OPENING_DELAY_S = 0.4

COMMITTED = ["rank-00000.commit", "rank-00000.manifest", "rank-00000.shard"]
STEP_DIR = re.compile(r"step-[0-9]{10,}")


def step_dir(step: int) -> str:
    return f"step-{step:010d}"


@pytest.fixture
def memory_dir(tmp_path: Path) -> Iterator[Path]:
    """A memory directory of this test alone in /dev/shm, removed afterwards."""
    path = Path("/dev/shm") / f"ckpt-test-{tmp_path.name}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- the child

class _Child:
    """One started child, waiting on stdin to open its pipeline."""

    def __init__(self, index: int, root: Path, memory: Path, logs: Path,
                 *extra: str, env: dict[str, str] | None = None) -> None:
        self.out_path = logs / f"child-{index}.out"
        self.err_path = logs / f"child-{index}.err"
        self.process = spawn_child(CHILD_SCRIPT, root, memory, *extra, env=env,
                                   stdin=subprocess.PIPE, stdout=self.out_path,
                                   stderr=self.err_path)

    def go(self) -> None:
        stdin: IO[bytes] | None = self.process.stdin
        assert stdin is not None
        stdin.write(b"go\n")
        stdin.close()

    def lines(self) -> list[tuple[str, int]]:
        """The complete lines it printed, as (word, step)."""
        if not self.out_path.exists():
            return []
        text = self.out_path.read_text()
        return [(w, int(s)) for w, s in (line.split() for line in text.splitlines(True)
                                         if line.endswith("\n"))]

    def acked(self) -> list[int]:
        return [s for w, s in self.lines() if w == "acked"]

    def resumed(self) -> int | None:
        return next((s for w, s in self.lines() if w == "resumed"), None)

    def output(self) -> str:
        out = self.out_path.read_text(errors="replace") if self.out_path.exists() else ""
        err = self.err_path.read_text(errors="replace") if self.err_path.exists() else ""
        return f"stdout:\n{out[-2000:]}\nstderr:\n{err[-4000:]}"

    def wait_for(self, acks: int) -> None:
        """Poll until it printed ``resumed`` and ``acks`` acknowledgements; fail if it ends."""
        deadline = time.monotonic() + LINE_DEADLINE_S
        while time.monotonic() < deadline:
            if self.resumed() is not None and len(self.acked()) >= acks:
                return
            try:
                self.process.wait(timeout=0.002)
            except subprocess.TimeoutExpired:
                continue
            pytest.fail(f"the child exited ({self.process.returncode}) before {acks} acks:\n"
                        f"{self.output()}")
        pytest.fail(f"the child printed no {acks} acks within {LINE_DEADLINE_S} s:\n"
                    f"{self.output()}")

    def kill_after(self, delay: float) -> None:
        try:
            self.process.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGKILL)
            assert self.process.wait(timeout=LINE_DEADLINE_S) == -signal.SIGKILL
        else:
            pytest.fail(f"the child exited ({self.process.returncode}) before the kill:\n"
                        f"{self.output()}")

    def discard(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=LINE_DEADLINE_S)
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()


# ---------------------------------------------------------------- checks after a kill

def _slot_files(memory: Path) -> set[str]:
    """The buffers under the memory root's slot directories (free, or being filled)."""
    slots = memory / "slots"
    return {str(p.relative_to(memory)) for p in slots.rglob("*") if not p.is_dir()} \
        if slots.is_dir() else set()


def _layout_problems(root: Path, memory: Path, crashed: set[str]) -> list[str]:
    """Anything in either root that is not a committed set, a lock, or the memory tier's own
    bookkeeping (its topology record, and the new pipeline's buffers: none of ``crashed``,
    the killed run's buffers, may be left)."""
    problems = []
    for base, is_memory in ((root, False), (memory, True)):
        if not base.exists():
            continue
        for entry in sorted(os.scandir(base), key=lambda e: e.name):
            where = f"{'memory' if is_memory else 'disk'} {entry.name}"
            if entry.name.startswith(".lock-"):
                continue
            if is_memory and entry.name == "topology-rank-0.msgpack":
                continue
            if is_memory and entry.name == "slots":
                left = sorted(_slot_files(base) & crashed)
                if left:
                    problems.append(f"memory slots hold {left}")
                continue
            if not (STEP_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                problems.append(f"unexpected entry {where}")
                continue
            names = sorted(os.listdir(entry.path))
            if names != COMMITTED:
                problems.append(f"{where} holds {names}")
    return problems


def _committed(base: Path, step: int) -> bool:
    return (base / step_dir(step) / "rank-00000.commit").exists()


@dataclass
class Restored:
    step: int | None
    from_memory: tuple[int, ...]
    in_memory: bool
    on_disk: bool


def restore_and_check(root: Path, memory: Path, floor: int, where: str) -> Restored:
    """Open a pipeline on both roots, check the start-up left only committed sets, restore
    into a fresh state and check it is a step >= ``floor``, exactly, read from memory when
    memory holds it."""
    state = child.make_state()
    pipe = cp.CheckpointPipeline(root, memory=child.memory_config(str(memory), keep_files=True),
                                 keep_last=child.KEEP_LAST, restore_rng=False)
    crashed = _slot_files(memory)
    with pipe:
        problems = _layout_problems(root, memory, crashed)
        restored = pipe.restore_latest(state)
    assert not problems, f"{where}: left after the start-up: {problems}"
    if restored is None:
        assert floor == 0, f"{where}: nothing restored, acknowledged step {floor}"
        return Restored(None, (), False, False)
    step = restored.step
    assert step >= floor, f"{where}: restored step {step}, older than acknowledged {floor}"
    assert restored.rejected == (), f"{where}: rejected {restored.rejected}"
    assert child.mismatches(state, step) == [], where
    assert child.train_state_mismatch(restored.train_state, step) is None, where
    in_memory, on_disk = _committed(memory, step), _committed(root, step)
    assert in_memory or on_disk, f"{where}: restored step {step} is committed nowhere"
    assert restored.from_memory == ((0,) if in_memory else ()), (
        f"{where}: step {step} in memory: {in_memory}, from_memory {restored.from_memory}")
    return Restored(step, restored.from_memory, in_memory, on_disk)


# ---------------------------------------------------------------- random kills

def _plan(rng: random.Random, kill: int) -> tuple[str, int, float]:
    """(kind, acks to wait for, delay) of a kill: while opening or restoring, during the first
    saves of the child, or late."""
    roll = rng.random()
    if roll < 0.15 and kill > 0:
        return "opening", 0, rng.uniform(0.0, MAX_OPENING_DELAY_S)
    if roll < 0.45:
        return "early", 0, rng.uniform(0.0, MAX_EARLY_DELAY_S)
    return "late", rng.randint(1, MAX_LATE_ACKS), rng.uniform(0.0, MAX_LATE_DELAY_S)


def kill_loop(tmp_path: Path, memory: Path, kills: int, plans: list[tuple[str, int, float]]
              ) -> str:
    """Kill ``kills`` children in turn, checking the restore after each; a summary line."""
    root = tmp_path / "ckpt"
    started: collections.deque[_Child] = collections.deque()
    running: _Child | None = None
    floor = 0
    previous: int | None = None
    kinds: collections.Counter[str] = collections.Counter()
    sources: collections.Counter[str] = collections.Counter()
    try:
        for kill in range(kills):
            while len(started) < min(STARTED_AHEAD, kills - kill):
                started.append(_Child(kill + len(started), root, memory, tmp_path))
            running = started.popleft()
            kind, acks, delay = plans[kill]
            running.go()
            if kind != "opening":
                running.wait_for(acks)
            running.kill_after(delay)
            killed, running = running, None
            where = f"after kill {kill + 1} ({kind}, {acks} acks, {delay:.3f} s; " \
                    f"log {killed.out_path})"
            resumed = killed.resumed()
            if resumed is not None:
                assert resumed == (previous or 0), (
                    f"{where}: the child resumed {resumed}, the last restore was {previous}")
                floor = max(floor, resumed)
            floor = max([floor, *killed.acked()])
            got = restore_and_check(root, memory, floor, where)
            kinds[kind] += 1
            sources["memory" if got.from_memory else "disk" if got.step else "none"] += 1
            previous = got.step
            floor = max(floor, got.step or 0)
    finally:
        for proc in [*started, *([running] if running is not None else [])]:
            proc.discard()
    return f"{kills} kills {dict(kinds)}; restored from {dict(sources)}; last step {floor}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_restore_after_random_sigkills_is_the_acknowledged_step_or_newer_exactly(
    tmp_path: Path, memory_dir: Path,
) -> None:
    rng = random.Random(SEED)
    plans = [_plan(rng, kill) for kill in range(SLOW_KILLS)]
    print(kill_loop(tmp_path, memory_dir, SLOW_KILLS, plans))


@pytest.mark.timeout(120)
def test_restore_after_a_few_sigkills_is_the_acknowledged_step_or_newer_exactly(
    tmp_path: Path, memory_dir: Path,
) -> None:
    rng = random.Random(SEED)
    plans = [("early", 0, rng.uniform(0.0, MAX_EARLY_DELAY_S)),
             ("late", 4, rng.uniform(0.0, MAX_LATE_DELAY_S)),
             ("late", 2, rng.uniform(0.0, MAX_LATE_DELAY_S))]
    print(kill_loop(tmp_path, memory_dir, FAST_KILLS, plans))


# ---------------------------------------------------------------- crash points

LAST_STEP = 8

# With --sequential and disk_every=3 a fresh child's commits come in this order (the memory
# commit of each save, then the write-through of saves 1, 4 and 7):
#   commit.voted / commit.record_published: 1 mem, 1 disk, 2 mem, 3 mem, 4 mem, 4 disk, 5 mem
#   write_data.done / seal.*: 1 disk, 4 disk, 7 disk
CRASHES = {
    # label: (the step it dies in, is that step committed in memory when it dies)
    "commit.voted:3": (2, False),            # memory commit of step 2, no record yet
    "commit.voted:4": (3, False),            # memory commit of step 3 (step 2 memory-only)
    "commit.record_published:3": (2, True),  # step 2's memory record durable, not confirmed
    "write_data.done:2": (4, True),          # write-through of step 4: data in a temporary
    "seal.shard_published:2": (4, True),     # write-through of step 4: shard, no manifest
    "seal.done:2": (4, True),                # write-through of step 4: sealed, no vote
    "commit.voted:6": (4, True),             # write-through of step 4: voted, no record
}


SLOW_CRASHES = {"commit.voted:3", "seal.shard_published:2", "write_data.done:2"}
"""Run with -m slow only: each is a neighbour of a crash point of the fast run."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("crash_at", [
    pytest.param(label, marks=[pytest.mark.slow] if label in SLOW_CRASHES else [])
    for label in sorted(CRASHES)])
def test_restore_after_a_crash_point_skips_the_unfinished_step(
    tmp_path: Path, memory_dir: Path, crash_at: str,
) -> None:
    dies_in, memory_committed = CRASHES[crash_at]
    root = tmp_path / "ckpt"
    proc = _Child(0, root, memory_dir, tmp_path, "--sequential", "--last", str(LAST_STEP),
                  env={"CKPT_PIPELINE_CRASH_AT": crash_at})
    try:
        proc.go()
        code = proc.process.wait(timeout=LINE_DEADLINE_S)
    finally:
        proc.discard()
    assert code == -signal.SIGKILL, f"the crash point did not fire ({code}):\n{proc.output()}"
    acked = proc.acked()
    # The child dies in the save of ``dies_in``: every earlier one was acknowledged.
    assert acked[:dies_in - 1] == list(range(1, dies_in)), proc.output()
    assert max(acked, default=0) <= dies_in, proc.output()
    expected = dies_in if memory_committed else dies_in - 1
    got = restore_and_check(root, memory_dir, max(acked, default=0), f"after {crash_at}")
    assert got.step == expected, f"after {crash_at}: restored {got.step}, not {expected}"
    if not memory_committed:
        assert not (memory_dir / step_dir(dies_in)).exists(), "the torn memory step stayed"
    if crash_at.startswith(("write_data", "seal", "commit.voted:6")):
        # the write-through never finished: step 4 is restored from memory, and the disk's
        # unfinished step was scrubbed, not chosen
        assert got.from_memory == (0,) and not got.on_disk


@pytest.mark.timeout(120)
def test_a_job_restarted_after_a_crash_point_closes_with_its_newest_step_on_disk(
    tmp_path: Path, memory_dir: Path,
) -> None:
    root = tmp_path / "ckpt"
    crashed = _Child(0, root, memory_dir, tmp_path, "--sequential", "--last", str(LAST_STEP),
                     env={"CKPT_PIPELINE_CRASH_AT": "commit.voted:4"})
    restarted = _Child(1, root, memory_dir, tmp_path, "--last", str(LAST_STEP))
    try:
        crashed.go()
        assert crashed.process.wait(timeout=LINE_DEADLINE_S) == -signal.SIGKILL, \
            crashed.output()
        restarted.go()
        assert restarted.process.wait(timeout=LINE_DEADLINE_S) == 0, restarted.output()
    finally:
        crashed.discard()
        restarted.discard()
    # it resumed from the memory step the crash left, and saved the rest
    assert restarted.resumed() == 2, restarted.output()
    assert restarted.acked() == list(range(3, LAST_STEP + 1)), restarted.output()
    # the clean close wrote the newest step through and removed the memory files
    assert _committed(root, LAST_STEP)
    left = [str(p) for p in memory_dir.rglob("*") if not p.is_dir()] \
        if memory_dir.exists() else []
    assert left == [], left
    state = child.make_state()
    with cp.CheckpointPipeline(root, keep_last=child.KEEP_LAST, restore_rng=False) as pipe:
        restored = pipe.restore_latest(state)
    assert restored is not None and restored.step == LAST_STEP
    assert restored.from_memory == ()
    assert child.mismatches(state, LAST_STEP) == []


CLOSE_CRASHES = {
    # with --last 2: step 1 (memory, disk), step 2 (memory); the close writes step 2 through
    "write_data.done:2": False,          # the close's write-through: data in a temporary
    "commit.record_published:4": True,   # step 2 committed on disk, memory files not removed
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("crash_at", sorted(CLOSE_CRASHES))
def test_a_crash_while_closing_keeps_the_newest_step_restorable(
    tmp_path: Path, memory_dir: Path, crash_at: str,
) -> None:
    root = tmp_path / "ckpt"
    proc = _Child(0, root, memory_dir, tmp_path, "--sequential", "--last", "2",
                  env={"CKPT_PIPELINE_CRASH_AT": crash_at})
    try:
        proc.go()
        code = proc.process.wait(timeout=LINE_DEADLINE_S)
    finally:
        proc.discard()
    assert code == -signal.SIGKILL, f"the crash point did not fire ({code}):\n{proc.output()}"
    assert proc.acked() == [1, 2], proc.output()
    got = restore_and_check(root, memory_dir, 2, f"after {crash_at} at close")
    assert got.step == 2 and got.from_memory == (0,)
    assert got.on_disk == CLOSE_CRASHES[crash_at]
