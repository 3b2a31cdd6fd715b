"""A Lightning training run that checkpoints through ``PipelineCheckpointIO``, for the tests.

``python lightning_child.py ROOT LOSS_LOG --steps N --save-every K [--hold-after S --ready F]``:
resumes from the newest committed step under ROOT (if any), trains to step N, saving every K
steps, and appends ``step loss.hex()`` per step to LOSS_LOG (rewound first to the resumed step).
With ``--hold-after S``, once step S has trained and every save so far is committed, it writes
the file F and blocks, so that a test can kill it mid-run at a known point.

The model, the data and the loss logger are the ones the in-process tests use
(``make_module``, ``make_trainer``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ckpt_pipeline.integrations.lightning import (
    PipelineCheckpointIO,
    PipelineModelParallelStrategy,
)

BATCH = 16
BATCHES_PER_EPOCH = 4


class Teacher(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed synthetic regression data: item i is a pure function of i."""

    def __len__(self) -> int:
        return BATCH * BATCHES_PER_EPOCH

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 + index)
        x = torch.randn(8, generator=generator)
        return x, torch.sin(x[:1] * 2.0) + 0.1 * x[1:2]


class Regressor(pl.LightningModule):
    """Three Linear layers, Adam with a step LR schedule."""

    def __init__(self, hidden: int = 32, lr: float = 1e-2, **extra: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
                      ) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(Teacher(), batch_size=BATCH, shuffle=False)


class LossLog(Callback):
    """Per-step losses, in memory and (with ``path``) appended to a file as it goes."""

    def __init__(self, path: Path | None = None) -> None:
        self.losses: dict[int, str] = {}
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses[trainer.global_step] = float(loss).hex()
        if self.path is not None:
            with self.path.open("a") as log:
                log.write(f"{trainer.global_step} {self.losses[trainer.global_step]}\n")


class HoldAfter(Callback):
    """After step ``step``: wait for every save to commit (``io.committed_steps()``: a
    ``PipelineCheckpointIO`` or a ``PipelineModelParallelStrategy``), write ``ready``, block."""

    def __init__(self, io: PipelineCheckpointIO | PipelineModelParallelStrategy, step: int,
                 ready: Path) -> None:
        self.io, self.step, self.ready = io, step, ready

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            self.io.committed_steps()  # waits for the saves in flight
            self.ready.write_text(str(self.step))
            threading.Event().wait()  # until the test kills this process


def make_trainer(io: PipelineCheckpointIO, steps: int, save_every: int, *callbacks: Callback,
                 top_k: int = -1, save_last: bool = False, monitor: str | None = None,
                 dirpath: str | os.PathLike[str] | None = None) -> pl.Trainer:
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=save_every,
                                 save_top_k=top_k, save_last=save_last,
                                 monitor=monitor)
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      deterministic=True, plugins=[io],
                      callbacks=[io.callback(), checkpoint, *callbacks],
                      default_root_dir=dirpath)


def rewind(path: Path, step: int) -> None:
    """Drop the lines of steps after ``step`` (trained again) and a torn last line."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n") and int(line.split()[0]) <= step]
    path.write_text("".join(kept))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("loss_log", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--hold-after", type=int, default=None)
    parser.add_argument("--ready", type=Path, default=None)
    args = parser.parse_args(argv)

    io = PipelineCheckpointIO(args.root / "ckpt")
    latest = io.latest()
    rewind(args.loss_log, 0 if latest is None else io.step_of(latest) or 0)
    callbacks: list[Callback] = [LossLog(args.loss_log)]
    if args.hold_after is not None:
        assert args.ready is not None
        callbacks.append(HoldAfter(io, args.hold_after, args.ready))
    trainer = make_trainer(io, args.steps, args.save_every, *callbacks,
                           dirpath=args.root / "lightning")
    trainer.fit(Regressor(), ckpt_path=latest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
