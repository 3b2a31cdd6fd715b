"""PipelineTrainer: a Hugging Face Trainer that checkpoints through the pipeline.

A tiny GPT-2 (dropout on) trains on CPU on a fixed synthetic data set; 12 steps make an epoch,
so a resume from step 10 also crosses an epoch boundary. The losses compared are the logged
ones (``logging_steps=1``), bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

import ckpt_pipeline as cp
from tests._support.children import free_port
from tests.integrations.transformers_child import (
    MAX_STEPS,
    StopAt,
    build_trainer,
    losses,
)

pytestmark = pytest.mark.timeout(120)

CHILD = Path(__file__).with_name("transformers_child.py")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    trainer = build_trainer(tmp_path_factory.mktemp("uninterrupted"))
    trainer.train()
    return losses(trainer)


@pytest.mark.slow  # 7 s on 2 cores with the uninterrupted run: in the slow stage
def test_resume_continues_the_loss_curve_bit_exactly(
        tmp_path: Path, uninterrupted: dict[int, float]) -> None:
    first = build_trainer(tmp_path, callbacks=[StopAt(12)])  # saves at 5 and 10, stops at 12
    first.train()
    resumed = build_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=True)
    after = losses(resumed)
    assert sorted(after) == list(range(1, MAX_STEPS + 1))  # 1-10 restored with TrainerState
    assert resumed.state.global_step == MAX_STEPS
    assert {s: after[s].hex() for s in after} == {s: uninterrupted[s].hex() for s in after}


@pytest.mark.slow  # 3 s on 2 cores: in the slow stage
def test_no_checkpoint_directory_is_written_so_a_stock_trainer_finds_none(
        tmp_path: Path) -> None:
    build_trainer(tmp_path, callbacks=[StopAt(10)]).train()
    assert sorted(os.listdir(tmp_path)) == ["ckpt_pipeline"]
    assert get_last_checkpoint(str(tmp_path)) is None
    assert cp.load(tmp_path / "ckpt_pipeline").step == 10
    with pytest.raises(ValueError, match="No valid checkpoint"):
        build_trainer(tmp_path, trainer_cls=Trainer).train(resume_from_checkpoint=True)


def test_resume_without_a_committed_step_raises_as_the_stock_trainer_does(
        tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="No valid checkpoint"):
        build_trainer(tmp_path).train(resume_from_checkpoint=True)


def test_save_total_limit_is_the_pipelines_keep_last(tmp_path: Path) -> None:
    build_trainer(tmp_path, save_total_limit=2).train()  # saves 5, 10, 15, 18
    root = tmp_path / "ckpt_pipeline"
    assert [cp.load(root, step=s).step for s in (15, 18)] == [15, 18]
    for pruned in (5, 10):
        with pytest.raises(cp.CheckpointError):
            cp.load(root, step=pruned)


def test_saved_step_holds_the_trainer_state_and_the_whole_training_state(
        tmp_path: Path) -> None:
    build_trainer(tmp_path, callbacks=[StopAt(5)]).train()
    loaded = cp.load(tmp_path / "ckpt_pipeline", step=5)
    assert set(loaded.tree) == {"model", "optimizer", "scheduler"}
    assert loaded.train_state.step == 5
    assert loaded.train_state.rng is not None
    assert loaded.train_state.extra["hf_trainer_state"]["global_step"] == 5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_run_resumes_in_a_new_process_with_the_same_losses(
        tmp_path: Path, uninterrupted: dict[int, float]) -> None:
    out, log, ready = tmp_path / "run", tmp_path / "losses.txt", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])}
    child = subprocess.Popen([sys.executable, str(CHILD), str(out), str(log),
                              "--hold-at", "13", str(ready)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not ready.exists():  # written by the child once step 10 is committed
            assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
            time.sleep(0.05)
        assert ready.read_text() == "10"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    killed = _read_log(log)
    assert sorted(killed) == list(range(1, 14))  # trained past the last commit, then died
    subprocess.run([sys.executable, str(CHILD), str(out), str(log), "--resume"], env=env,
                   check=True, capture_output=True, timeout=240)
    lines = _read_lines(log)
    resumed = dict(lines[len(killed):])
    assert sorted(resumed) == list(range(11, MAX_STEPS + 1))  # from the committed step 10
    expected = {s: v.hex() for s, v in uninterrupted.items()}
    assert killed == {s: expected[s] for s in killed}
    assert resumed == {s: expected[s] for s in resumed}


def _read_lines(path: Path) -> list[tuple[int, str]]:
    return [(int(step), loss) for step, loss in
            (line.split() for line in path.read_text().splitlines())]


def _read_log(path: Path) -> dict[int, str]:
    return dict(_read_lines(path))


def _torchrun(*args: str) -> list[str]:
    port = free_port()
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(port), str(CHILD), *args]


def _kill_ranks(pid_files: list[Path], timeout: float = 60.0) -> None:
    """SIGKILL the ranks whose pids the files hold, and wait until they are gone (a rank
    alive holds its root's lock; torchrun's agent dying does not end its ranks)."""
    pids = [int(path.read_text()) for path in pid_files if path.exists()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid):
            assert time.monotonic() < deadline, f"rank pid {pid} still alive"
            time.sleep(0.05)  # a poll interval, not a synchronisation


def _state(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"
    return next((line for line in status.splitlines() if line.startswith("State:")), "")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ddp_ranks_killed_after_a_commit_resume_with_the_losses_of_an_uninterrupted_run(
        tmp_path: Path) -> None:
    """Under DDP (two gloo ranks, torchrun) every rank saves its shard of each step through
    the pipeline and the commit is agreed; both ranks SIGKILLed after step 13 resume from
    the committed step 10 and log each step's loss as an uninterrupted two-rank run does."""
    env = {**os.environ, "PYTHONPATH": str(CHILD.parents[2]), "OMP_NUM_THREADS": "1"}
    subprocess.run(_torchrun(str(tmp_path / "straight"), str(tmp_path / "straight.log")),
                   env=env, check=True, capture_output=True, timeout=240)
    out, log, ready = tmp_path / "run", tmp_path / "run.log", tmp_path / "ready"
    job = subprocess.Popen(_torchrun(str(out), str(log), "--hold-at", "13", str(ready)),
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        pid_files = [ready.with_suffix(f".pid{rank}") for rank in range(2)]
        while not (ready.exists() and all(p.exists() for p in pid_files)):  # step 10 committed
            assert job.poll() is None, job.stderr.read().decode() if job.stderr else ""
            assert time.monotonic() < deadline, "the job never reached step 13"
            time.sleep(0.05)
        assert ready.read_text() == "10"
    finally:
        _kill_ranks([ready.with_suffix(f".pid{rank}") for rank in range(2)])
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    resumed_job = subprocess.run(_torchrun(str(out), str(log), "--resume"), env=env,
                                 capture_output=True, text=True, timeout=240, check=False)
    assert resumed_job.returncode == 0, resumed_job.stderr[-4000:]

    committed = sorted(cp.load(out / "ckpt_pipeline", step).world_size for step in (15, 18))
    assert committed == [2, 2]
    for rank in range(2):
        lines = _read_lines(tmp_path / f"run.rank{rank}")
        expected = _read_log(tmp_path / f"straight.rank{rank}")
        assert sorted(expected) == list(range(1, MAX_STEPS + 1))
        steps = [step for step, _ in lines]
        cut = steps.index(11, steps.index(11) + 1)  # where the resumed run starts logging
        killed, resumed = dict(lines[:cut]), dict(lines[cut:])
        assert steps[:cut] == list(range(1, 14)), rank  # trained past the commit, then died
        assert steps[cut:] == list(range(11, MAX_STEPS + 1)), rank  # from step 10
        assert killed == {s: expected[s] for s in killed}, rank
        assert resumed == {s: expected[s] for s in resumed}, rank
