"""The process that ``tests/memory/test_memory_kill.py`` kills: it saves with the memory tier in
a loop until SIGKILL (or a crash point) ends it.

Usage::

    python tests/children/memory_child.py ROOT MEMORY [--last N] [--sequential]

It imports torch, then waits for a line on stdin (an empty stdin ends it quietly), so that the
test can start it while the previous child still runs. It then opens
``CheckpointPipeline(ROOT, memory=MemoryConfig(MEMORY, disk_every=DISK_EVERY))``, restores the
newest step (prints ``resumed S``, 0 when there is none; exits 2 when what it restored is not
exactly step S) and saves steps ``S+1, S+2, ...`` (up to ``N``), each with values that are a
function of the step alone. Once a save's ``result()`` returned (its memory commit) it prints
``acked STEP``, flushed: what the test knows to be acknowledged. ``--sequential`` also waits for
each save's write-through (``durable()``) and retention (``pipe.wait``) before the next save, so
that the crash points are reached in an order that does not depend on timing.

The test imports this module for ``make_state``, ``mismatches`` and its constants.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

import ckpt_pipeline as cp

DISK_EVERY = 3
SLOTS = 3
KEEP = 1
KEEP_LAST = 2
SAMPLES_PER_STEP = 32
RESULT_TIMEOUT_S = 30.0

_BIG = 1 << 20  # 4 MiB of float32: a copy and a hash that take a while
_IDS = 16 * 1024  # 128 KiB of int64


def make_state() -> dict[str, Any]:
    """A state of the layout the child saves, holding the values of no step."""
    return {
        "big": torch.zeros(_BIG, dtype=torch.float32),
        "ids": torch.zeros(_IDS, dtype=torch.int64),
        "extra": {"plain": [-1, ""]},
    }


def expected_tensors(step: int) -> dict[str, torch.Tensor]:
    """The tensors of ``step``: exact in their dtypes (float32 holds integers below 2**24)."""
    return {
        "big": torch.arange(_BIG, dtype=torch.float32).add_(step % 1000),
        "ids": torch.arange(_IDS, dtype=torch.int64).mul_(step + 1).add_(step << 33),
    }


def expected_plain(step: int) -> list[Any]:
    return [step, f"s{step}"]


def train_state(step: int) -> cp.TrainState:
    return cp.TrainState(step=step, consumed_train_samples=step * SAMPLES_PER_STEP,
                         extra={"tag": f"s{step}"})


def set_step(state: dict[str, Any], step: int) -> None:
    """Overwrite every value of ``state`` in place with the values of ``step``."""
    for name, value in expected_tensors(step).items():
        state[name].copy_(value)
    state["extra"]["plain"][:] = expected_plain(step)


def mismatches(state: dict[str, Any], step: int) -> list[str]:
    """What in ``state`` differs from the values of ``step``; empty when all is exact."""
    out = [f"tensor {name}" for name, value in expected_tensors(step).items()
           if not torch.equal(state[name], value)]
    if state["extra"]["plain"] != expected_plain(step):
        out.append(f"extra.plain is {state['extra']['plain']!r}")
    return out


def train_state_mismatch(ts: cp.TrainState, step: int) -> str | None:
    got = (ts.step, ts.consumed_train_samples, dict(ts.extra))
    want = (step, step * SAMPLES_PER_STEP, {"tag": f"s{step}"})
    return None if got == want else f"TrainState {got!r}, expected {want!r}"


def memory_config(memory: str, *, keep_files: bool = False) -> cp.MemoryConfig:
    return cp.MemoryConfig(memory, slots=SLOTS, keep=KEEP, disk_every=DISK_EVERY,
                           keep_files=keep_files)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root")
    parser.add_argument("memory")
    parser.add_argument("--last", type=int, default=None, help="the last step to save")
    parser.add_argument("--sequential", action="store_true",
                        help="wait for each write-through and retention before the next save")
    parser.add_argument("--max-seconds", type=float, default=90.0,
                        help="dump every thread's stack and exit 1 if still running by then")
    return parser.parse_args(argv)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    # This process is the application: it may configure logging (the library never does).
    cp.enable_logging(logging.ERROR)
    torch.set_num_threads(1)
    if not sys.stdin.readline():
        return 0
    faulthandler.dump_traceback_later(args.max_seconds, exit=True)
    state = make_state()
    with cp.CheckpointPipeline(args.root, memory=memory_config(args.memory),
                               keep_last=KEEP_LAST) as pipe:
        restored = pipe.restore_latest(state)
        resumed = 0 if restored is None else restored.step
        if restored is not None:
            bad = mismatches(state, resumed)
            ts_bad = train_state_mismatch(restored.train_state, resumed)
            if bad or ts_bad:
                print(f"restored step {resumed} differs: {bad} {ts_bad}", file=sys.stderr)
                return 2
        _say(f"resumed {resumed}")
        step = resumed + 1
        while args.last is None or step <= args.last:
            set_step(state, step)
            handle = pipe.save(step, state, train_state(step))
            info = handle.result(RESULT_TIMEOUT_S)
            if info.tier != "memory":
                print(f"step {step} committed to {info.tier!r}, not memory", file=sys.stderr)
                return 2
            _say(f"acked {step}")
            if args.sequential:
                handle.durable(RESULT_TIMEOUT_S)
                pipe.wait(RESULT_TIMEOUT_S)
            step += 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's teardown: every result is written by now
