"""One rank of the multi-process tests in ``tests/coordination/test_distributed.py``.

Usage (one process per rank, the environment set as ``torchrun`` would set it)::

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python tests/children/dist_worker.py SCENARIO --phase PHASE[,PHASE...] --root ROOT \\
            [--shared] --out OUT.json

It joins a gloo process group, then runs each phase in order, each with a pipeline of its own
(``cp.CheckpointPipeline``, which coordinates over torch.distributed because it is initialized):

- ``save``: saves steps 10 and 20, waiting for each handle's result before the next save;
- ``restore``: restores into a state of zeros.

``SCENARIO`` injects faults through the pipeline's storage (``storage=``); the ranks and phases
it does not name use plain ``LocalStorage``:

- ``plain``: no fault;
- ``failing-fsync``: in ``save``, fsync of rank ``FAULTY_RANK``'s step-20 shard raises an
  injected StorageError;
- ``killed-mid-save``: in ``save``, rank ``FAULTY_RANK`` SIGKILLs itself at the first write of
  its step-20 shard;
- ``stuck-mid-save``: in ``save``, that first write never returns (until the process is
  killed);
- ``move-aside-race``: no fault in ``save``; in ``restore`` (shared root, 2 ranks) rank
  ``FAULTY_RANK`` moves its step-20 files aside first, the other rank then moves its own and
  removes the emptied directory, and only then does rank ``FAULTY_RANK`` flush that directory:
  one interleaving of ranks that move a step aside at the same time, made certain.

The root of rank r is ``ROOT`` with ``--shared``, else ``ROOT/rank-r``. After each phase the
rank's results so far are written to ``OUT`` (atomically) as JSON: per save, the outcome of its
handle; per restore, the step, ``valid_by_rank``, the rejected steps, the TrainState and which
values differ from those saved at that step by this rank; errors as type, message, step, rank,
``ranks`` and traceback. Every value saved is a function of (step, rank), so the test can check
them exactly.

The test imports this module for ``SAVE_STEPS``, ``FAULTY_RANK`` and ``SAMPLES_PER_STEP``.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ckpt_pipeline as cp

SAVE_STEPS = (10, 20)
FAULTY_RANK = 1
FAULTY_STEP = 20
SAMPLES_PER_STEP = 32
ORDER_WAIT_S = 10.0
"""How long ``move-aside-race`` waits for the other rank before going on regardless."""
W_NUMEL = 4096  # 16 KiB of float32: the shard's data region spans several 4 KiB pages

SCENARIOS = ("plain", "failing-fsync", "killed-mid-save", "stuck-mid-save", "move-aside-race")
PHASES = ("save", "restore")


# ---------------------------------------------------------------- the state of one rank

def make_state() -> dict[str, Any]:
    """A state of the saved layout, holding the values of no step."""
    model = nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    return {"w": torch.zeros(W_NUMEL), "model": model, "meta": {"step": -1, "rank": -1}}


def expected_tensors(step: int, rank: int) -> dict[str, torch.Tensor]:
    """The tensors of ``step`` on ``rank``: exact in float32 and unique per (step, rank)."""
    return {
        "w": torch.arange(W_NUMEL, dtype=torch.float32).add_(step * 16 + rank),
        "model.weight": torch.arange(32, dtype=torch.float32).mul_(0.5).add_(step - rank)
        .view(4, 8),
        "model.bias": torch.full((4,), float(step * 100 + rank)),
    }


def _live(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"w": state["w"], "model.weight": state["model"].weight,
            "model.bias": state["model"].bias}


def set_step(state: dict[str, Any], step: int, rank: int) -> None:
    """Overwrite every value of ``state`` in place with those of (step, rank)."""
    live = _live(state)
    with torch.no_grad():
        for name, value in expected_tensors(step, rank).items():
            live[name].copy_(value)
    state["meta"] = {"step": step, "rank": rank}


def mismatches(state: dict[str, Any], step: int, rank: int) -> list[str]:
    """What in ``state`` differs from the values of (step, rank); empty when all is exact."""
    live = _live(state)
    out = [name for name, value in expected_tensors(step, rank).items()
           if not torch.equal(live[name], value)]
    if state["meta"] != {"step": step, "rank": rank}:
        out.append(f"meta is {state['meta']!r}")
    return out


def train_state(step: int) -> cp.TrainState:
    """The same on every rank."""
    return cp.TrainState(step=step, consumed_train_samples=step * SAMPLES_PER_STEP,
                         extra={"tag": f"s{step}"})


# ---------------------------------------------------------------- injected faults

class _StepShardFault(cp.LocalStorage):
    """Recognises the descriptors of this rank's shard of one step (temporaries included)."""

    def __init__(self, root: Path, step: int) -> None:
        super().__init__(root)
        self.step_dir = f"step-{step:010d}"
        self._fds: set[int] = set()

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        fd, name = super().create_temp(rel_dir, final_name)
        if rel_dir == self.step_dir and final_name.endswith(".shard"):
            self._fds.add(fd)
        return fd, name

    def close(self, fd: int) -> None:
        self._fds.discard(fd)
        super().close(fd)


class FsyncFails(_StepShardFault):
    """fsync of the step's shard raises an injected StorageError (EIO)."""

    def fsync(self, fd: int) -> None:
        if fd in self._fds:
            err = cp.StorageError(f"fsync failed: injected EIO ({self.step_dir})")
            err.errno = errno.EIO
            raise err
        super().fsync(fd)


class DiesWriting(_StepShardFault):
    """The process is SIGKILLed at the first write of the step's shard."""

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        if fd in self._fds:
            os.kill(os.getpid(), signal.SIGKILL)
        super().pwrite(fd, data, offset)


class HangsWriting(_StepShardFault):
    """The first write of the step's shard blocks for good: a rank stuck in I/O."""

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        if fd in self._fds:
            threading.Event().wait()
        super().pwrite(fd, data, offset)


class OrdersMoveAside(cp.LocalStorage):
    """Orders two ranks that move their files of one step out of a shared step directory.

    Rank ``FAULTY_RANK`` moves first; the other rank starts moving once those files are gone;
    rank ``FAULTY_RANK`` flushes the directory only once it no longer exists. Each wait watches
    the directory and gives up after ``ORDER_WAIT_S``.
    """

    def __init__(self, root: Path, step: int, rank: int) -> None:
        super().__init__(root)
        self.rank = rank
        self.step_dir = f"step-{step:010d}"

    def _wait_until(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + ORDER_WAIT_S
        while not done() and time.monotonic() < deadline:
            time.sleep(0.005)

    def _faulty_files_left(self) -> bool:
        prefix = f"rank-{FAULTY_RANK:05d}."
        return any(e.name.startswith(prefix) for e in self.list_dir(self.step_dir))

    def move(self, rel_src: str, rel_dst: str) -> None:
        if self.rank != FAULTY_RANK and os.path.dirname(rel_src) == self.step_dir:
            self._wait_until(lambda: not self._faulty_files_left())
        super().move(rel_src, rel_dst)

    def fsync_dir(self, rel: str) -> None:
        if self.rank == FAULTY_RANK and rel == self.step_dir:
            self._wait_until(lambda: not os.path.lexists(self.root / self.step_dir))
        super().fsync_dir(rel)


def storage_for(scenario: str, phase: str, root: Path, rank: int) -> cp.LocalStorage:
    """The storage of ``rank`` in ``phase`` of ``scenario``."""
    if phase == "restore":
        if scenario == "move-aside-race":
            return OrdersMoveAside(root, FAULTY_STEP, rank)
        return cp.LocalStorage(root)
    if rank != FAULTY_RANK:
        return cp.LocalStorage(root)
    if scenario == "failing-fsync":
        return FsyncFails(root, FAULTY_STEP)
    if scenario == "killed-mid-save":
        return DiesWriting(root, FAULTY_STEP)
    if scenario == "stuck-mid-save":
        return HangsWriting(root, FAULTY_STEP)
    return cp.LocalStorage(root)


# ---------------------------------------------------------------- phases

def _error(exc: BaseException) -> dict[str, Any]:
    ranks = getattr(exc, "ranks", None)
    return {"type": type(exc).__name__, "message": str(exc),
            "step": getattr(exc, "step", None), "rank": getattr(exc, "rank", None),
            "ranks": None if ranks is None else list(ranks),
            "traceback": "".join(traceback.format_exception(exc))}


def run_save(args: argparse.Namespace, root: Path, rank: int) -> dict[str, Any]:
    state = make_state()
    saves: list[dict[str, Any]] = []
    pipe = cp.CheckpointPipeline(root, storage=storage_for(args.scenario, "save", root, rank),
                                 keep_last=len(SAVE_STEPS),
                                 coordination_timeout_s=args.coordination_timeout)
    with pipe:
        for step in SAVE_STEPS:
            set_step(state, step, rank)
            started = time.monotonic()
            handle = pipe.save(step, state, train_state(step))
            outcome: dict[str, Any] = {"step": step}
            try:
                info = handle.result(args.coordination_timeout * 3)
            except Exception as exc:
                outcome.update(ok=False, error=_error(exc))
            else:
                outcome.update(ok=True, committed_step=info.step)
            outcome["seconds"] = time.monotonic() - started
            saves.append(outcome)
    return {"saves": saves}


def run_restore(args: argparse.Namespace, root: Path, rank: int) -> dict[str, Any]:
    state = make_state()
    out: dict[str, Any] = {"step": None, "error": None}
    pipe = cp.CheckpointPipeline(root, storage=storage_for(args.scenario, "restore", root, rank),
                                 coordination_timeout_s=args.coordination_timeout)
    with pipe:
        try:
            result = pipe.restore_latest(state)
        except cp.CheckpointError as exc:
            out["error"] = _error(exc)
            return out
    if result is None:
        return out
    ts = result.train_state
    out.update(
        step=result.step,
        valid_by_rank={str(r): list(steps) for r, steps in result.valid_by_rank.items()},
        rejected=[{"step": r.step, "path": r.path, "reason": r.reason}
                  for r in result.rejected],
        train_state={"step": ts.step, "consumed_train_samples": ts.consumed_train_samples,
                     "extra": dict(ts.extra)},
        mismatches=mismatches(state, result.step, rank),
    )
    return out


_RUN: dict[str, Callable[[argparse.Namespace, Path, int], dict[str, Any]]] = {
    "save": run_save, "restore": run_restore}


# ---------------------------------------------------------------- main

def _phases(text: str) -> list[str]:
    phases = text.split(",")
    for phase in phases:
        if phase not in PHASES:
            raise argparse.ArgumentTypeError(f"unknown phase {phase!r} (choose from {PHASES})")
    return phases


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--phase", type=_phases, required=True,
                        help="comma-separated phases, run in order")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--shared", action="store_true",
                        help="every rank uses ROOT itself (default: ROOT/rank-R)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--coordination-timeout", type=float, default=30.0)
    parser.add_argument("--max-seconds", type=float, default=100.0,
                        help="dump every thread's stack and exit 1 if still running by then")
    return parser.parse_args(argv)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(data, indent=1))
    os.replace(temp, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    # This process is the application: it may configure logging (the library never does).
    cp.enable_logging(logging.WARNING)
    faulthandler.dump_traceback_later(args.max_seconds, exit=True)
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    root = args.root if args.shared else args.root / f"rank-{rank}"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    result: dict[str, Any] = {"rank": rank, "world_size": world_size, "root": str(root),
                              "phases": {}}
    try:
        for phase in args.phase:
            result["phases"][phase] = _RUN[phase](args, root, rank)
            _write_json(args.out, result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown of torch: about a second of CPU per process, paid once per
    # rank and launch on a small machine. Every result is written and closed by now.
    os._exit(code)
