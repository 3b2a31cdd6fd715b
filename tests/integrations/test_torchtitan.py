"""The torchtitan-style manager, alone in one process, and in ``examples/train_fsdp2.py``.

The fast tests pin the manager's calls as torchtitan's loop makes them: ``save(step)`` every
step saves only the due ones, ``load()`` says whether it restored and brings back the state and
the TrainState. The slow ones run the example as a user does, two ranks under torchrun on the
CPU: a job killed with SIGKILL resumes with losses bit-identical to an uninterrupted run's (fp32,
gloo: the same reduction order), and SIGTERM to one rank stops every rank at the same step,
saved, with exit status 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

import ckpt_pipeline as cp
from ckpt_pipeline.integrations.torchtitan import PipelineCheckpointManager
from tests._support.children import REPO, child_env, free_port

pytestmark = pytest.mark.timeout(240)


def _states(seed: int = 0) -> dict[str, object]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": optimizer}


def _train_step(states: dict[str, object], manager: PipelineCheckpointManager) -> None:
    model, optimizer = states["model"], states["optimizer"]
    assert isinstance(model, nn.Module) and isinstance(optimizer, torch.optim.Optimizer)
    model(torch.ones(2, 4)).sum().backward()
    manager.maybe_wait_for_staging()
    optimizer.step()
    optimizer.zero_grad()


def _committed_steps(root: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in root.glob("step-*/rank-*.commit"))


def test_save_saves_only_interval_steps_and_the_last(tmp_path: Path) -> None:
    states = _states()
    with PipelineCheckpointManager(tmp_path, states, interval=3, keep_last=10) as manager:
        saved = []
        for step in range(1, 8):
            _train_step(states, manager)
            if manager.save(step, last_step=step == 7) is not None:
                saved.append(step)
        manager.maybe_wait_for_saving()

    assert saved == [3, 6, 7]
    assert _committed_steps(tmp_path) == [3, 6, 7]


def test_first_step_checkpoint_saves_step_one(tmp_path: Path) -> None:
    states = _states()
    with PipelineCheckpointManager(tmp_path, states, interval=5,
                                   enable_first_step_checkpoint=True) as manager:
        assert [manager.should_save(s) for s in (1, 2, 5)] == [True, False, True]


def test_a_step_saved_already_is_not_saved_again_as_the_last(tmp_path: Path) -> None:
    states = _states()
    with PipelineCheckpointManager(tmp_path, states, interval=2) as manager:
        assert manager.save(2) is not None
        assert manager.save(2, last_step=True) is None


def test_last_step_save_returns_committed(tmp_path: Path) -> None:
    states = _states()
    with PipelineCheckpointManager(tmp_path, states, interval=100) as manager:
        handle = manager.save(1, last_step=True)
        assert handle is not None and handle.done()
        assert manager.latest_step() == 1


def test_load_returns_false_on_an_empty_root(tmp_path: Path) -> None:
    with PipelineCheckpointManager(tmp_path, _states(), interval=1) as manager:
        assert manager.load() is False
        assert manager.train_state == cp.TrainState()


def test_load_restores_the_saved_state_and_train_state(tmp_path: Path) -> None:
    states = _states(seed=1)
    with PipelineCheckpointManager(tmp_path, states, interval=2) as manager:
        for step in (1, 2):
            _train_step(states, manager)
            manager.save(step, samples=8, loss=0.5)
    model = states["model"]
    assert isinstance(model, nn.Module)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = _states(seed=2)
    with PipelineCheckpointManager(tmp_path, fresh, interval=2) as manager:
        assert manager.load() is True
        ts = manager.train_state
    fresh_model = fresh["model"]
    assert isinstance(fresh_model, nn.Module)
    for name, tensor in fresh_model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    assert (ts.step, ts.consumed_train_samples, ts.extra["loss"]) == (2, 16, 0.5)


def test_load_of_a_given_step_restores_that_step(tmp_path: Path) -> None:
    states = _states()
    with PipelineCheckpointManager(tmp_path, states, interval=1, keep_last=5) as manager:
        for step in (1, 2, 3):
            _train_step(states, manager)
            manager.save(step, samples=1)
    with PipelineCheckpointManager(tmp_path, _states(), interval=1) as manager:
        assert manager.load(step=2) is True
        assert manager.train_state.step == 2
        manager.save(3, last_step=True)  # the run goes on from 2: step 3 is new again


def test_maybe_wait_for_staging_lets_the_optimizer_update_after_a_save(tmp_path: Path) -> None:
    states = _states()
    model = states["model"]
    assert isinstance(model, nn.Module)
    with PipelineCheckpointManager(tmp_path, states, interval=1) as manager:
        handle = manager.save(1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        _train_step(states, manager)  # updates in place, after maybe_wait_for_staging()
        assert handle is not None
        handle.result(timeout=60)
    tree = cp.load(tmp_path, step=1).tree["model"]
    assert all(torch.equal(tree[k], before[k]) for k in before)


def test_interval_must_be_a_positive_int(tmp_path: Path) -> None:
    with pytest.raises(cp.ConfigError, match="interval"):
        PipelineCheckpointManager(tmp_path, _states(), interval=0)


# --- examples/train_fsdp2.py under torchrun: two ranks, gloo, fp32 -------------------------

EXAMPLE = REPO / "examples" / "train_fsdp2.py"
STEPS = 30
SAVE_EVERY = 5
RUN_TIMEOUT_S = 150.0
TINY = ("--dim", "32", "--layers", "2", "--heads", "2", "--vocab-size", "64",
        "--seq-len", "16", "--batch-size", "4", "--dtype", "fp32", "--seed", "3",
        "--device", "cpu")


def _command(ckpt: Path, loss_log: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            str(EXAMPLE), "--ckpt-dir", str(ckpt), "--loss-log", str(loss_log),
            "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *TINY, *extra]


def _env() -> dict[str, str]:
    return child_env({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})


def _run(ckpt: Path, loss_log: Path) -> str:
    done = subprocess.run(_command(ckpt, loss_log), env=_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"the job failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done.stdout


@contextmanager
def _job(ckpt: Path, loss_log: Path, out: Path) -> Iterator[subprocess.Popen[bytes]]:
    """torchrun and its ranks in a session of their own; SIGKILLed as a whole on the way out."""
    with out.open("wb") as stdout:
        job = subprocess.Popen(_command(ckpt, loss_log, "--sleep-per-step", "0.1"),
                               env=_env(), cwd=REPO, stdout=stdout,
                               stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield job
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=RUN_TIMEOUT_S)


def _lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def _committed_on_both_ranks(ckpt: Path) -> list[int]:
    return sorted(int(d.name.removeprefix("step-")) for d in ckpt.glob("step-*")
                  if (d / "rank-00000.commit").exists() and (d / "rank-00001.commit").exists())


def _wait_until(job: subprocess.Popen[bytes], ready: Callable[[], bool], what: str) -> None:
    """Poll ``ready()`` until true; fail if the job ends first or the deadline passes."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not ready():
        if job.poll() is not None:
            pytest.fail(f"the job exited ({job.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {RUN_TIMEOUT_S} s")
        time.sleep(0.02)  # a poll interval, not a synchronisation


def _reported_step(pattern: str, output: str) -> int:
    """The step in the line of rank 0's output that ``pattern`` (one group) matches."""
    match = re.search(pattern, output)
    assert match is not None, f"no line matching {pattern!r} in:\n{output[-4000:]}"
    return int(match.group(1))


def _ranks(job: subprocess.Popen[bytes]) -> list[int]:
    """The pids of torchrun's workers (its child processes)."""
    children = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()
    return [int(pid) for pid in children]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The loss log of an uninterrupted run of ``STEPS`` steps."""
    tmp = tmp_path_factory.mktemp("reference")
    _run(tmp / "ckpt", tmp / "loss.log")
    lines = _lines(tmp / "loss.log")
    assert [int(line.split()[0]) for line in lines] == list(range(1, STEPS + 1))
    return lines


@pytest.mark.slow
def test_killed_job_resumes_with_bit_identical_losses(tmp_path: Path,
                                                      reference: list[str]) -> None:
    ckpt, loss_log = tmp_path / "ckpt", tmp_path / "loss.log"
    with _job(ckpt, loss_log, tmp_path / "first.out") as job:
        _wait_until(job, lambda: bool(_committed_on_both_ranks(ckpt))
                    and len(_lines(loss_log)) > max(_committed_on_both_ranks(ckpt)),
                    "a committed step and a step trained after it")
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=RUN_TIMEOUT_S)
    committed = max(_committed_on_both_ranks(ckpt))
    assert committed < STEPS
    assert _lines(loss_log) == reference[: len(_lines(loss_log))]

    stdout = _run(ckpt, loss_log)

    resumed = _reported_step(r"resumed at step (\d+)", stdout)
    assert resumed >= committed
    assert _lines(loss_log) == reference


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_a_saved_step(tmp_path: Path,
                                                              reference: list[str]) -> None:
    ckpt, loss_log, out = tmp_path / "ckpt", tmp_path / "loss.log", tmp_path / "first.out"
    with _job(ckpt, loss_log, out) as job:
        _wait_until(job, lambda: len(_lines(loss_log)) >= 3, "three steps trained")
        os.kill(_ranks(job)[0], signal.SIGTERM)
        assert job.wait(timeout=RUN_TIMEOUT_S) == 0, out.read_text()[-4000:]
    stopped = _reported_step(r"stopped at step (\d+) on SIGTERM", out.read_text())
    assert 3 <= stopped < STEPS
    assert len(_lines(loss_log)) == stopped
    assert max(_committed_on_both_ranks(ckpt)) == stopped

    stdout = _run(ckpt, loss_log)

    assert f"resumed at step {stopped} " in stdout
    assert _lines(loss_log) == reference
