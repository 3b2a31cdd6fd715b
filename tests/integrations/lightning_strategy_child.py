"""One rank of a Lightning run under ``PipelineModelParallelStrategy`` (FSDP2 on gloo), for the
tests in ``test_lightning_strategy.py``, which start one process a rank with the environment
Lightning reads when processes are created outside it (``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``)::

    python lightning_strategy_child.py ROOT LOGS --steps N --save-every K
        [--hold-after S]

Resumes from ``strategy.latest()`` when ROOT holds a committed step, trains to step N (Adam, a
step LR schedule, fixed data split by a DistributedSampler), saving every K steps, and appends
``step loss.hex()`` per step to ``LOGS/rank-R.losses`` (rewound first to the resumed step, so
that a resumed log reads as one uninterrupted run's); it writes the step it resumed from (0
for a fresh start) to ``LOGS/rank-R.resumed``. With ``--hold-after S``, once step S has trained
and every save so far is committed, it writes ``LOGS/rank-R.ready`` and blocks until killed.

The model, the data and the trainer are the ones the in-process tests use (``Sharded``,
``make_trainer``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, Dataset

from ckpt_pipeline.integrations.lightning import PipelineModelParallelStrategy
from tests.integrations.lightning_child import HoldAfter, LossLog, rewind

BATCH = 8
SAMPLES = 64  # two ranks: four batches a rank an epoch


class Teacher(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed synthetic regression data: item i is a pure function of i."""

    def __init__(self, features: int = 8, samples: int = SAMPLES) -> None:
        self.features = features
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 + index)
        x = torch.randn(self.features, generator=generator)
        return x, torch.sin(x[:1] * 2.0) + 0.1 * x[1:2]


class Sharded(pl.LightningModule):
    """Three Linear layers, each sharded with ``fully_shard`` over the data-parallel mesh in
    ``configure_model``; Adam with a step LR schedule."""

    def __init__(self, features: int = 8, hidden: int = 32, lr: float = 1e-2,
                 samples: int = SAMPLES, **extra: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(),
                                 nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

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
        return DataLoader(Teacher(self.hparams["features"], self.hparams["samples"]),
                          batch_size=BATCH, shuffle=False)


def make_trainer(strategy: PipelineModelParallelStrategy, steps: int, save_every: int,
                 *callbacks: Callback, devices: int = 2, top_k: int = -1,
                 save_last: bool = False, accelerator: str = "cpu",
                 dirpath: str | os.PathLike[str] | None = None) -> pl.Trainer:
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=save_every,
                                 save_top_k=top_k, save_last=save_last)
    return pl.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      deterministic=True, callbacks=[checkpoint, *callbacks],
                      default_root_dir=dirpath)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("logs", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--hold-after", type=int, default=None)
    args = parser.parse_args(argv)

    rank = int(os.environ["RANK"])
    strategy = PipelineModelParallelStrategy(args.root / "ckpt", data_parallel_size=2,
                                             tensor_parallel_size=1,
                                             coordination_timeout_s=60)
    latest = strategy.latest()
    resumed = 0 if latest is None else strategy.step_of(latest) or 0
    losses = args.logs / f"rank-{rank}.losses"
    rewind(losses, resumed)
    (args.logs / f"rank-{rank}.resumed").write_text(f"{resumed}\n")
    callbacks: list[Callback] = [LossLog(losses)]
    if args.hold_after is not None:
        callbacks.append(HoldAfter(strategy, args.hold_after,
                                   args.logs / f"rank-{rank}.ready"))
    trainer = make_trainer(strategy, args.steps, args.save_every, *callbacks,
                           dirpath=args.root / "lightning")
    trainer.fit(Sharded(), ckpt_path=latest)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
