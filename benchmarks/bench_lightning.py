"""Time inside Lightning's checkpoint call: PipelineCheckpointIO against TorchCheckpointIO.

One run trains the same model (Linear layers, Adam: a state of about ``--mb`` MB with the
optimizer's moments) twice, once per CheckpointIO, on the CPU or (``--device cuda``) on one
GPU, and calls ``trainer.save_checkpoint(path)`` at the end of every step. Reported per save:
the time the call blocks training (for the pipeline: until the tensors are copied on the CPU,
until their copies are queued on CUDA; the write goes on in the background) and, for the
pipeline, the time until the step is committed (measured after the call by waiting for it,
outside the blocking figure; it includes the fsyncs, which ``torch.save`` behind
TorchCheckpointIO does not make). The first save of the pipeline allocates its host buffer and
is reported apart. On CUDA the pipeline's ``wait_snapshot()`` and the copies' completion are
timed too (``_call_timing.py`` says what each figure is); the ``comparison`` block of the JSON
holds the medians and the ratios ours / default.

    python benchmarks/bench_lightning.py --out benchmarks/results/lightning_ckpt.json
    python3 benchmarks/bench_lightning.py --device cuda --out /tmp/lightning_ckpt_cuda.json  # 1 GB
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _call_timing import DEVICES, CallTimer, comparison, print_table, resolve_device
from _machine import machine_info

from ckpt_pipeline.integrations.lightning import PipelineCheckpointIO


class Wide(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class TimeSaves(Callback):
    def __init__(self, directory: Path, io: Any, device: torch.device) -> None:
        self.directory, self.io = directory, io
        self.timer = CallTimer(device)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        path = self.directory / f"step={trainer.global_step}.ckpt"
        if isinstance(self.io, PipelineCheckpointIO):
            self.timer.time_call(lambda: trainer.save_checkpoint(path, weights_only=False),
                                 self.io.wait_snapshot)
            self.io.committed_steps()  # waits for the commit
            self.timer.mark_committed()
        else:
            self.timer.time_call(lambda: trainer.save_checkpoint(path, weights_only=False))
            path.unlink()


def run(io: Any, directory: Path, width: int, layers: int, saves: int,
        device: torch.device) -> CallTimer:
    timer = TimeSaves(directory, io, device)
    callbacks: list[Callback] = [timer]
    if isinstance(io, PipelineCheckpointIO):
        callbacks.insert(0, io.callback())  # wait_snapshot before each optimizer step
    data = DataLoader(TensorDataset(torch.randn(64, width)), batch_size=16)
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                         max_steps=saves, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, plugins=[io], callbacks=callbacks)
    trainer.fit(Wide(width, layers), data)
    return timer.timer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lightning_ckpt.json"))
    parser.add_argument("--dir", type=Path, default=None,
                        help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the model, the optimizer state and the training run")
    parser.add_argument("--mb", type=float, default=None,
                        help="state size in MB, optimizer moments included (default 150 on "
                             "the CPU, 1000 on CUDA)")
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    device = resolve_device(args.device)
    mb = args.mb if args.mb is not None else (1000.0 if device.type == "cuda" else 150.0)

    width = 1024
    layers = max(1, round(mb * 1e6 / (3 * 4 * (width * width + width))))
    state_bytes = 3 * 4 * layers * (width * width + width)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        machine = machine_info(work, gpu=device.type == "cuda")
        (work / "torch").mkdir()
        torch_t = run(TorchCheckpointIO(), work / "torch", width, layers, args.saves, device)
        ours = PipelineCheckpointIO(work / "pipeline")
        ours_t = run(ours, work / "pipeline-names", width, layers, args.saves, device)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "benchmark": "bench_lightning",
        "device": device.type,
        "state_bytes": state_bytes,
        "saves": args.saves,
        "machine": machine,
        "torch_checkpoint_io": {"blocking_s": torch_t.call,
                                "median_blocking_s": statistics.median(torch_t.call)},
        "pipeline_checkpoint_io": {
            "blocking_s": ours_t.call, "committed_s": ours_t.committed,
            "first_blocking_s": ours_t.call[0],
            "median_blocking_s": statistics.median(ours_t.call[1:] or ours_t.call),
            "median_committed_s": statistics.median(ours_t.committed[1:] or ours_t.committed)},
        "comparison": comparison(ours_t, torch_t, ours_name="PipelineCheckpointIO",
                                 default_name="TorchCheckpointIO", state_bytes=state_bytes),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    tm, om = result["torch_checkpoint_io"], result["pipeline_checkpoint_io"]
    print(f"state {state_bytes / 1e6:.0f} MB on {device.type}, {args.saves} saves each, "
          f"trainer.save_checkpoint blocking time (median)")
    print(f"{'CheckpointIO':<26}{'blocking s':>12}{'first s':>10}{'committed s':>13}")
    print(f"{'TorchCheckpointIO':<26}{tm['median_blocking_s']:>12.3f}"
          f"{tm['blocking_s'][0]:>10.3f}{'(no fsync)':>13}")
    print(f"{'PipelineCheckpointIO':<26}{om['median_blocking_s']:>12.3f}"
          f"{om['first_blocking_s']:>10.3f}{om['median_committed_s']:>13.3f}")
    print_table([("lightning", result["comparison"])])
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
