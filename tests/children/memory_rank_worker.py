"""One rank of ``tests/memory/test_memory_ranks.py``: several gloo ranks with the memory tier.

Usage (one process per rank, the environment set as ``torchrun`` would set it)::

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python tests/children/memory_rank_worker.py PHASE --root ROOT --memory MEMORY --out OUT

It joins a gloo process group and opens ``CheckpointPipeline(ROOT, memory=MemoryConfig(MEMORY,
keep=KEEP, disk_every=DISK_EVERY))``: the disk root and the memory directory are shared by the
ranks of the job. Then:

- ``save``: saves ``SAVE_STEPS``, waiting for each handle's result and ``durable()`` (only the
  first is written through: the newer steps are in memory only), writes OUT, waits for every
  rank (a barrier) and SIGKILLs itself: the job dies without closing its pipelines;
- ``resume``: restores the newest step S (prints ``resumed S COUNT MISMATCHES``; S is 0 when
  there is none), then as ``save`` with steps S+1 .. S+N (``--saves N``, default
  ``RESUME_SAVES``; 0: until killed), the first written through;
- ``restore``: restores into a state of zeros, writes OUT and closes cleanly.

A save prints ``acked STEP`` once its ``durable()`` returned. A test that arms a crash point
(``CKPT_PIPELINE_CRASH_AT``) in one rank's environment kills the others once that rank died.

OUT is JSON: per save the tier of its commit and whether it became durable; per restore the
step, ``from_memory``, ``valid_by_rank``, the rejected steps, the TrainState and which values
differ from those this rank saved at that step (every value is a function of step and rank).

The test imports this module for ``SAVE_STEPS``, ``KEEP`` and ``SAMPLES_PER_STEP``.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import itertools
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ckpt_pipeline as cp

SAVE_STEPS = (1, 2, 3, 4)
KEEP = 2
SLOTS = KEEP + 2
DISK_EVERY = 100
RESUME_SAVES = 2
SAMPLES_PER_STEP = 32
RESULT_TIMEOUT_S = 60.0
W_NUMEL = 64 * 1024  # 256 KiB of float32 per rank


def make_state() -> dict[str, Any]:
    return {"w": torch.zeros(W_NUMEL), "b": torch.zeros(8, dtype=torch.int64),
            "meta": {"step": -1, "rank": -1}}


def expected_tensors(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Exact in their dtypes and unique per (step, rank)."""
    return {"w": torch.arange(W_NUMEL, dtype=torch.float32).add_(step * 16 + rank),
            "b": torch.arange(8, dtype=torch.int64).mul_(step).add_(rank << 20)}


def set_step(state: dict[str, Any], step: int, rank: int) -> None:
    for name, value in expected_tensors(step, rank).items():
        state[name].copy_(value)
    state["meta"] = {"step": step, "rank": rank}


def mismatches(state: dict[str, Any], step: int, rank: int) -> list[str]:
    out = [name for name, value in expected_tensors(step, rank).items()
           if not torch.equal(state[name], value)]
    if state["meta"] != {"step": step, "rank": rank}:
        out.append(f"meta is {state['meta']!r}")
    return out


def train_state(step: int) -> cp.TrainState:
    """The same on every rank."""
    return cp.TrainState(step=step, consumed_train_samples=step * SAMPLES_PER_STEP,
                         extra={"tag": f"s{step}"})


def _pipeline(args: argparse.Namespace) -> cp.CheckpointPipeline:
    memory = cp.MemoryConfig(str(args.memory), slots=SLOTS, keep=KEEP, disk_every=DISK_EVERY)
    return cp.CheckpointPipeline(args.root, memory=memory, keep_last=len(SAVE_STEPS),
                                 coordination_timeout_s=args.coordination_timeout)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(data, indent=1))
    os.replace(temp, path)


def run_save(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    state = make_state()
    saves: list[dict[str, Any]] = []
    pipe = _pipeline(args)
    pipe.__enter__()  # never left: the job is killed with its pipeline open
    steps: Iterable[int] = SAVE_STEPS
    out: dict[str, Any] = {"saves": saves}
    if args.phase == "resume":
        restored = pipe.restore_latest(state)
        resumed = 0 if restored is None else restored.step
        bad = [] if restored is None else mismatches(state, resumed, rank)
        if restored is not None and restored.train_state.step != resumed:
            bad.append(f"TrainState step {restored.train_state.step}")
        out["resumed"] = resumed
        print(f"resumed {resumed} {len(bad)} {bad}", flush=True)
        steps = itertools.count(resumed + 1) if args.saves == 0 else \
            range(resumed + 1, resumed + 1 + args.saves)
    for step in steps:
        set_step(state, step, rank)
        handle = pipe.save(step, state, train_state(step))
        info = handle.result(RESULT_TIMEOUT_S)
        durable = handle.durable(RESULT_TIMEOUT_S)
        saves.append({"step": step, "tier": info.tier,
                      "durable": None if durable is None else durable.tier})
        print(f"acked {step}", flush=True)
    return out


def run_restore(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    state = make_state()
    with _pipeline(args) as pipe:
        result = pipe.restore_latest(state)
    if result is None:
        return {"step": None}
    ts = result.train_state
    return {
        "step": result.step,
        "from_memory": list(result.from_memory),
        "valid_by_rank": {str(r): list(s) for r, s in result.valid_by_rank.items()},
        "rejected": [{"step": r.step, "path": r.path, "reason": r.reason}
                     for r in result.rejected],
        "train_state": {"step": ts.step, "consumed_train_samples": ts.consumed_train_samples,
                        "extra": dict(ts.extra)},
        "mismatches": mismatches(state, result.step, rank),
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=("save", "resume", "restore"))
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--memory", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--saves", type=int, default=RESUME_SAVES,
                        help="resume: steps to save (0: until killed)")
    parser.add_argument("--coordination-timeout", type=float, default=30.0)
    parser.add_argument("--max-seconds", type=float, default=100.0,
                        help="dump every thread's stack and exit 1 if still running by then")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    # This process is the application: it may configure logging (the library never does).
    cp.enable_logging(logging.WARNING)
    faulthandler.dump_traceback_later(args.max_seconds, exit=True)
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out: dict[str, Any] = {"rank": rank, "world_size": world_size, "phase": args.phase}
    try:
        out["result"] = (run_restore if args.phase == "restore" else run_save)(args, rank)
    except Exception as exc:
        out["error"] = {"type": type(exc).__name__, "message": str(exc),
                        "traceback": "".join(traceback.format_exception(exc))}
    _write_json(args.out, out)
    if args.phase != "restore" and "error" not in out:
        dist.barrier()  # every rank saved every step: now the job dies, pipelines open
        os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's teardown: every result is written by now
