"""One rank of a two-rank Lightning DDP run (gloo, CPU) that checkpoints through
``PipelineCheckpointIO``, for ``test_lightning_ddp.py``.

Started once per rank with the environment that Lightning's ``LightningEnvironment`` reads for
processes created outside it (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``NODE_RANK``)::

    python lightning_ddp_child.py ROOT OUT --steps N --save-every K [--hold-after S]

Resumes from ``io.latest()`` of ``ROOT/ckpt`` (if any), trains to step N saving every K steps,
and writes into ``OUT`` for its rank r:

- ``rank-r.losses``: ``step loss.hex()`` a line (rewound first to the resumed step);
- ``rank-r.loaded``: the ``global_step`` of the checkpoint dict this rank loaded (not written
  on a fresh start);
- ``rank-r.saved``: a line per step that Lightning handed to this rank's ``save_checkpoint``;
- ``rank-r.after-fit``: the committed steps this rank sees once ``trainer.fit`` returned.

With ``--hold-after S``, once step S has trained (and, on rank 0, every save so far is
committed) it writes ``rank-r.ready`` and blocks, so that a test can kill it at a known point.
The model, the data and the loss log are ``lightning_child.py``'s; under DDP Lightning gives
each rank half of the data through a ``DistributedSampler`` (no shuffling).
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

from ckpt_pipeline.integrations.lightning import PipelineCheckpointIO
from tests.integrations.lightning_child import HoldAfter, LossLog, Regressor, rewind


class RecordingIO(PipelineCheckpointIO):
    """``PipelineCheckpointIO`` that appends each step it is asked to save to ``saved``."""

    def __init__(self, root: Path, saved: Path) -> None:
        super().__init__(root)
        self.saved = saved

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        with self.saved.open("a") as out:
            out.write(f"{checkpoint['global_step']}\n")
        super().save_checkpoint(checkpoint, path, storage_options)


class LoadedStep(Callback):
    """Writes the ``global_step`` of the checkpoint dict this rank loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self.path.write_text(f"{checkpoint['global_step']}\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--hold-after", type=int, default=None)
    args = parser.parse_args(argv)

    rank = int(os.environ["RANK"])
    out: Path = args.out
    io = RecordingIO(args.root / "ckpt", out / f"rank-{rank}.saved")
    latest = io.latest()
    losses = out / f"rank-{rank}.losses"
    rewind(losses, 0 if latest is None else io.step_of(latest) or 0)
    callbacks: list[Callback] = [io.callback(), LossLog(losses), LoadedStep(
        out / f"rank-{rank}.loaded"), ModelCheckpoint(
        dirpath=args.root / "lightning", every_n_train_steps=args.save_every, save_top_k=-1)]
    if args.hold_after is not None:
        callbacks.append(HoldAfter(io, args.hold_after, out / f"rank-{rank}.ready"))
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, num_nodes=1,
                         max_steps=args.steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True, plugins=[io],
                         callbacks=callbacks, default_root_dir=args.root / "lightning")
    trainer.fit(Regressor(), ckpt_path=latest)
    (out / f"rank-{rank}.after-fit").write_text(" ".join(map(str, io.committed_steps())) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
