"""``PipelineModelParallelStrategy``: FSDP2 training under Lightning checkpointed through the
pipeline on every rank (CPU, gloo).

The fast tests run one rank in this process (a process group of one, which
``ModelParallelStrategy`` needs); the slow ones run ``lightning_strategy_child.py`` as two
ranks, one process each, with the environment Lightning reads when processes are created
outside it. Losses are compared bit for bit (``float.hex``): fp32 on the CPU, gloo's
reductions in a fixed order, no dropout, data split by a DistributedSampler without shuffling.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import ckpt_pipeline as cp
from ckpt_pipeline.integrations.lightning import PipelineModelParallelStrategy
from tests._support.children import free_port, spawn_child
from tests.integrations.lightning_strategy_child import LossLog, Sharded, make_trainer

pytestmark = pytest.mark.timeout(120)

CHILD = Path(__file__).with_name("lightning_strategy_child.py")
LAUNCH_DEADLINE_S = 150.0
KiB = 1024


def _committed(root: Path, ranks: int = 1) -> list[int]:
    """The steps under ``root`` with a commit record of every rank."""
    return sorted(int(d.name.removeprefix("step-")) for d in root.glob("step-*")
                  if d.name.removeprefix("step-").isdigit()  # not a step set aside
                  and all((d / f"rank-{r:05d}.commit").exists() for r in range(ranks)))


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The environment of rank 0 of a job of one, started outside Lightning; the process
    group the strategy creates is destroyed afterwards."""
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
                        "NODE_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Recorded(PipelineModelParallelStrategy):
    """Records each ``wait_snapshot`` in ``events``, with the parameters at that moment."""

    def __init__(self, events: list[tuple[str, int]], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events = events
        self.params_at_wait: dict[int, list[torch.Tensor]] = {}

    def wait_snapshot(self) -> None:
        module = self.lightning_module
        assert module is not None
        step = module.trainer.global_step + 1
        self.events.append(("wait_snapshot", step))
        self.params_at_wait[step] = _local(list(module.parameters()))
        super().wait_snapshot()


class _Steps(Callback):
    """Records each backward and each finished optimizer step in ``events``, with the
    parameters after each step (what a save at that step holds)."""

    def __init__(self, events: list[tuple[str, int]]) -> None:
        self.events = events
        self.params_after: dict[int, list[torch.Tensor]] = {}

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.events.append(("backward", trainer.global_step + 1))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.events.append(("updated", trainer.global_step))
        self.params_after[trainer.global_step] = _local(list(pl_module.parameters()))


def _local(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in params]  # type: ignore[attr-defined]


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.usefixtures("one_rank")
def test_snapshot_barrier_runs_after_backward_and_before_the_update(tmp_path: Path) -> None:
    """``wait_snapshot`` comes between each step's backward and its update, with no callback
    of the user's. The state (about 1.2 MB with Adam's moments) is four times the host buffer,
    so each save copies it a piece at a time while training goes on; each save still holds
    the parameters of its step."""
    events: list[tuple[str, int]] = []
    strategy = _Recorded(events, tmp_path / "ckpt", host_buffer_bytes=256 * KiB,
                         chunk_bytes=64 * KiB)
    steps = _Steps(events)
    trainer = make_trainer(strategy, 4, 2, steps, devices=1, dirpath=tmp_path / "lightning")
    trainer.fit(Sharded(features=128, hidden=256))

    assert events == [(what, step) for step in range(1, 5)
                      for what in ("backward", "wait_snapshot", "updated")]
    for step in range(2, 5):  # not yet updated at the wait
        assert _same(strategy.params_at_wait[step], steps.params_after[step - 1]), step
    assert _committed(tmp_path / "ckpt") == [2, 4]
    for step in (2, 4):
        saved = cp.load(tmp_path / "ckpt", step).tree["state_dict"]
        assert _same(list(saved.values()), steps.params_after[step]), step
    assert sum(p.numel() * 4 * 3 for p in steps.params_after[4]) > 4 * 256 * KiB


@pytest.mark.usefixtures("one_rank")
def test_unencodable_hyperparameter_is_refused_naming_its_key_path(tmp_path: Path) -> None:
    strategy = PipelineModelParallelStrategy(tmp_path / "ckpt")
    trainer = make_trainer(strategy, 2, 2, devices=1, dirpath=tmp_path / "lightning")
    with pytest.raises(cp.StateError, match=r"hyper_parameters/tokenizer.*exclude=") as info:
        trainer.fit(Sharded(tokenizer=object()))
    assert info.value.path == "hyper_parameters/tokenizer"
    assert "builtins.object" in str(info.value)
    assert strategy.latest() is None


@pytest.mark.usefixtures("one_rank")
def test_save_last_at_the_same_step_is_one_save_and_top_k_is_the_retention(
        tmp_path: Path) -> None:
    strategy = PipelineModelParallelStrategy(tmp_path / "ckpt")
    trainer = make_trainer(strategy, 6, 2, devices=1, top_k=1, save_last=True,
                           dirpath=tmp_path / "lightning")
    trainer.fit(Sharded())
    assert strategy.committed_steps() == [6]  # KeepLast(1), from save_top_k=1
    assert strategy.step_of(tmp_path / "lightning" / "last.ckpt") == 6
    assert not list((tmp_path / "lightning").glob("*.ckpt"))


def _fit(root: Path, steps: int, log: LossLog, ckpt_path: str | Path | None = None,
         *callbacks: Callback, accelerator: str = "cpu",
         **options: Any) -> PipelineModelParallelStrategy:
    """A fit of one rank, saving every 2 steps; four batches an epoch, so that step 4 ends
    one (Lightning restarts an epoch resumed mid-way: the data loader holds no position)."""
    strategy = PipelineModelParallelStrategy(root / "ckpt", **options)
    trainer = make_trainer(strategy, steps, 2, log, *callbacks, devices=1,
                           accelerator=accelerator, dirpath=root / "lightning")
    trainer.fit(Sharded(samples=32), ckpt_path=ckpt_path)
    dist.destroy_process_group()  # the next fit starts its own
    return strategy


@pytest.mark.usefixtures("one_rank")
def test_resume_from_latest_loads_model_optimizer_and_loops_and_continues_the_losses(
        tmp_path: Path) -> None:
    straight, resumed = LossLog(), LossLog()
    _fit(tmp_path / "straight", 6, straight)
    first = _fit(tmp_path, 4, LossLog())
    assert first.latest() == str(tmp_path / "ckpt" / "step=4")
    _fit(tmp_path, 6, resumed, first.latest())

    assert resumed.losses == {step: straight.losses[step] for step in (5, 6)}
    assert _committed(tmp_path / "ckpt") == [2, 4, 6]


@pytest.mark.usefixtures("one_rank")
def test_fit_from_an_older_steps_file_name_goes_on_from_that_step(tmp_path: Path) -> None:
    straight, again = LossLog(), LossLog()
    _fit(tmp_path, 6, straight)
    _fit(tmp_path, 6, again, tmp_path / "lightning" / "epoch=0-step=4.ckpt")

    assert again.losses == {step: straight.losses[step] for step in (5, 6)}
    assert _committed(tmp_path / "ckpt") == [2, 4, 6]  # the first step 6 was moved aside


@pytest.mark.usefixtures("one_rank")
def test_latest_is_none_and_root_refused_when_nothing_is_committed(tmp_path: Path) -> None:
    strategy = PipelineModelParallelStrategy(tmp_path / "ckpt")
    assert strategy.latest() is None
    with pytest.raises(cp.RestoreError, match="nothing is committed"):
        _fit(tmp_path, 2, LossLog(), tmp_path / "ckpt")


def test_a_path_naming_no_step_is_refused(tmp_path: Path) -> None:
    strategy = PipelineModelParallelStrategy(tmp_path / "ckpt")
    assert strategy.step_of(tmp_path / "lightning" / "epoch=1-step=8.ckpt") == 8
    assert strategy.step_of(tmp_path / "ckpt") is None  # the newest step every rank holds
    with pytest.raises(cp.ConfigError, match="cannot tell which step") as info:
        strategy.step_of(tmp_path / "model.ckpt")
    assert info.value.path == str(tmp_path / "model.ckpt")


# ---------------------------------------------------------------- two ranks, child processes

STEPS = 12
SAVE_EVERY = 4


def _launch(root: Path, logs: Path, *args: object, steps: int = STEPS
            ) -> list[subprocess.Popen[bytes]]:
    """The two ranks of a job training to ``steps``, as a launcher outside Lightning starts
    them."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "NODE_RANK": "0", "OMP_NUM_THREADS": "1"}
    return [spawn_child(CHILD, root, logs, "--steps", steps, "--save-every", SAVE_EVERY, *args,
                        stdout=logs / f"rank-{rank}.out", stderr=subprocess.STDOUT,
                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(2)]


def _finish(processes: Sequence[subprocess.Popen[bytes]], logs: Path) -> None:
    """Wait for every rank to exit 0 within the deadline, else kill them and fail."""
    deadline = time.monotonic() + LAUNCH_DEADLINE_S
    try:
        for process in processes:
            process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank still runs after {LAUNCH_DEADLINE_S:g} s\n{_outputs(logs)}")
    finally:
        _kill(processes)
    assert [p.returncode for p in processes] == [0, 0], _outputs(logs)


def _kill(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()


def _outputs(logs: Path) -> str:
    return "\n".join(f"--- {path.name}:\n{path.read_text(errors='replace')[-3000:]}"
                     for path in sorted(logs.glob("*.out")))


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The loss logs of an uninterrupted run of ``STEPS`` steps on two ranks."""
    where = tmp_path_factory.mktemp("reference")
    _finish(_launch(where, where / "logs"), where / "logs")
    for rank in range(2):
        assert [int(line.split()[0]) for line in _lines(where / "logs" / f"rank-{rank}.losses")
                ] == list(range(1, STEPS + 1))
    return where / "logs"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_resume_with_the_losses_of_an_uninterrupted_run(
        tmp_path: Path, reference: Path) -> None:
    logs = tmp_path / "logs"
    _finish(_launch(tmp_path, logs, steps=8), logs)
    assert _committed(tmp_path / "ckpt", ranks=2) == [4, 8]
    _finish(_launch(tmp_path, logs), logs)

    assert _committed(tmp_path / "ckpt", ranks=2) == [4, 8, 12]
    for rank in range(2):
        assert _lines(logs / f"rank-{rank}.resumed") == ["8"]
        assert _lines(logs / f"rank-{rank}.losses") == _lines(reference / f"rank-{rank}.losses")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ranks_killed_after_a_commit_resume_with_the_losses_of_an_uninterrupted_run(
        tmp_path: Path, reference: Path) -> None:
    logs = tmp_path / "logs"
    ranks = _launch(tmp_path, logs, "--hold-after", 10)
    try:
        deadline = time.monotonic() + LAUNCH_DEADLINE_S
        while not all((logs / f"rank-{rank}.ready").exists() for rank in range(2)):
            assert all(p.poll() is None for p in ranks), _outputs(logs)
            assert time.monotonic() < deadline, _outputs(logs)
            time.sleep(0.05)  # a poll interval, not a synchronisation
    finally:
        _kill(ranks)
    for rank in range(2):
        assert len(_lines(logs / f"rank-{rank}.losses")) == 10

    _finish(_launch(tmp_path, logs), logs)
    assert _committed(tmp_path / "ckpt", ranks=2) == [4, 8, 12]
    for rank in range(2):
        assert _lines(logs / f"rank-{rank}.resumed") == ["8"]
        assert _lines(logs / f"rank-{rank}.losses") == _lines(reference / f"rank-{rank}.losses")


class _Restored(Callback):
    """The full parameters and Adam moments as the fit starts training (after the load),
    and the steps trained after it."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.moments: dict[str, torch.Tensor] = {}
        self.started_at = -1
        self.trained: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started_at = trainer.global_step
        for name, p in pl_module.named_parameters():
            self.params[name] = p.full_tensor().detach().clone()  # type: ignore[attr-defined]
            state = trainer.optimizers[0].state.get(p, {})
            if "exp_avg" in state:
                self.moments[name] = state["exp_avg"].full_tensor().clone()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.trained.append(trainer.global_step)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.usefixtures("one_rank")
def test_a_step_saved_on_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    """An elastic restart: the strategy's restore reshards a step saved by two FSDP2 ranks
    onto one (parameters and Adam's moments from both saved shards, Lightning's loops from the
    step), and training goes on from it. Losses are not compared with the two-rank run's: one
    rank sees other batches and reduces in another order."""
    logs = tmp_path / "logs"
    _finish(_launch(tmp_path, logs, steps=8), logs)
    assert _committed(tmp_path / "ckpt", ranks=2) == [4, 8]
    saved = cp.load(tmp_path / "ckpt", 8, consolidate=True).tree

    strategy = PipelineModelParallelStrategy(tmp_path / "ckpt")
    restored, log = _Restored(), LossLog()
    trainer = make_trainer(strategy, 12, SAVE_EVERY, restored, log, devices=1,
                           dirpath=tmp_path / "lightning")
    trainer.fit(Sharded(), ckpt_path=strategy.latest())

    assert restored.started_at == 8 and restored.trained == [9, 10, 11, 12]
    assert restored.params.keys() == saved["state_dict"].keys()
    for name, value in restored.params.items():
        assert torch.equal(value, saved["state_dict"][name]), name
    moments = saved["optimizer_states"][0]["state"]
    assert restored.moments and all(torch.equal(value, moments[name]["exp_avg"])
                                    for name, value in restored.moments.items())
    assert all(torch.isfinite(torch.tensor(float.fromhex(h))) for h in log.losses.values())
    assert _committed(tmp_path / "ckpt", ranks=1)[-1] == 12


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.usefixtures("one_rank")
def test_a_step_saved_on_one_rank_resumes_on_two(tmp_path: Path) -> None:
    """The other way: one rank saves, a job of two resumes from ``latest()``, which names
    rank 0's step on the rank that holds none of its own."""
    first = _fit(tmp_path, 4, LossLog())
    assert first.committed_steps() == [2, 4]
    saved = cp.load(tmp_path / "ckpt", 4).tree["state_dict"]

    logs = tmp_path / "logs"
    _finish(_launch(tmp_path, logs, steps=8), logs)
    for rank in range(2):
        assert _lines(logs / f"rank-{rank}.resumed") == ["4"]
        assert [int(line.split()[0]) for line in _lines(logs / f"rank-{rank}.losses")
                ] == [5, 6, 7, 8]  # Lightning's loops went on from the loaded step
    assert _committed(tmp_path / "ckpt", ranks=2)[-1] == 8
    resharded = cp.load(tmp_path / "ckpt", 8, consolidate=True).tree["state_dict"]
    assert resharded.keys() == saved.keys()
    assert all(resharded[name].shape == saved[name].shape for name in saved)


@pytest.mark.parametrize("accelerator", [pytest.param("gpu", marks=pytest.mark.gpu),
                                         pytest.param("cpu", marks=pytest.mark.slow)])
@pytest.mark.usefixtures("one_rank")
def test_each_save_holds_its_steps_parameters_and_a_resume_continues_the_losses(
        tmp_path: Path, accelerator: str) -> None:
    """One rank on the device (NCCL on a GPU): the copies of each save, queued on the
    pipeline's side stream, hold the sharded parameters of their step although the next
    optimizer step follows at once; and a resume continues an uninterrupted run's losses bit
    for bit (deterministic kernels: ``deterministic=True``, no atomics in these layers)."""
    straight, first_log, resumed = LossLog(), LossLog(), LossLog()
    _fit(tmp_path / "straight", 6, straight, None, accelerator=accelerator)
    steps = _Steps([])
    first = _fit(tmp_path, 4, first_log, None, steps, accelerator=accelerator)
    assert _committed(tmp_path / "ckpt") == [2, 4]
    for step in (2, 4):
        saved = cp.load(tmp_path / "ckpt", step).tree["state_dict"]
        assert _same(list(saved.values()), [p.cpu() for p in steps.params_after[step]]), step
        assert all(p.device.type == ("cuda" if accelerator == "gpu" else "cpu")
                   for p in steps.params_after[step])
    _fit(tmp_path, 6, resumed, first.latest(), accelerator=accelerator)

    assert resumed.losses == {step: straight.losses[step] for step in (5, 6)}
