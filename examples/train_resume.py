"""Train a small model with asynchronous checkpoints, and resume it bit-exactly after a crash.

Run it, interrupt it (Ctrl-C, ``kill -9``, power loss), run it again: the second run restores
the model, optimizer, LR scheduler and RNG states from the newest committed checkpoint and
continues as if nothing had happened. On CPU the resumed losses are bit-identical to those of an
uninterrupted run, which ``--loss-log`` lets you check::

    python examples/train_resume.py --loss-log losses.txt   # trains, saving every 50 steps
    python examples/train_resume.py --loss-log losses.txt   # resumes at step 300: nothing to do

Everything that decides a step's result is either saved or a pure function of the step number:

- the batch of step ``k`` comes from a generator seeded with ``seed * 1_000_003 + k``, so a
  resumed run sees the batches the lost run would have seen, without saving a data loader;
- dropout draws from torch's global generator, whose state the pipeline captures at ``save()``
  and re-applies on restore.

The training loop calls ``pipe.wait_snapshot()`` before ``optimizer.step()``: a save copies the
tensors in the background, and that copy must finish before the parameters change in place.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import ckpt_pipeline as cp
except ImportError:  # run from a checkout without installing the package
    sys.exit("ckpt_pipeline is not importable: install it first with `pip install -e .`")

IN_FEATURES = 8
HIDDEN = 64
TEACHER_HIDDEN = 16
DROPOUT = 0.05
LEARNING_RATE = 1e-2
BATCH_SIZE = 64
WARMUP_STEPS = 20


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Read the command line; defaults finish in seconds on a laptop CPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("checkpoints/train_resume"),
                        help="checkpoint directory (default: %(default)s)")
    parser.add_argument("--steps", type=_positive_int, default=300,
                        help="train until this step (default: %(default)s)")
    parser.add_argument("--save-every", type=_positive_int, default=50,
                        help="save every N steps, and always at the last one (default: %(default)s)")
    parser.add_argument("--keep-last", type=_positive_int, default=3,
                        help="committed checkpoints kept on disk (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model, the data and dropout (default: %(default)s)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto picks CUDA when available (default: %(default)s)")
    parser.add_argument("--loss-log", type=Path, default=None,
                        help="append `step loss` per step, loss as float.hex(), to this file")
    parser.add_argument("--sleep-per-step", type=float, default=0.0, metavar="SECONDS",
                        help="slow training down, to have time to interrupt it (default: 0)")
    parser.add_argument("--fresh", action="store_true",
                        help="delete the checkpoint root and the loss log first")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per line instead of text, for scripts")
    parser.add_argument("--verbose", action="store_true",
                        help="show the pipeline's info-level log events on stderr")
    return parser.parse_args(argv)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


class Reporter:
    """Prints progress as sentences for a person, or as JSON lines for a script."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def __call__(self, event: str, text: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}) if self.as_json else text
        print(line, flush=True)


def configure_logging(verbose: bool) -> None:
    """Show the pipeline's log lines on stderr: every commit and restore with ``--verbose``,
    else only warnings and errors.

    The library is silent until asked (stdlib logging, logger ``ckpt_pipeline``); this is the
    one call that asks.
    """
    cp.enable_logging(logging.INFO if verbose else logging.WARNING)


def pick_device(choice: str) -> torch.device:
    """Resolve ``--device``; asking for CUDA on a machine without it is an error, not a fallback."""
    if choice == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


class Teacher:
    """The hidden function the model learns: a fixed random two-layer network plus noise."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        w1 = torch.randn(IN_FEATURES, TEACHER_HIDDEN, generator=generator)
        w2 = torch.randn(TEACHER_HIDDEN, 1, generator=generator)
        self.w1 = w1 / math.sqrt(IN_FEATURES)
        self.w2 = w2 / math.sqrt(TEACHER_HIDDEN)
        self.seed = seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step``: a pure function of the seed and the step, made on the CPU."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(BATCH_SIZE, IN_FEATURES, generator=generator)
        noise = 0.05 * torch.randn(BATCH_SIZE, 1, generator=generator)
        return x, torch.sin(x @ self.w1) @ self.w2 + noise


def build_model(seed: int, device: torch.device) -> nn.Module:
    """A three-layer MLP with dropout, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.GELU(), nn.Dropout(DROPOUT),
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(DROPOUT),
        nn.Linear(HIDDEN, 1),
    ).to(device)


def warmup_cosine(total_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warm-up, then cosine decay to 10 % at ``total_steps``."""

    def factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = min(1.0, (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return factor


def rewind_loss_log(path: Path, step: int) -> None:
    """Keep only the log lines of steps up to ``step``, the step training resumes after.

    A crashed run may have logged steps past its last committed checkpoint, and may have died
    half-way through a line. Those steps are trained again, so their old lines go; the log then
    always describes the trajectory that produced the current model.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        fields = line.split()
        if line.endswith("\n") and len(fields) == 2 and int(fields[0]) <= step:
            kept.append(line)
    path.write_text("".join(kept))


def train(args: argparse.Namespace) -> None:
    """Restore what the last run committed, train to ``args.steps``, save along the way."""
    report = Reporter(args.json)
    if args.fresh:
        shutil.rmtree(args.root, ignore_errors=True)
        if args.loss_log is not None:
            args.loss_log.unlink(missing_ok=True)

    device = pick_device(args.device)
    teacher = Teacher(args.seed)
    model = build_model(args.seed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}

    with cp.CheckpointPipeline(args.root, keep_last=args.keep_last) as pipe:
        restored = pipe.restore_latest(state)
        if restored is None:
            ts = cp.TrainState()
            report("started", f"started fresh in {args.root} on {device}",
                   root=str(args.root), device=str(device))
        else:
            ts = restored.train_state
            report("resumed", f"resumed from step {restored.step} ({restored.path}) on {device}",
                   step=restored.step, path=str(restored.path), device=str(device))
        if args.loss_log is not None:
            args.loss_log.parent.mkdir(parents=True, exist_ok=True)
            rewind_loss_log(args.loss_log, ts.step)

        first_step = ts.step + 1
        pending: list[cp.SaveHandle] = []
        model.train()
        log_file = args.loss_log.open("a") if args.loss_log is not None else nullcontext()
        with log_file as log:
            for step in range(first_step, args.steps + 1):
                x, y = (t.to(device) for t in teacher.batch(step))
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                pipe.wait_snapshot()  # a save may still be copying the parameters
                optimizer.step()
                scheduler.step()

                loss_value = loss.item()
                ts = ts.advanced(step=step, samples=BATCH_SIZE, loss=loss_value)
                if log is not None:
                    log.write(f"{step} {loss_value.hex()}\n")
                    log.flush()
                if step % args.save_every == 0 or step == args.steps:
                    pending.append(pipe.save(step, state, ts))
                    report("saving", f"step {step}: loss {loss_value:.5f}, saving",
                           step=step, loss=loss_value)
                pending = _report_committed(pending, report, wait=False)
                if args.sleep_per_step > 0:
                    time.sleep(args.sleep_per_step)

        pipe.wait()
        _report_committed(pending, report, wait=True)

    trained = max(0, args.steps - first_step + 1)
    final_loss = ts.extra.get("loss")
    loss_text = "n/a" if final_loss is None else f"{final_loss:.5f}"
    if trained:
        text = f"finished at step {ts.step} after {trained} steps; final loss {loss_text}"
    else:
        text = (f"nothing to train: resumed from the checkpoint of step {ts.step}, which is "
                f"already --steps {args.steps}; loss {loss_text}. To train further, run again "
                f"with a larger --steps (e.g. --steps {args.steps + 100})")
    report("finished", text, step=ts.step, trained_steps=trained, loss=final_loss)


def _report_committed(
    pending: list[cp.SaveHandle], report: Reporter, *, wait: bool
) -> list[cp.SaveHandle]:
    """Report the saves that committed; return those still in flight.

    ``result()`` re-raises a failed save's error, which ends the run: the previous checkpoint is
    intact, and the next run resumes from it.
    """
    still_pending = []
    for handle in pending:
        if not (wait or handle.done()):
            still_pending.append(handle)
            continue
        info = handle.result()
        report("committed", f"committed step {info.step}: {info.bytes} bytes in {info.path}",
               step=info.step, bytes=info.bytes, path=str(info.path))
    return still_pending


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
