"""The process that ``tests/reliability/test_crash.py`` kills: it saves checkpoints in a loop
until SIGKILL.

Usage::

    python tests/children/crash_child.py ROOT --ack FILE [--trace FILE] [--start-step N]

It opens ``CheckpointPipeline(ROOT, keep_last=2)``, restores the newest checkpoint (which must
be step ``N - 1``, or nothing when ``N`` is 1), then saves steps ``N, N+1, ...`` with every
tensor set to values that are a function of the step alone. It waits for the commit of every
``AWAIT_EVERY``-th step and, once ``result()`` has returned, appends that step to the ack file
and fsyncs it: the ack file is what the test knows to be acknowledged.

Without ``--start-step`` the start step is read from stdin, so that the test can start a child
(and let it import torch) while the previous one is still running; an empty stdin ends the
child quietly. ``--trace`` gets a line ``TIME STEP WHAT`` per pipeline event (``WHAT`` is the
event's class name), at the start and per acknowledgement, written without fsync (it survives
SIGKILL, not a power cut): its last line tells where a kill landed.

The test imports this module for ``make_state``, ``mismatches`` and its constants.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import ckpt_pipeline as cp

KEEP_LAST = 2
AWAIT_EVERY = 3
SAMPLES_PER_STEP = 32

_IN, _OUT = 256, 512  # the Linear's weight: 512 KiB of float32
_IDS = 64 * 1024  # 512 KiB of int64
_HALF = 128 * 1024  # 256 KiB of bfloat16


def make_state() -> dict[str, Any]:
    """A state of the layout the child saves, holding the values of no step."""
    return {
        "model": nn.Linear(_IN, _OUT),
        "tensors": {
            "ids": torch.zeros(_IDS, dtype=torch.int64),
            "half": torch.zeros(_HALF, dtype=torch.bfloat16),
        },
        "extra": {"plain": [-1, "", 0.0]},
    }


def _live_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    model = state["model"]
    return {
        "model.weight": model.weight,
        "model.bias": model.bias,
        "tensors.ids": state["tensors"]["ids"],
        "tensors.half": state["tensors"]["half"],
    }


def expected_tensors(step: int) -> dict[str, torch.Tensor]:
    """The tensor values of ``step``: cheap to compute, exact in their dtypes, unique per step."""
    weight = torch.arange(_OUT * _IN, dtype=torch.float32).add_(step).mul_(0.5)
    return {
        "model.weight": weight.view(_OUT, _IN),
        "model.bias": torch.arange(_OUT, dtype=torch.float32).sub_(step),
        "tensors.ids": torch.arange(_IDS, dtype=torch.int64).mul_(step + 1).add_(step << 40),
        # bfloat16 holds every integer up to 256 exactly.
        "tensors.half": torch.arange(_HALF).remainder_(97).add_(step % 151).to(torch.bfloat16),
    }


def expected_plain(step: int) -> list[Any]:
    return [step, f"s{step}", step / 4]


def train_state(step: int) -> cp.TrainState:
    return cp.TrainState(step=step, consumed_train_samples=step * SAMPLES_PER_STEP,
                         extra={"tag": f"s{step}"})


def set_step(state: dict[str, Any], step: int) -> None:
    """Overwrite every value of ``state`` in place with the values of ``step``."""
    live = _live_tensors(state)
    with torch.no_grad():
        for name, value in expected_tensors(step).items():
            live[name].copy_(value)
    state["extra"]["plain"][:] = expected_plain(step)


def mismatches(state: dict[str, Any], step: int) -> list[str]:
    """What in ``state`` differs from the values of ``step``; empty when all is exact."""
    live = _live_tensors(state)
    out = [f"tensor {name}" for name, value in expected_tensors(step).items()
           if not torch.equal(live[name], value)]
    if state["extra"]["plain"] != expected_plain(step):
        out.append(f"extra.plain is {state['extra']['plain']!r}, "
                   f"expected {expected_plain(step)!r}")
    return out


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root")
    parser.add_argument("--ack", required=True, help="file of acknowledged steps")
    parser.add_argument("--trace", help="file of pipeline events (diagnostics)")
    parser.add_argument("--start-step", type=int, help="first step to save (else from stdin)")
    parser.add_argument("--max-seconds", type=float, default=120.0,
                        help="give up (exit 3) if not killed by then")
    return parser.parse_args(argv)


def _tracer(path: str | None) -> Callable[[int, str], None]:
    """A function that appends ``TIME STEP WHAT`` to ``path`` in one write (no-op without it)."""
    if path is None:
        return lambda step, what: None
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def trace(step: int, what: str) -> None:
        os.write(fd, f"{time.monotonic():.6f} {step} {what}\n".encode())

    return trace


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    # This process is the application: it may configure logging (the library never does).
    cp.enable_logging(logging.WARNING)
    torch.set_num_threads(1)  # tensors this small only lose time to intra-op threads
    start = args.start_step
    if start is None:
        line = sys.stdin.readline()
        if not line:
            return 0
        start = int(line)
    deadline = time.monotonic() + args.max_seconds
    trace = _tracer(args.trace)
    ack_fd = os.open(args.ack, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    state = make_state()
    pipe = cp.CheckpointPipeline(args.root, keep_last=KEEP_LAST)
    pipe.subscribe(lambda event: trace(event.step, type(event).__name__))
    with pipe:
        restored = pipe.restore_latest(state)
        resumed = 0 if restored is None else restored.step
        if start != resumed + 1:
            print(f"restored step {resumed}, but was told to start at {start}", file=sys.stderr)
            return 2
        if restored is not None and (bad := mismatches(state, resumed)):
            print(f"restored step {resumed} differs: {bad}", file=sys.stderr)
            return 2
        trace(start, "started")
        step = start
        while time.monotonic() < deadline:
            set_step(state, step)
            handle = pipe.save(step, state, train_state(step))
            if step % AWAIT_EVERY == 0:
                handle.result()
                os.write(ack_fd, f"{step}\n".encode())
                os.fsync(ack_fd)
                trace(step, "acked")
            step += 1
    print(f"not killed within {args.max_seconds} s", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
