"""A small training run under ``accelerate``, checkpointed through the pipeline.

Imported by ``test_accelerate.py`` (``train``, in the test's process) and run as a child
process, one per rank with the environment ``torchrun`` would set::

    python tests/integrations/accelerate_child.py --root ROOT --log LOSSES [--stop-after N]
        [--hang-after N --ready READY]

Everything that decides a step's loss is saved or fixed: the model's weights, AdamW's moments,
the LR schedule, dropout's RNG (the pipeline's TrainState), the data order (a DataLoader with
``shuffle=True`` and a seeded generator, whose position is the checkpoint's) and a registered
running mean, which is logged beside each loss so that its restore is checked too. Each line of
the log is ``step loss mean`` (floats as ``float.hex()``); a resumed run first cuts the log back
to the restored step, so that a resumed log reads as one uninterrupted run's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckpt_pipeline as cp
from ckpt_pipeline.integrations.accelerate import (
    ResumableLoader,
    load_state,
    save_state,
    step_after_snapshot,
)

EPOCHS = 3
SAMPLES = 48
BATCH = 8
SAVE_EVERY = 4


class RunningMean:
    """A registered object: the mean of the losses so far."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def update(self, value: float) -> float:
        self.total += value
        self.count += 1
        return self.total / self.count

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total, self.count = float(state["total"]), int(state["count"])


def cut_log(log: Path, step: int) -> None:
    """Keep the lines of steps up to ``step``: those a restore of ``step`` continues."""
    if log.exists():
        lines = [line for line in log.read_text().splitlines() if int(line.split()[0]) <= step]
        log.write_text("".join(f"{line}\n" for line in lines))


def train(root: Path, log: Path, *, stop_after: int | None = None,
          hang_after: int | None = None, ready: Path | None = None, cpu: bool = True,
          on_save: Callable[[int, nn.Module], None] | None = None) -> int | None:
    """Train (resuming from ``root`` when it holds a step) for ``EPOCHS`` epochs; return the
    restored step (None for a fresh start). ``stop_after`` returns after that step;
    ``hang_after`` saves at that step, writes ``ready`` once an earlier save committed, and
    then blocks until killed. ``cpu=False``: on the accelerator's device (CUDA).
    ``on_save(step, model)`` is called right after each save is handed to the pipeline, before
    the next optimizer step: the model holds the values that step saved."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=cpu)
    data = torch.Generator().manual_seed(1)
    inputs = torch.randn(SAMPLES, 4, generator=data)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler,
                                                              loader)
    mean = RunningMean()
    accelerator.register_for_checkpointing(mean)
    batches = ResumableLoader(accelerator, loader)
    rank = accelerator.process_index

    with cp.CheckpointPipeline(root, keep_last=2, coordination_timeout_s=60) as pipe:
        restored = load_state(accelerator, pipe)
        step = 0 if restored is None else restored.step
        cut_log(log, step)
        committed: list[cp.SaveHandle] = []
        with log.open("a") as out:
            for _epoch in range(batches.epoch, EPOCHS):
                for x, y in batches:
                    step += 1
                    loss = nn.functional.mse_loss(model(x), y)
                    optimizer.zero_grad()
                    accelerator.backward(loss)
                    step_after_snapshot(pipe, optimizer)
                    scheduler.step()
                    value = loss.item()
                    out.write(f"{step} {value.hex()} {mean.update(value).hex()}\n")
                    out.flush()
                    if step % SAVE_EVERY == 0 or step == hang_after:
                        committed.append(save_state(accelerator, pipe, step,
                                                    train_state=cp.TrainState(step=step)))
                        if on_save is not None:
                            on_save(step, accelerator.unwrap_model(model))
                    if step == hang_after:
                        for handle in committed[:-1]:  # all but this step's save
                            handle.result(timeout=60)
                        assert ready is not None
                        ready.write_text(f"{rank}\n")
                        sys.stdin.read()  # the test never writes: block until killed
                    if step == stop_after:
                        pipe.wait()
                        return None if restored is None else restored.step
        pipe.wait()
    return None if restored is None else restored.step


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True, help="this rank's loss log")
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--hang-after", type=int)
    parser.add_argument("--ready", type=Path)
    parser.add_argument("--restored", type=Path, help="write the restored step here")
    args = parser.parse_args(argv)
    restored = train(args.root, args.log, stop_after=args.stop_after,
                     hang_after=args.hang_after, ready=args.ready)
    if args.restored is not None:
        args.restored.write_text(f"{restored}\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
