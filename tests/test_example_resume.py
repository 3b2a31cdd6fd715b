"""The resume example, run as a user runs it: real processes, real files, a real ``kill -9``.

These tests pin the promise the README makes with ``examples/train_resume.py``: training that is
killed at any moment resumes from its last committed checkpoint and, on CPU, continues with
losses bit-identical to those of a run that was never interrupted.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests._support.children import REPO, child_env

pytestmark = pytest.mark.slow  # the example trains in child processes: the slow suite

EXAMPLE = REPO / "examples" / "train_resume.py"

STEPS = 120
SAVE_EVERY = 10
RUN_TIMEOUT_S = 60.0
KILL_DEADLINE_S = 60.0


def _command(root: Path, loss_log: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return [
        sys.executable, str(EXAMPLE),
        "--root", str(root),
        "--loss-log", str(loss_log),
        "--steps", str(steps),
        "--save-every", str(SAVE_EVERY),
        "--seed", "7",
        "--device", "cpu",
        "--json",
        *extra,
    ]


def _env() -> dict[str, str]:
    """The test's environment, with the checkout importable and stdout unbuffered."""
    return child_env({"PYTHONUNBUFFERED": "1"})


def _run(command: list[str]) -> list[dict[str, Any]]:
    """Run the example to completion; return its progress events."""
    done = subprocess.run(
        command, env=_env(), cwd=REPO, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S, check=False,
    )
    assert done.returncode == 0, f"example failed ({done.returncode}):\n{done.stderr}"
    return _events(done.stdout)


def _events(stdout: str) -> list[dict[str, Any]]:
    """The JSON progress lines of ``stdout``; a torn last line (killed process) is ignored."""
    return [json.loads(line) for line in stdout.splitlines(keepends=True) if line.endswith("\n")]


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def _complete_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[dict[str, Any]]]:
    """Loss log lines and events of an uninterrupted run of ``STEPS`` steps."""
    tmp = tmp_path_factory.mktemp("reference")
    loss_log = tmp / "loss.log"
    events = _run(_command(tmp / "ckpt", loss_log))
    return loss_log.read_text().splitlines(keepends=True), events


def test_uninterrupted_run_logs_every_step_and_commits_every_save(
    reference: tuple[list[str], list[dict[str, Any]]],
) -> None:
    lines, events = reference

    assert [int(line.split()[0]) for line in lines] == list(range(1, STEPS + 1))
    assert all(math.isfinite(float.fromhex(line.split()[1])) for line in lines)
    assert events[0]["event"] == "started"
    assert [e["step"] for e in _of(events, "committed")] == list(
        range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)
    )
    assert _of(events, "finished") == [
        {"event": "finished", "step": STEPS, "trained_steps": STEPS,
         "loss": float.fromhex(lines[-1].split()[1])}
    ]


def test_killed_run_resumes_from_last_commit_with_bit_identical_losses(
    tmp_path: Path, reference: tuple[list[str], list[dict[str, Any]]],
) -> None:
    reference_lines, _ = reference
    root, loss_log, stdout_path = tmp_path / "ckpt", tmp_path / "loss.log", tmp_path / "first.out"

    with stdout_path.open("w") as stdout, (tmp_path / "first.err").open("w") as stderr:
        first = subprocess.Popen(
            _command(root, loss_log, "--sleep-per-step", "0.05"),
            env=_env(), cwd=REPO, stdout=stdout, stderr=stderr,
        )
        try:
            committed = _wait_for_commits(first, stdout_path, loss_log, count=2)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=RUN_TIMEOUT_S)
    assert first.returncode == -signal.SIGKILL
    killed_lines = _complete_lines(loss_log)
    assert killed_lines == reference_lines[: len(killed_lines)]

    events = _run(_command(root, loss_log))

    [resumed] = _of(events, "resumed")
    assert max(committed) <= resumed["step"] < STEPS
    assert resumed["step"] <= len(killed_lines)
    [finished] = _of(events, "finished")
    assert (finished["step"], finished["trained_steps"]) == (STEPS, STEPS - resumed["step"])
    resumed_lines = loss_log.read_text().splitlines(keepends=True)
    assert resumed_lines == reference_lines, _first_difference(resumed_lines, reference_lines)


def _first_difference(actual: list[str], expected: list[str]) -> str:
    """Where two loss logs part, for a failure message a person can act on."""
    for index, (got, want) in enumerate(zip(actual, expected, strict=False)):
        if got != want:
            return f"loss log line {index + 1} differs: {got.strip()!r} != {want.strip()!r}"
    return f"loss log has {len(actual)} lines, the reference {len(expected)}"


def _wait_for_commits(
    process: subprocess.Popen[bytes], stdout_path: Path, loss_log: Path, *, count: int,
) -> list[int]:
    """Poll the running example until it reported ``count`` commits and trained past them.

    Returns the committed steps it reported. Fails if the process ends first or the deadline
    passes: the kill must land in the middle of training.
    """
    deadline = time.monotonic() + KILL_DEADLINE_S
    while time.monotonic() < deadline:
        committed = [e["step"] for e in _of(_events(stdout_path.read_text()), "committed")]
        logged = len(_complete_lines(loss_log))
        if len(committed) >= count and logged > max(committed):
            return committed
        try:
            process.wait(timeout=0.02)
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"the example exited ({process.returncode}) before it could be killed")
    pytest.fail(f"no {count} commits within {KILL_DEADLINE_S} s")


def test_second_run_after_completion_resumes_at_final_step_and_trains_nothing(
    tmp_path: Path,
) -> None:
    steps = 3 * SAVE_EVERY
    root, loss_log = tmp_path / "ckpt", tmp_path / "loss.log"
    first = _run(_command(root, loss_log, steps=steps))
    log_after_first = loss_log.read_text()

    second = _run(_command(root, loss_log, steps=steps))

    assert [e["event"] for e in second] == ["resumed", "finished"]
    assert second[0]["step"] == steps
    assert second[1] == {**_of(first, "finished")[0], "trained_steps": 0}
    assert loss_log.read_text() == log_after_first
