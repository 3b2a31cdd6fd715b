"""PipelineTrainer: a Hugging Face Trainer that checkpoints through the pipeline.

A tiny GPT-2 (dropout on) trains on CPU on a fixed synthetic data set; 12 steps make an epoch,
so a resume from step 10 also crosses an epoch boundary. The losses compared are the logged
ones (``logging_steps=1``), bit for bit.
"""

from __future__ import annotations

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
