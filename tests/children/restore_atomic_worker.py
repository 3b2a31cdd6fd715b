"""One rank of the multi-process tests in ``tests/restore/test_restore_atomic.py``.

Usage (one process per rank, the environment set as ``torchrun`` would set it)::

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python tests/children/restore_atomic_worker.py SCENARIO --root ROOT --out OUT.json

It joins a gloo process group; rank r uses ``ROOT/rank-r``. Scenarios:

- ``rank1-apply-fails-plain`` and ``rank1-apply-fails-fsdp``: each rank saves step 5 of a
  state (a plain tensor, a model — FSDP2-sharded on a CPU mesh for ``fsdp`` — its AdamW, a
  StepLR scheduler, and a ``Flaky`` object), then builds a different live state and restores
  into it. Rank 1's ``Flaky.load_state_dict`` raises half-way, after everything before it was
  loaded; rank 0's apply succeeds, and the vote on the apply must make it roll back. Each rank
  reports its error and whether its live state (and the RNG states) is bit-identical to what it
  was before, then restores again without the fault and reports whether it now holds exactly
  what it saved.
- ``dtensor-mismatch``: saves a DTensor ``a`` and a plain tensor ``b``, then restores into a
  plain ``a`` and into a DTensor ``b``: both are refused on every rank before anything changes.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import logging
import os
import random
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist
from torch import nn

import ckpt_pipeline as cp
from tests._support.children import exit_without_teardown

SCENARIOS = ("rank1-apply-fails-plain", "rank1-apply-fails-fsdp", "dtensor-mismatch")
FAILING_RANK = 1
STEP = 5


class Flaky:
    """A stateful object whose load_state_dict changes part of itself before it checks the
    version of what it loads, and raises if it is not its own (``fail=True``: version 2, where
    the checkpoint holds version 1). Its own state (the rollback's) always loads."""

    def __init__(self, value: float, *, fail: bool = False) -> None:
        self.buf = torch.full((16,), value)
        self.count = int(value)
        self.version = 2 if fail else 1

    def state_dict(self) -> dict[str, Any]:
        return {"buf": self.buf, "count": self.count, "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buf.copy_(state["buf"])
        self.count = state["count"]
        if state["version"] != self.version:
            raise RuntimeError(f"injected: version {state['version']}, this object takes version "
                               f"{self.version}")


# ---------------------------------------------------------------- bit-exact comparison

def _bytes(t: torch.Tensor) -> list[Any]:
    if type(t).__name__ == "DTensor":
        t = t.to_local()  # type: ignore[attr-defined]
    flat = t.detach().cpu().contiguous().reshape(-1)
    return [str(t.dtype), list(t.shape), flat.view(torch.uint8).numpy().tobytes().hex()]


def freeze(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return ["tensor", _bytes(obj)]
    if isinstance(obj, nn.Module):
        return ["module", [[k, _bytes(v)] for k, v in obj.named_parameters()],
                [[k, _bytes(v)] for k, v in obj.named_buffers()]]
    if callable(getattr(obj, "state_dict", None)) and not isinstance(obj, dict):
        return ["stateful", type(obj).__name__, freeze(obj.state_dict())]
    if isinstance(obj, dict):
        return ["dict", [[str(k), freeze(v)] for k, v in obj.items()]]
    if isinstance(obj, (list, tuple)):
        return [type(obj).__name__, [freeze(v) for v in obj]]
    if isinstance(obj, float):
        return ["float", obj.hex()]
    return obj


def rng_states() -> Any:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [torch.get_rng_state().numpy().tobytes().hex(), repr(random.getstate()),
            [name, keys.tobytes().hex(), pos, has_gauss, cached]]


def snapshot(state: dict[str, Any]) -> Any:
    return [freeze(state), rng_states()]


def _error(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc))}


# ---------------------------------------------------------------- rank1-apply-fails-*

def build(kind: str, seed: int, rank: int, *, fail: bool) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
    sched.step()
    return {"w": torch.full((32,), float(seed * 10 + rank)), "model": model, "optimizer": opt,
            "scheduler": sched, "custom": Flaky(float(seed * 10 + rank), fail=fail)}


def seed_rngs(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_apply_fails(args: argparse.Namespace, root: Path, rank: int) -> dict[str, Any]:
    kind = args.scenario.rsplit("-", 1)[1]
    state = build(kind, seed=1, rank=rank, fail=False)
    with cp.CheckpointPipeline(root, coordination_timeout_s=args.coordination_timeout) as pipe:
        pipe.save(STEP, state, cp.TrainState(step=STEP)).result(args.coordination_timeout * 2)
    saved = freeze(state)
    live = build(kind, seed=2, rank=rank, fail=rank == FAILING_RANK)
    out: dict[str, Any] = {"rank": rank, "failed_restore": None}
    with cp.CheckpointPipeline(root, coordination_timeout_s=args.coordination_timeout) as pipe:
        seed_rngs(100 + rank)
        before = snapshot(live)
        try:
            pipe.restore_latest(live)
        except cp.CheckpointError as exc:
            out["failed_restore"] = _error(exc)
        out["unchanged_after_failure"] = snapshot(live) == before
        live["custom"].version = 1
        result = pipe.restore_latest(live)
    out["restored_step"] = None if result is None else result.step
    out["equal_to_saved_after_retry"] = freeze(live) == saved
    return out


# ---------------------------------------------------------------- dtensor-mismatch

def run_dtensor_mismatch(args: argparse.Namespace, root: Path, rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded(value: float, numel: int) -> torch.Tensor:
        local = torch.full((numel,), value + rank)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    with cp.CheckpointPipeline(root, coordination_timeout_s=args.coordination_timeout) as pipe:
        pipe.save(STEP, {"a": sharded(1.0, 4), "b": torch.ones(4)}).result(
            args.coordination_timeout * 2)
    attempts = []
    lives = [{"a": torch.zeros(4 * dist.get_world_size()), "b": sharded(0.0, 2)},
             {"a": sharded(0.0, 4), "b": sharded(0.0, 2)}]
    with cp.CheckpointPipeline(root, coordination_timeout_s=args.coordination_timeout) as pipe:
        for live in lives:
            before = snapshot(live)
            attempt: dict[str, Any] = {"type": None}
            try:
                pipe.restore_latest(live)
            except cp.CheckpointError as exc:
                attempt = _error(exc)
            attempt["unchanged"] = snapshot(live) == before
            attempts.append(attempt)
    return {"rank": rank, "attempts": attempts}


# ---------------------------------------------------------------- main

def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--coordination-timeout", type=float, default=30.0)
    parser.add_argument("--max-seconds", type=float, default=100.0,
                        help="dump every thread's stack and exit 1 if still running by then")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    faulthandler.dump_traceback_later(args.max_seconds, exit=True)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    root = args.root / f"rank-{rank}"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        if args.scenario == "dtensor-mismatch":
            result = run_dtensor_mismatch(args, root, rank)
        else:
            result = run_apply_fails(args, root, rank)
        temp = args.out.with_name(args.out.name + ".tmp")
        temp.write_text(json.dumps(result, indent=1))
        os.replace(temp, args.out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
