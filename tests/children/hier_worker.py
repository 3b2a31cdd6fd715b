"""One rank of the multi-process tests in ``tests/coordination/test_hierarchical.py``.

Usage (one process per rank, the environment set as ``torchrun`` would set it, with
``LOCAL_WORLD_SIZE`` making pretend nodes of consecutive ranks)::

    RANK=r WORLD_SIZE=n LOCAL_WORLD_SIZE=l MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python tests/children/hier_worker.py SCENARIO --phase PHASE[,PHASE...] --root ROOT \\
            --out OUT.json [--victim RANK] [--coordination-timeout S]

It joins a gloo process group, then runs each phase in order:

- ``layout``: makes a ``HierarchicalCoordinator`` (its layout from ``LOCAL_WORLD_SIZE``) and
  records its nodes, or its error;
- ``gather``: a ``HierarchicalCoordinator`` (its layout from ``LOCAL_WORLD_SIZE``) and a
  ``DistributedCoordinator`` made side by side exchange the same payloads (of different
  lengths, some empty); records whether each result equals the other's and the payloads every
  rank is known to have sent;
- ``save``: a ``CheckpointPipeline`` (its coordinator the pipeline's own choice) saves steps
  10 and 20, waiting for each handle's result; records which coordinator it made and how many
  process groups and Unix domain sockets this process holds before the pipeline, while it is
  open and after its close;
  after a failed save, it tries one more exchange on that coordinator and records its error;
- ``restore``: a fresh pipeline restores into a state of zeros.

``SCENARIO`` changes what rank ``--victim`` does in ``save`` at step 20:

- ``plain``: nothing;
- ``dies``: SIGKILLs itself at the first write of its step-20 shard, before the commit vote;
- ``ahead``: saves step 25 where the others save step 20.

and in ``layout``, ``unreachable``: the victim's connection to its node's leader is refused
(``socket.socket.connect`` raises ``ConnectionRefusedError`` in that process: what a rank of
another host or network namespace given as the same node meets, which one host cannot produce
on demand).

The root of rank r is ``ROOT/rank-r``. After each phase the results so far are written to
``OUT`` (atomically) as JSON; errors as type, message, step, rank and ``ranks``. Every value
saved is a function of (step, rank), so the test can check a restore exactly. The test imports
this module for ``SAVE_STEPS``, ``FAULTY_STEP``, ``AHEAD_STEP`` and ``payload``.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SAVE_STEPS = (10, 20)
FAULTY_STEP = 20
AHEAD_STEP = 25
NUMEL = 1024
SCENARIOS = ("plain", "dies", "ahead", "unreachable")
PHASES = ("layout", "gather", "save", "restore")


def payload(rank: int, exchange: int) -> bytes:
    """What ``rank`` sends in exchange ``exchange`` of the gather phase: lengths 0 to 40,
    empty for some ranks in each exchange, and empty on every rank in exchange 3."""
    if exchange == 3:
        return b""
    length = (rank * 7 + exchange * 5) % 41 if (rank + exchange) % 5 else 0
    return bytes((rank * 31 + exchange + i) % 256 for i in range(length))


# ---------------------------------------------------------------- the work of one rank

def _values(step: int, rank: int) -> Any:
    import torch

    return torch.arange(NUMEL, dtype=torch.float32).add_(step * 1000 + rank)


def _train_state(step: int) -> Any:
    import ckpt_pipeline as cp

    return cp.TrainState(step=step, consumed_train_samples=step * 8)


def _error(exc: BaseException) -> dict[str, Any]:
    ranks = getattr(exc, "ranks", None)
    return {"type": type(exc).__name__, "message": str(exc),
            "step": getattr(exc, "step", None), "rank": getattr(exc, "rank", None),
            "hint": getattr(exc, "hint", None),
            "ranks": None if ranks is None else list(ranks),
            "traceback": "".join(traceback.format_exception(exc))}


def _storage(scenario: str, root: Path, rank: int, victim: int) -> Any:
    """The storage of ``rank`` in the save phase: faulty for the victim, as the scenario says."""
    import ckpt_pipeline as cp

    step_dir = f"step-{FAULTY_STEP:010d}"

    class _StepShard(cp.LocalStorage):
        """Knows the descriptors of this rank's step-20 shard (its temporary included)."""

        def __init__(self) -> None:
            super().__init__(root)
            self.fds: set[int] = set()

        def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
            fd, name = super().create_temp(rel_dir, final_name)
            if rel_dir == step_dir and final_name.endswith(".shard"):
                self.fds.add(fd)
            return fd, name

        def close(self, fd: int) -> None:
            self.fds.discard(fd)
            super().close(fd)

    class Dies(_StepShard):
        def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
            if fd in self.fds:
                os.kill(os.getpid(), signal.SIGKILL)
            super().pwrite(fd, data, offset)

    if rank == victim and scenario == "dies":
        return Dies()
    return cp.LocalStorage(root)


def _groups() -> int:
    """The process groups this process holds (the default one included)."""
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def _local_sockets() -> int:
    """The Unix domain sockets this process holds open (Linux: ``/proc``)."""
    try:
        with open("/proc/self/net/unix") as f:
            inodes = {line.split()[6] for line in list(f)[1:] if len(line.split()) > 6}
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return -1
    held = 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            held += 1
    return held


def run_layout(args: argparse.Namespace, root: Path, rank: int) -> dict[str, Any]:
    import ckpt_pipeline as cp

    if args.scenario == "unreachable" and rank == args.victim:
        import socket

        def refused(self: socket.socket, address: Any) -> None:
            raise ConnectionRefusedError(111, "Connection refused (injected)")

        socket.socket.connect = refused  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        made = cp.HierarchicalCoordinator(timeout_s=args.coordination_timeout)
    except cp.CheckpointError as exc:
        return {"layout": None, "error": _error(exc), "seconds": time.monotonic() - started}
    made.close()
    return {"layout": [list(node) for node in made.layout.nodes], "error": None}


def run_gather(args: argparse.Namespace, root: Path, rank: int) -> dict[str, Any]:
    import anyio

    import ckpt_pipeline as cp

    world = int(os.environ["WORLD_SIZE"])
    hier = cp.HierarchicalCoordinator(timeout_s=args.coordination_timeout)
    flat = cp.DistributedCoordinator(timeout_s=args.coordination_timeout)
    exchanges = []

    async def exchange() -> None:
        for i in range(4):
            started = time.monotonic()
            got = await hier.all_gather(payload(rank, i), what="test")
            seconds = time.monotonic() - started
            want = await flat.all_gather(payload(rank, i), what="test")
            exchanges.append({"equal_flat": got == want,
                              "as_sent": got == [payload(r, i) for r in range(world)],
                              "lengths": [len(p) for p in got], "seconds": seconds})
        for i in range(3):  # with pieces for rank 0 alone (``all_gather_root``)
            got, pieces = await hier.all_gather_root(payload(rank, i), payload(rank, i + 4),
                                                     what="test")
            want, flat_pieces = await flat.all_gather_root(
                payload(rank, i), payload(rank, i + 4), what="test")
            rooted.append({"as_sent": list(got) == [payload(r, i) for r in range(world)],
                           "equal_flat": list(got) == want and pieces == flat_pieces,
                           "pieces": {str(r): p.hex() for r, p in sorted(pieces.items())}})

    rooted: list[dict[str, Any]] = []
    anyio.run(exchange)
    out = {"layout": [list(node) for node in hier.layout.nodes], "exchanges": exchanges,
           "rooted": rooted}
    hier.close()
    flat.close()
    return out


def run_save(args: argparse.Namespace, root: Path, rank: int) -> dict[str, Any]:
    import torch

    import ckpt_pipeline as cp

    before = _groups()
    sockets_before = _local_sockets()
    pipe = cp.CheckpointPipeline(root, storage=_storage(args.scenario, root, rank, args.victim),
                                 keep_last=len(SAVE_STEPS),
                                 coordination_timeout_s=args.coordination_timeout)
    saves: list[dict[str, Any]] = []
    with pipe:
        held = _groups()
        sockets_open = _local_sockets()
        state = {"w": torch.zeros(NUMEL)}
        for step in SAVE_STEPS:
            if args.scenario == "ahead" and rank == args.victim and step == FAULTY_STEP:
                step = AHEAD_STEP
            state["w"].copy_(_values(step, rank))
            started = time.monotonic()
            outcome: dict[str, Any] = {"step": step}
            try:
                info = pipe.save(step, state, _train_state(step)).result(
                    args.coordination_timeout * 6)
            except Exception as exc:
                outcome.update(ok=False, error=_error(exc))
            else:
                outcome.update(ok=True, committed_step=info.step)
            outcome["seconds"] = time.monotonic() - started
            saves.append(outcome)
        # The blocking face has no public coordinator: the one the pipeline chose is inside.
        coordinator = pipe._pipe.coordinator
        later = _later_exchange(coordinator) if not all(s["ok"] for s in saves) else None
    return {"coordinator": type(coordinator).__name__, "saves": saves, "later": later,
            "groups_before": before, "groups_open": held, "groups_after_close": _groups(),
            "sockets_before": sockets_before, "sockets_open": sockets_open,
            "sockets_after_close": _local_sockets()}


def _later_exchange(coordinator: Any) -> dict[str, Any]:
    """An exchange after a failed one: its error and how long it took to raise."""
    import anyio

    started = time.monotonic()
    try:
        anyio.run(lambda: coordinator.all_gather(b"x", what="later"))
    except Exception as exc:
        return {"error": _error(exc), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def run_restore(args: argparse.Namespace, root: Path, rank: int) -> dict[str, Any]:
    import torch

    import ckpt_pipeline as cp

    state = {"w": torch.zeros(NUMEL)}
    out: dict[str, Any] = {"step": None, "error": None, "exact": None}
    with cp.CheckpointPipeline(root, coordination_timeout_s=args.coordination_timeout) as pipe:
        out["coordinator"] = type(pipe._pipe.coordinator).__name__
        try:
            result = pipe.restore_latest(state)
        except cp.CheckpointError as exc:
            out["error"] = _error(exc)
            return out
    if result is not None:
        out.update(step=result.step, train_step=result.train_state.step,
                   exact=bool(torch.equal(state["w"], _values(result.step, rank))))
    return out


_RUN: dict[str, Callable[[argparse.Namespace, Path, int], dict[str, Any]]] = {
    "layout": run_layout, "gather": run_gather, "save": run_save, "restore": run_restore}


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
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--victim", type=int, default=-1)
    parser.add_argument("--coordination-timeout", type=float, default=30.0)
    parser.add_argument("--max-seconds", type=float, default=150.0,
                        help="dump every thread's stack and exit 1 if still running by then")
    return parser.parse_args(argv)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(data, indent=1))
    os.replace(temp, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    faulthandler.dump_traceback_later(args.max_seconds, exit=True)
    import torch
    import torch.distributed as dist

    import ckpt_pipeline as cp

    # This process is the application: it may configure logging (the library never does).
    cp.enable_logging(logging.WARNING)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    root = args.root / f"rank-{rank}"
    started = time.monotonic()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    result: dict[str, Any] = {"rank": rank, "phases": {},
                              "init_s": time.monotonic() - started}
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
