"""One rank of ``bench_scale.py``: open a pipeline, save a small state N times, restore, close.

Launched by ``bench_scale.py``, one process per rank, with the environment ``torchrun`` would
set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus ``SCALE_LAUNCHED_AT`` (the parent's
``time.monotonic()`` when it started the ranks)::

    python benchmarks/_scale_worker.py --root DIR/rank-R --out DIR/rank-R.json --saves 10 ...

What it measures, in this order (every phase starts after a barrier of the default gloo group,
so that the ranks start it together, as the collectives of a training step would align them):

- ``construct_s``: ``CheckpointPipeline(...)``: creating the control plane's gloo group (the
  hierarchical one's groups, and its check of the node layout, when ``LOCAL_WORLD_SIZE`` is
  set), a collective of every rank;
- ``open_s``: entering the pipeline: the start-up scan and scrub of the root and the start-up
  agreement (the run id, an all-gather of every rank);
- per save (``saves``, the first one is the warm-up: the host buffer is allocated then):
  ``blocking_s`` (``SaveRequested.blocking_seconds``), ``save_call_s`` (the wall time of
  ``save()`` on this thread), ``seal_s`` (``ShardSealed.seconds``), ``commit_stage_s`` (from
  the receipt of ``ShardSealed`` to the receipt of ``CheckpointCommitted`` in the subscriber,
  ``time.perf_counter``: the vote between every rank, the commit record and its fsync, and the
  wait for the slowest rank's shard), ``durable_s`` (``CommitInfo.seconds``: ``save()`` to the
  commit record durable), ``replicate_s`` (the longest ``ShardReplicated.seconds`` of the
  save, when ``replicas`` > 0), and the ``time.monotonic()`` stamps of the save's start and of
  the two events, which the parent compares across ranks (one host: one clock);
- ``restore_s``: ``restore_latest`` into a zeroed state (wall time), checked against the last
  save's values (``restore_ok``);
- ``close_s``: leaving the pipeline.

The result goes to ``--out`` as JSON (atomically), also when something fails (``error`` and
``traceback``), with the peak and current RSS and the PSS of this process. A rank that runs
past ``--max-seconds`` dumps its stacks into its log and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_STARTED = time.monotonic()

import torch  # noqa: E402  (the time above is taken before the imports on purpose)
import torch.distributed as dist  # noqa: E402

try:
    import ckpt_pipeline as cp
except ImportError:  # a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ckpt_pipeline as cp

KiB = 1024


def _proc_kb(path: str, key: str) -> int | None:
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def memory() -> dict[str, float | None]:
    """This process's resident memory in MiB: peak and current RSS, and PSS (shared pages
    split between the processes that map them, which is what N ranks add up to)."""
    def mib(kb: int | None) -> float | None:
        return None if kb is None else round(kb / 1024, 1)
    return {"rss_peak_mib": mib(_proc_kb("/proc/self/status", "VmHWM")),
            "rss_mib": mib(_proc_kb("/proc/self/status", "VmRSS")),
            "pss_mib": mib(_proc_kb("/proc/self/smaps_rollup", "Pss"))}


def make_state(tensors: int, state_kib: int) -> dict[str, Any]:
    """``tensors`` float32 tensors of equal size, ``state_kib`` KiB in all."""
    numel = max(1, state_kib * KiB // 4 // tensors)
    return {"model": {f"w{i}": torch.zeros(numel, dtype=torch.float32) for i in range(tensors)}}


def fill(state: dict[str, Any], value: float) -> None:
    for t in state["model"].values():
        t.fill_(value)


def check(state: dict[str, Any], value: float) -> bool:
    return all(bool((t == value).all()) for t in state["model"].values())


class Recorder:
    """The subscriber: receipt times of the events, by step (called from the pipeline thread)."""

    def __init__(self) -> None:
        self.perf: dict[tuple[str, int], float] = {}
        self.mono: dict[tuple[str, int], float] = {}
        self.events: dict[tuple[str, int], Any] = {}
        self.replicated: dict[int, list[dict[str, Any]]] = {}
        self.degraded: dict[int, list[Any]] = {}

    def __call__(self, event: cp.Event) -> None:
        perf, mono = time.perf_counter(), time.monotonic()
        name = type(event).__name__
        if isinstance(event, cp.ShardReplicated):
            self.replicated.setdefault(event.step, []).append(
                {"peer": event.peer, "node": event.node, "bytes": event.bytes,
                 "seconds": event.seconds})
            return
        if isinstance(event, cp.ReplicationDegraded):
            self.degraded.setdefault(event.step, []).append(
                {"missing": [list(m) for m in event.missing], "reasons": list(event.reasons)})
            return
        key = (name, event.step)
        self.perf.setdefault(key, perf)
        self.mono.setdefault(key, mono)
        self.events.setdefault(key, event)


def barrier() -> None:
    dist.barrier()


def run(args: argparse.Namespace, rank: int, world: int, result: dict[str, Any]) -> None:
    launched = float(os.environ.get("SCALE_LAUNCHED_AT", _STARTED))
    result["imported_after_launch_s"] = time.monotonic() - launched
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.coordination_timeout_s))
    result["init_process_group_s"] = time.perf_counter() - t0
    barrier()
    result["ready_after_launch_s"] = time.monotonic() - launched

    state = make_state(args.tensors, args.state_kib)
    result["state_bytes"] = sum(t.numel() * t.element_size() for t in state["model"].values())
    recorder = Recorder()
    options: dict[str, Any] = {
        "keep_last": args.keep_last, "io_threads": args.io_threads, "direct_io": args.direct_io,
        "coordination_timeout_s": args.coordination_timeout_s}
    sizes = [int(n) for n in args.node_sizes.split(",")] if args.node_sizes else None
    ids = ([i for i, n in enumerate(sizes) for _ in range(n)] if sizes
           else [r // args.ranks_per_node for r in range(world)])
    if len(ids) != world:
        raise ValueError(f"--node-sizes {args.node_sizes} make {len(ids)} ranks, not {world}")
    node = f"node{ids[rank]}"
    result["options"] = {**options, "node_name": node, "copies": args.replicas}
    options["replication"] = cp.ReplicationConfig(copies=args.replicas, node_name=node)

    with contextlib.ExitStack() as stack:
        barrier()
        t0 = time.perf_counter()
        if sizes:  # nodes of unequal sizes: the pipeline is given its per-node coordinator
            options["coordinator"] = cp.HierarchicalCoordinator(
                nodes=ids, timeout_s=args.coordination_timeout_s)
        pipe = cp.CheckpointPipeline(args.root, **options)
        t1 = time.perf_counter()
        pipe.subscribe(recorder)
        stack.enter_context(pipe)
        t2 = time.perf_counter()
        result["construct_s"], result["open_s"] = t1 - t0, t2 - t1
        # Which control plane the pipeline chose (LOCAL_WORLD_SIZE: the hierarchical one).
        result["coordinator"] = type(pipe._pipe.coordinator).__name__

        saves: list[dict[str, Any]] = []
        result["saves"] = saves
        for i in range(args.saves):
            step = (i + 1) * 10
            fill(state, float(step * 1000 + rank))
            barrier()
            start_mono = time.monotonic()
            t0 = time.perf_counter()
            handle = pipe.save(step, state, cp.TrainState(step=step))
            t1 = time.perf_counter()
            info = handle.result(timeout=args.save_timeout_s)
            t2 = time.perf_counter()
            requested = recorder.events.get(("SaveRequested", step))
            written = recorder.events.get(("ShardSealed", step))
            w_perf = recorder.perf.get(("ShardSealed", step))
            c_perf = recorder.perf.get(("CheckpointCommitted", step))
            copies = recorder.replicated.get(step, [])
            saves.append({
                "step": step,
                "blocking_s": None if requested is None else requested.blocking_seconds,
                "save_call_s": t1 - t0,
                "seal_s": None if written is None else written.seconds,
                "commit_stage_s": None if w_perf is None or c_perf is None else c_perf - w_perf,
                "durable_s": info.seconds,
                "result_returned_s": t2 - t0,
                "replicate_s": max((c["seconds"] for c in copies), default=None),
                "replicated": copies,
                "replica_holders": list(getattr(info, "replica_holders", ())),
                "missing_replicas": [list(m) for m in getattr(info, "missing_replicas", ())],
                "degraded_events": recorder.degraded.get(step, []),
                "shard_bytes": info.bytes,
                "start_mono": start_mono,
                "written_mono": recorder.mono.get(("ShardSealed", step)),
                "committed_mono": recorder.mono.get(("CheckpointCommitted", step)),
            })

        last = float(args.saves * 10 * 1000 + rank)
        fill(state, 0.0)
        barrier()
        t0 = time.perf_counter()
        restored = pipe.restore_latest(state)
        result["restore_s"] = time.perf_counter() - t0
        result["restored_step"] = None if restored is None else restored.step
        result["restore_reported_s"] = None if restored is None else restored.seconds
        result["restore_ok"] = restored is not None and restored.step == args.saves * 10 and (
            check(state, last))
        barrier()
        t0 = time.perf_counter()
    result["close_s"] = time.perf_counter() - t0
    if sizes:  # one the pipeline did not make is not closed by it
        options["coordinator"].close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--replicas", type=int, default=0)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--node-sizes", default="",
                        help="consecutive nodes of these sizes (e.g. 8,1), given to a "
                             "HierarchicalCoordinator; default: --ranks-per-node")
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--state-kib", type=int, default=1024)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--io-threads", type=int, default=2)
    parser.add_argument("--direct-io", action="store_true")
    parser.add_argument("--coordination-timeout-s", type=float, default=120.0)
    parser.add_argument("--save-timeout-s", type=float, default=300.0)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.max_seconds, exit=True)  # a hang shows where
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result: dict[str, Any] = {"rank": rank, "world_size": world, "pid": os.getpid(),
                              "library": os.path.dirname(cp.__file__),
                              "library_version": cp.__version__}
    code = 0
    try:
        run(args, rank, world, result)
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        code = 1
    result["memory"] = memory()
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.out)
    if code == 0:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    else:
        print(result["traceback"], file=sys.stderr, flush=True)
    faulthandler.cancel_dump_traceback_later()
    return code


if __name__ == "__main__":
    sys.exit(main())
