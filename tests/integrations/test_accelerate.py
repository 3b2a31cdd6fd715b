"""``ckpt_pipeline.integrations.accelerate``: an Accelerator's prepared objects, its registered
ones and its data loaders' positions saved through the pipeline, and a resume that continues
the loss curve bit for bit (CPU) on one process, on two gloo ranks and after a SIGKILL.

The run is ``accelerate_child.py``'s ``train``: in this process for the fast tests, as child
processes (one per rank, the environment ``torchrun`` would set) for the slow ones.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from accelerate import Accelerator
from torch import nn

import ckpt_pipeline as cp
from ckpt_pipeline.integrations.accelerate import (
    NotCheckpointableError,
    save_state,
)
from tests._support.children import free_port, spawn_child
from tests.integrations.accelerate_child import EPOCHS, SAMPLES, SAVE_EVERY, train

pytestmark = pytest.mark.timeout(180)

CHILD = Path(__file__).with_name("accelerate_child.py")
LAUNCH_DEADLINE_S = 150.0


@pytest.fixture(scope="module")
def straight_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The loss log of an uninterrupted run."""
    where = tmp_path_factory.mktemp("straight")
    train(where / "ckpt", where / "losses")
    return where / "losses"


# 6 batches an epoch, a save every 4 steps: step 8 is mid-epoch, step 12 an epoch's last batch.
@pytest.mark.parametrize(("stop_after", "newest"), [(10, 8), (13, 12)])
def test_resumed_run_continues_the_losses_of_an_uninterrupted_run(
        tmp_path: Path, straight_log: Path, stop_after: int, newest: int) -> None:
    train(tmp_path / "resumed", tmp_path / "resumed.log", stop_after=stop_after)
    restored = train(tmp_path / "resumed", tmp_path / "resumed.log")

    assert restored == newest
    straight = straight_log.read_text().splitlines()
    assert len(straight) == EPOCHS * SAMPLES // 8
    assert (tmp_path / "resumed.log").read_text().splitlines() == straight


def test_registered_object_without_state_dict_is_named_before_anything_is_written(
        tmp_path: Path) -> None:
    class Holder:
        def __init__(self) -> None:
            self.state_dict = dict
            self.load_state_dict = print

    holder = Holder()
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(nn.Linear(2, 2))
    accelerator.register_for_checkpointing(holder)
    del holder.state_dict  # lost after registering: Accelerate checks only then
    with cp.CheckpointPipeline(tmp_path / "ckpt") as pipe:
        with pytest.raises(NotCheckpointableError, match=r"registered object 0 .*Holder") as err:
            save_state(accelerator, pipe, 1)
        assert pipe.latest_step() is None
    assert isinstance(err.value, cp.CheckpointError)
    assert err.value.path == "custom/0"


# ---------------------------------------------------------------- child processes

def _launch(root: Path, logs: Path, losses: Path, world_size: int, *args: object,
            stdin: int | None = None) -> list[subprocess.Popen[bytes]]:
    """One child per rank, as torchrun starts them: rank r writes its output and restored
    step to ``logs/rank-r.*``, and its losses to ``losses/rank-r.losses``."""
    logs.mkdir(parents=True, exist_ok=True)
    losses.mkdir(parents=True, exist_ok=True)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"}
    processes = []
    for rank in range(world_size):
        processes.append(spawn_child(
            CHILD, "--root", root, "--log", losses / f"rank-{rank}.losses",
            "--restored", logs / f"rank-{rank}.restored", *args, stdin=stdin,
            stdout=logs / f"rank-{rank}.out", stderr=subprocess.STDOUT,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    return processes


def _finish(processes: Sequence[subprocess.Popen[bytes]], logs: Path) -> None:
    """Wait for every rank to exit 0 within the deadline, else kill them and fail."""
    deadline = time.monotonic() + LAUNCH_DEADLINE_S
    try:
        for process in processes:
            process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank still runs after {LAUNCH_DEADLINE_S:g} s\n{_outputs(logs)}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert [p.returncode for p in processes] == [0] * len(processes), _outputs(logs)


def _outputs(logs: Path) -> str:
    return "\n".join(f"--- {path.name}:\n{path.read_text(errors='replace')[-3000:]}"
                     for path in sorted(logs.glob("*.out")))


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


@pytest.mark.slow
def test_two_ranks_resume_with_the_losses_of_an_uninterrupted_run(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight-losses", tmp_path / "resumed-losses"
    reference = _launch(tmp_path / "straight", tmp_path / "straight", straight, 2)
    first = _launch(tmp_path / "ckpt", tmp_path / "first", resumed, 2, "--stop-after", 7)
    _finish(reference, tmp_path / "straight")
    _finish(first, tmp_path / "first")
    # The second launch resumes step 4: mid-epoch, 3 batches a rank an epoch.
    _finish(_launch(tmp_path / "ckpt", tmp_path / "second", resumed, 2), tmp_path / "second")

    for rank in range(2):
        assert _lines(tmp_path / "second" / f"rank-{rank}.restored") == ["4"]
        expected = _lines(straight / f"rank-{rank}.losses")
        assert len(expected) == EPOCHS * 3
        assert _lines(resumed / f"rank-{rank}.losses") == expected


@pytest.mark.slow
def test_run_killed_mid_training_resumes_with_the_losses_of_an_uninterrupted_run(
        tmp_path: Path, straight_log: Path) -> None:
    logs = tmp_path / "killed"
    ready = tmp_path / "ready"
    # Saves at 4 and 8, then at 9, which may or may not commit before the kill.
    hang = 2 * SAVE_EVERY + 1
    (child,) = _launch(tmp_path / "ckpt", logs, logs, 1, "--hang-after", hang, "--ready", ready,
                       stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + LAUNCH_DEADLINE_S
        while not ready.exists():
            assert child.poll() is None, _outputs(logs)
            assert time.monotonic() < deadline, _outputs(logs)
            time.sleep(0.05)
        child.kill()
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert len(_lines(logs / "rank-0.losses")) == hang

    _finish(_launch(tmp_path / "ckpt", logs, logs, 1), logs)
    assert _lines(logs / "rank-0.restored")[0] in {str(2 * SAVE_EVERY), str(hang)}
    assert _lines(logs / "rank-0.losses") == _lines(straight_log)
