"""The framework integrations on one CUDA device (those tests skip without one).

Lightning (``PipelineCheckpointIO`` with its callback), Hugging Face's ``PipelineTrainer`` and
Accelerate each train a small model on the GPU, saving every few steps. A run stopped after a
save resumes in the same process from the newest committed step and continues the losses of
an uninterrupted run bit for bit; and every tensor a step holds equals the live one at the
moment of its save: the copies queued on the pipeline's side stream are not overtaken by the
next optimizer step (the integrations call ``wait_snapshot()`` before it).

Bit for bit, since each of these runs is deterministic on one GPU in one process: the same
kernels on the same shapes on one stream, none of them accumulating with atomics (matmuls,
elementwise ops, reductions, embedding lookups, fused or foreach AdamW). Lightning's run sets
``deterministic=True`` (torch's deterministic algorithms and ``CUBLAS_WORKSPACE_CONFIG``, put
back after the test by ``conftest.py``); GPT-2 runs with eager attention, since the fused attention's backward
may accumulate with atomics; dropout replays from the CUDA RNG state the step saved.

The models, data and loss logs are those of the CPU tests (``*_child.py``). Each test runs on
the CPU too, as a check of the test itself: in the fast suite where that takes under a second
(Accelerate), as ``slow`` where it takes longer (the CPU tests of each integration already
cover its resume).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from transformers import TrainerCallback

import ckpt_pipeline as cp
from ckpt_pipeline.integrations.lightning import PipelineCheckpointIO
from tests.integrations import accelerate_child
from tests.integrations.lightning_child import LossLog, Regressor
from tests.integrations.transformers_child import MAX_STEPS, StopAt, build_trainer, losses

pytestmark = pytest.mark.timeout(240)

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
CPU_SLOW = pytest.param("cpu", marks=pytest.mark.slow)


def tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a tree of dicts, lists and tuples, by key path, copied to the CPU."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        found[prefix] = tree.detach().cpu().clone()
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            found.update(tensors(value, f"{prefix}/{key}"))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            found.update(tensors(value, f"{prefix}/{index}"))
    return found


def assert_same_tensors(saved: Mapping[str, torch.Tensor],
                        live: Mapping[str, torch.Tensor]) -> None:
    assert sorted(saved) == sorted(live)
    differing = [path for path in live if not torch.equal(saved[path], live[path])]
    assert not differing, f"saved tensors differ from the live ones at save time: {differing}"


# ---------------------------------------------------------------- Lightning

class LiveAtSave(Callback):
    """The module's weights and the optimizer's state as each save hands them over."""

    def __init__(self) -> None:
        self.at_step: dict[int, dict[str, torch.Tensor]] = {}
        self.devices: set[str] = set()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self.devices.add(pl_module.device.type)
        self.at_step[checkpoint["global_step"]] = tensors(
            {"state_dict": checkpoint["state_dict"],
             "optimizer_states": checkpoint["optimizer_states"]})


def _lightning_fit(root: Path, steps: int, device: str, *, resume: bool = False
                   ) -> tuple[PipelineCheckpointIO, dict[int, str], LiveAtSave]:
    """``lightning_child.make_trainer``'s run (a save every 4 steps, every step kept) on
    ``device``."""
    io = PipelineCheckpointIO(root / "ckpt")
    log, live = LossLog(), LiveAtSave()
    checkpoint = ModelCheckpoint(dirpath=root / "lightning", every_n_train_steps=4,
                                 save_top_k=-1)
    trainer = pl.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1,
                         max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True, plugins=[io],
                         callbacks=[io.callback(), checkpoint, log, live],
                         default_root_dir=root / "lightning")
    trainer.fit(Regressor(), ckpt_path=io.latest() if resume else None)
    return io, log.losses, live


@pytest.mark.parametrize("device", [CUDA, CPU_SLOW])
def test_lightning_resumes_on_the_device_with_the_losses_of_an_uninterrupted_run(
        tmp_path: Path, device: str) -> None:
    _, uninterrupted, _ = _lightning_fit(tmp_path / "straight", 12, device)
    first, _, live = _lightning_fit(tmp_path / "run", 8, device)
    assert live.devices == {device}
    assert first.committed_steps() == [4, 8]
    for step in (4, 8):
        saved = cp.load(first.root, step).tree
        assert_same_tensors(tensors({key: saved[key] for key in ("state_dict",
                                                                 "optimizer_states")}),
                            live.at_step[step])

    resumed_io, resumed, _ = _lightning_fit(tmp_path / "run", 12, device, resume=True)
    assert sorted(resumed) == [9, 10, 11, 12]
    assert resumed == {step: uninterrupted[step] for step in resumed}
    assert resumed_io.committed_steps() == [4, 8, 12]


# ---------------------------------------------------------------- Hugging Face Trainer

class LiveAtHFSave(TrainerCallback):
    """The model's weights and the optimizer's state at each save (``on_save`` follows
    ``_save_checkpoint`` before the next optimizer step)."""

    def __init__(self) -> None:
        self.at_step: dict[int, dict[str, torch.Tensor]] = {}
        self.devices: set[str] = set()

    def on_save(self, args: Any, state: Any, control: Any, *, model: Any = None,
                optimizer: Any = None, **kwargs: Any) -> None:
        self.devices.add(next(model.parameters()).device.type)
        self.at_step[state.global_step] = tensors(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"]})


@pytest.mark.parametrize("device", [CUDA, CPU_SLOW])
def test_pipeline_trainer_resumes_on_the_device_with_the_losses_of_an_uninterrupted_run(
        tmp_path: Path, device: str) -> None:
    options: dict[str, Any] = {"use_cpu": device == "cpu", "attn_implementation": "eager"}
    straight = build_trainer(tmp_path / "straight", **options)
    straight.train()
    uninterrupted = losses(straight)

    live = LiveAtHFSave()
    build_trainer(tmp_path / "run", callbacks=[StopAt(12), live], **options).train()
    assert live.devices == {device}
    root = tmp_path / "run" / "ckpt_pipeline"
    for step in (5, 10):
        saved = cp.load(root, step).tree
        assert_same_tensors(tensors({"model": saved["model"],
                                     "optimizer": saved["optimizer"]["state"]}),
                            live.at_step[step])

    resumed = build_trainer(tmp_path / "run", **options)
    resumed.train(resume_from_checkpoint=True)
    after = losses(resumed)
    assert sorted(after) == list(range(1, MAX_STEPS + 1))  # 1-10 restored with TrainerState
    assert {s: after[s].hex() for s in after} == {s: uninterrupted[s].hex() for s in after}


# ---------------------------------------------------------------- Accelerate

@pytest.mark.parametrize("device", [CUDA, "cpu"])
def test_accelerate_resumes_on_the_device_with_the_losses_of_an_uninterrupted_run(
        tmp_path: Path, device: str) -> None:
    cpu = device == "cpu"
    accelerate_child.train(tmp_path / "straight", tmp_path / "straight.log", cpu=cpu)

    live: dict[int, dict[str, torch.Tensor]] = {}
    devices: set[str] = set()

    def at_save(step: int, model: torch.nn.Module) -> None:
        devices.add(next(model.parameters()).device.type)
        live[step] = tensors(model.state_dict())

    # A save every 4 steps, 6 batches an epoch: stopped at 10, it resumes mid-epoch from 8.
    accelerate_child.train(tmp_path / "run", tmp_path / "run.log", stop_after=10, cpu=cpu,
                           on_save=at_save)
    assert devices == {device}
    for step in (4, 8):  # keep_last=2: both still held
        assert_same_tensors(tensors(cp.load(tmp_path / "run", step).tree["models"]["0"]),
                            live[step])

    restored = accelerate_child.train(tmp_path / "run", tmp_path / "run.log", cpu=cpu)
    assert restored == 8
    straight = (tmp_path / "straight.log").read_text().splitlines()
    assert len(straight) == accelerate_child.EPOCHS * accelerate_child.SAMPLES // 8
    assert (tmp_path / "run.log").read_text().splitlines() == straight
