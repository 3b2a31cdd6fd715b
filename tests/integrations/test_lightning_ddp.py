"""``PipelineCheckpointIO`` under Lightning's DDP strategy: two gloo ranks on the CPU.

Each rank is a ``lightning_ddp_child.py`` process started with the environment that Lightning's
``LightningEnvironment`` reads for processes created outside it. Lightning calls
``save_checkpoint`` on global rank 0 only, so rank 0's pipeline saves alone (one rank's files a
step); on resume every rank loads that root, and each rank's losses continue those of an
uninterrupted two-rank run bit for bit (gloo sums two ranks' gradients in a fixed order).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import ckpt_pipeline as cp
from ckpt_pipeline.integrations.lightning import PipelineCheckpointIO
from tests._support.children import free_port, spawn_child

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHILD = Path(__file__).with_name("lightning_ddp_child.py")
RANKS = 2
STEPS = 12
SAVE_EVERY = 4
LAUNCH_DEADLINE_S = 150.0  # a launch took up to ~45 s on the 2-core VM at load 10


@contextlib.contextmanager
def _ranks(root: Path, out: Path, name: str, steps: int,
           *extra: object) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One child per rank, training to ``steps`` (resuming from ``root`` if it holds a step);
    each rank's output goes to ``out/NAME-rank-R.out``. Ranks still running on the way out are
    killed."""
    out.mkdir(parents=True, exist_ok=True)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(RANKS), "NODE_RANK": "0", "OMP_NUM_THREADS": "1"}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(RANKS):
            processes.append(spawn_child(
                CHILD, root, out, "--steps", steps, "--save-every", SAVE_EVERY, *extra,
                stdout=out / f"{name}-rank-{rank}.out", stderr=subprocess.STDOUT,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def _run(root: Path, out: Path, name: str, steps: int = STEPS) -> None:
    """Launch the ranks and wait for every one to exit 0."""
    with _ranks(root, out, name, steps) as processes:
        deadline = time.monotonic() + LAUNCH_DEADLINE_S
        try:
            for process in processes:
                process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"a rank still runs after {LAUNCH_DEADLINE_S:g} s\n{_outputs(out)}")
        assert [p.returncode for p in processes] == [0] * RANKS, _outputs(out)


def _outputs(out: Path) -> str:
    return "\n".join(f"--- {path.name}:\n{path.read_text(errors='replace')[-3000:]}"
                     for path in sorted(out.glob("*.out")))


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _committed(root: Path) -> list[int]:
    return PipelineCheckpointIO(root / "ckpt").committed_steps()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of an uninterrupted two-rank run of ``STEPS`` steps."""
    where = tmp_path_factory.mktemp("reference")
    _run(where, where / "out", "straight")
    for rank in range(RANKS):
        steps = [int(line.split()[0]) for line in _lines(where / "out" / f"rank-{rank}.losses")]
        assert steps == list(range(1, STEPS + 1))
    assert _lines(where / "out" / "rank-0.losses") != _lines(where / "out" / "rank-1.losses")
    return where / "out"


def test_two_ranks_resume_from_rank_zeros_root_with_the_uninterrupted_losses(
        tmp_path: Path, reference: Path) -> None:
    out = tmp_path / "out"
    _run(tmp_path, out, "first", steps=8)
    assert _committed(tmp_path) == [4, 8]

    _run(tmp_path, out, "resumed")

    assert [_lines(out / f"rank-{rank}.loaded") for rank in range(RANKS)] == [["8"], ["8"]]
    for rank in range(RANKS):
        losses = _lines(out / f"rank-{rank}.losses")
        assert [int(line.split()[0]) for line in losses[8:]] == [9, 10, 11, 12]
        assert losses == _lines(reference / f"rank-{rank}.losses"), f"rank {rank}"
    assert _lines(out / "rank-0.saved") == ["4", "8", "12"]
    assert not (out / "rank-1.saved").exists()
    assert _committed(tmp_path) == [4, 8, 12]
    assert {cp.load(tmp_path / "ckpt", step).world_size for step in (4, 8, 12)} == {1}


def test_every_rank_sees_rank_zeros_last_save_committed_once_fit_returns(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(tmp_path, out, "fit", steps=SAVE_EVERY)  # the last step's save is still in flight
    assert [_lines(out / f"rank-{rank}.after-fit") for rank in range(RANKS)] == [["4"], ["4"]]


def test_both_ranks_sigkilled_after_step_10_resume_with_the_uninterrupted_losses(
        tmp_path: Path, reference: Path) -> None:
    out = tmp_path / "out"
    ready = [out / f"rank-{rank}.ready" for rank in range(RANKS)]
    with _ranks(tmp_path, out, "killed", STEPS, "--hold-after", 10) as processes:
        deadline = time.monotonic() + LAUNCH_DEADLINE_S
        # Written once step 10 trained on that rank (on rank 0, once steps 4 and 8 committed).
        while not all(path.exists() for path in ready):
            assert all(p.poll() is None for p in processes), _outputs(out)
            assert time.monotonic() < deadline, f"no step 10 on both ranks\n{_outputs(out)}"
            time.sleep(0.05)  # a poll interval, not a synchronisation
        for process in processes:
            process.send_signal(signal.SIGKILL)
        for process in processes:
            process.wait()
    assert _committed(tmp_path) == [4, 8]
    for rank in range(RANKS):
        assert [int(line.split()[0]) for line in _lines(out / f"rank-{rank}.losses")] == (
            list(range(1, 11)))

    _run(tmp_path, out, "resumed")

    assert [_lines(out / f"rank-{rank}.loaded") for rank in range(RANKS)] == [["8"], ["8"]]
    for rank in range(RANKS):
        assert _lines(out / f"rank-{rank}.losses") == _lines(reference / f"rank-{rank}.losses"), (
            f"rank {rank}")
    assert _committed(tmp_path) == [4, 8, 12]
