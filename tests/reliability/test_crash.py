"""Crash safety: a process that saves in a loop is SIGKILLed at random moments, again and again.

After each kill, a pipeline opened on the same root scrubs what the killed save left and
``restore_latest`` brings back a step no older than the last one whose ``result()`` had
returned, with exactly that step's tensors, plain values and TrainState. The child is
``tests/children/crash_child.py``; it appends each acknowledged step to a file and fsyncs it.
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

import pytest

import ckpt_pipeline as cp
from tests._support.children import child_script, load_script, spawn_child

CHILD_SCRIPT = child_script("crash_child.py")

KILLS = 100
SEED = 1234
MAX_KILL_DELAY_S = 0.15
ACK_DEADLINE_S = 60.0
STARTED_AHEAD = 3
"""Children started (importing torch) before they are needed: a start costs ~2 s of CPU."""

COMMITTED_FILES = ["rank-00000.commit", "rank-00000.manifest", "rank-00000.shard"]
STEP_DIR = re.compile(r"step-[0-9]{10,}")


child = load_script(CHILD_SCRIPT)


class _Child:
    """One started child process, waiting on stdin for its start step."""

    def __init__(self, index: int, root: Path, ack: Path, trace: Path, logs: Path) -> None:
        self.stderr_path = logs / f"child-{index}.err"
        self.process = spawn_child(CHILD_SCRIPT, root, "--ack", ack, "--trace", trace,
                                   stdin=subprocess.PIPE, stdout=self.stderr_path,
                                   stderr=subprocess.STDOUT)

    def go(self, start_step: int) -> None:
        stdin: IO[bytes] | None = self.process.stdin
        assert stdin is not None
        stdin.write(f"{start_step}\n".encode())
        stdin.close()

    def output(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def discard(self) -> None:
        """End the child now, whether it is starting, waiting for its start step or saving."""
        self.process.kill()
        self.process.wait(timeout=ACK_DEADLINE_S)
        if self.process.stdin is not None:
            self.process.stdin.close()


def _complete_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def _wait_for_new_ack(proc: _Child, ack: Path, acked_lines: int) -> None:
    """Poll until the ack file holds more than ``acked_lines`` lines; fail if the child ends."""
    deadline = time.monotonic() + ACK_DEADLINE_S
    while time.monotonic() < deadline:
        if len(_complete_lines(ack)) > acked_lines:
            return
        try:
            proc.process.wait(timeout=0.01)
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"the child exited ({proc.process.returncode}) before it acknowledged a "
                    f"step:\n{proc.output()}")
    pytest.fail(f"the child acknowledged no step within {ACK_DEADLINE_S} s:\n{proc.output()}")


def _layout_problems(root: Path) -> list[str]:
    """Anything under the root other than step directories holding exactly a committed set."""
    problems = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith(".lock-"):  # the pipeline's lock file (one job per root)
            continue
        if not (STEP_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
            problems.append(f"unexpected entry {entry.name!r}")
            continue
        names = sorted(os.listdir(entry.path))
        if names != COMMITTED_FILES:
            problems.append(f"{entry.name} holds {names}")
    return problems


def _scrubbed_kind(path: str) -> str:
    """'temporary shard', 'uncommitted manifest', ... for a scrubbed file's path."""
    name = os.path.basename(path)
    kind = name.split(".")[2 if name.startswith(".") else 1]
    return f"{'temporary' if name.startswith('.') else 'uncommitted'} {kind}"


@pytest.mark.slow
@pytest.mark.timeout(900)  # 100 children, each importing torch: minutes on a loaded 2-core box
def test_restore_after_sigkill_returns_the_last_acknowledged_step_or_newer_exactly(
    tmp_path: Path,
) -> None:
    root, ack, trace = tmp_path / "ckpt", tmp_path / "ack", tmp_path / "trace"
    rng = random.Random(SEED)
    started: collections.deque[_Child] = collections.deque()
    running: _Child | None = None
    landed: collections.Counter[str] = collections.Counter()
    scrubbed: collections.Counter[str] = collections.Counter()
    ahead_of_ack = 0
    start_step, acked_lines = 1, 0
    try:
        for kill in range(KILLS):
            while len(started) < min(STARTED_AHEAD, KILLS - kill):
                started.append(_Child(kill + len(started), root, ack, trace, tmp_path))
            running = started.popleft()
            running.go(start_step)
            _wait_for_new_ack(running, ack, acked_lines)
            try:
                running.process.wait(timeout=rng.uniform(0.0, MAX_KILL_DELAY_S))
            except subprocess.TimeoutExpired:
                running.process.send_signal(signal.SIGKILL)
                assert running.process.wait(timeout=ACK_DEADLINE_S) == -signal.SIGKILL
            else:
                pytest.fail(f"the child exited ({running.process.returncode}) before the "
                            f"kill:\n{running.output()}")
            killed, running = running, None
            lines = _complete_lines(ack)
            last_acked, acked_lines = int(lines[-1]), len(lines)
            landed[_complete_lines(trace)[-1].split()[2]] += 1

            events: list[cp.Event] = []
            pipe = cp.CheckpointPipeline(root, keep_last=child.KEEP_LAST, restore_rng=False)
            pipe.subscribe(events.append)
            state = child.make_state()
            with pipe:
                problems = _layout_problems(root)
                restored = pipe.restore_latest(state)
            for event in events:
                if isinstance(event, cp.TemporariesScrubbed):
                    scrubbed[_scrubbed_kind(event.path)] += 1

            where = f"after kill {kill + 1} (child log: {killed.stderr_path})"
            assert not problems, f"{where}: left on disk after the scrub: {problems}"
            assert restored is not None, f"{where}: nothing restored"
            assert restored.step >= last_acked, (
                f"{where}: restored step {restored.step}, older than acknowledged {last_acked}")
            assert restored.rejected == (), f"{where}: rejected {restored.rejected}"
            assert child.mismatches(state, restored.step) == [], where
            ts = restored.train_state
            assert (ts.step, ts.consumed_train_samples, dict(ts.extra)) == (
                restored.step, restored.step * child.SAMPLES_PER_STEP,
                {"tag": f"s{restored.step}"}), where
            ahead_of_ack += restored.step > last_acked
            start_step = restored.step + 1
    finally:
        for proc in [*started, *([running] if running is not None else [])]:
            proc.discard()

    print(f"{KILLS} kills; last event before each: {dict(landed)}; files scrubbed: "
          f"{dict(scrubbed)}; restored a step newer than the last ack {ahead_of_ack} times")
