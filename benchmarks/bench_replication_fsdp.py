"""What replication costs a training run: FSDP2 over the GPUs of one host, each rank a "node".

Run under torchrun, one process per GPU (2 on the H200 pair)::

    torchrun --nproc-per-node 2 benchmarks/bench_replication_fsdp.py --out results/x.json

The workload is ``bench_training.py``'s (a stack of 24 ``Linear(4096, 4096)`` in fp32, fused
AdamW, bf16 autocast, about 4.8 GB of parameters and Adam moments), sharded with
``fully_shard`` over all ranks, so each rank checkpoints its half. Three variants, timed over
the same number of steps, in an interleaved order (``none r0 r1 r1 r0 none`` per repeat) so
that drift of the shared machine hits each one alike:

- ``none``: no checkpointing;
- ``r0``: ``CheckpointPipeline(replication=ReplicationConfig(copies=0))``, a save every ``--every`` steps;
- ``r1``: the same with ``copies=1``: each rank's shard is also copied to the other rank,
  which ``node_name=f"node{rank}"`` makes another node (on one host, the copy goes over the
  loopback and lands on the same disk: the disk does twice the work).

Each pipeline is opened, and its first save made (the pinned host buffer allocated), before its
timed loop. The training time of a run is its loop of steps (saves in the background, as in
``bench_training.py``); the ``wait()`` for the last save after the loop (durable, with its
copies) is reported beside it. A rank's time is the slowest rank's (all-reduced). Reported:
seconds per variant, the ratios ``r1 / r0`` and ``r0 / none`` of the training time, and per save
the blocking time, the time to durable and, for ``r1``, each copy's seconds and bytes. Writes
JSON (rank 0) and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from _machine import machine_info  # noqa: E402
from _training_workload import build_workload  # noqa: E402

import ckpt_pipeline as cp  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--steps", type=int, default=300, help="timed steps per variant run")
    p.add_argument("--every", type=int, default=100, help="save after every N-th step")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the order none r0 r1 r1 r0 none")
    p.add_argument("--dir", type=Path, default=None, help="where the roots go (default: tmp)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--small", action="store_true", help="a tiny workload, for a smoke run")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.small:
        args.layers, args.hidden, args.batch = 4, 256, 64
        args.steps, args.every, args.warmup_steps = 20, 10, 2
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device,
                                timeout=datetime.timedelta(seconds=600))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    work = build_workload(layers=args.layers, hidden=args.hidden, batch=args.batch,
                          device=device, autocast=cuda, fused=cuda, seed=0)
    mesh = init_device_mesh(device.type, (world,))
    for layer in work.model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(work.model, mesh=mesh)
    work.optim = torch.optim.AdamW(work.model.parameters(), lr=1e-4, fused=cuda)
    for _ in range(args.warmup_steps):
        work.step()
    sync(device)
    base = Path(tempfile.mkdtemp(prefix="bench-repl-", dir=args.dir))
    order = ["none", "r0", "r1", "r1", "r0", "none"] * args.repeats
    runs: list[dict[str, Any]] = []
    for index, variant in enumerate(order):
        runs.append(run_variant(args, variant, index, work, device, base, rank))
        if rank == 0:
            print(f"{variant}: {runs[-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
    if rank == 0:
        report(args, runs, world, device, base)
    shutil.rmtree(base / f"rank-{rank}", ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_variant(args: argparse.Namespace, variant: str, index: int, work: Any,
                device: torch.device, base: Path, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"variant": variant, "index": index}
    if variant == "none":
        dist.barrier()
        sync(device)
        started = time.perf_counter()
        for _ in range(args.steps):
            work.step()
        sync(device)
        out["seconds"] = slowest(time.perf_counter() - started, device)
        return out
    replicas = 1 if variant == "r1" else 0
    root = base / f"rank-{rank}" / f"run-{index}"
    events: list[Any] = []
    replication = cp.ReplicationConfig(copies=replicas, node_name=f"node{rank}")
    with cp.CheckpointPipeline(root, replication=replication, keep_last=2) as pipe:
        pipe.subscribe(events.append)
        step = 0
        pipe.save(step, work.state()).result(600)  # the pool allocated, connections warm
        events.clear()
        dist.barrier()
        sync(device)
        started = time.perf_counter()
        infos = []
        for i in range(args.steps):
            work.step(before_update=pipe.wait_snapshot)
            if (i + 1) % args.every == 0:
                step += 1
                infos.append(pipe.save(step, work.state()))
        loop = time.perf_counter() - started
        pipe.wait()
        sync(device)
        total = time.perf_counter() - started
    out["seconds"] = slowest(loop, device)
    out["with_final_wait_seconds"] = slowest(total, device)
    commits = [h.result(0) for h in infos]
    out["saves"] = [{"step": c.step, "seconds_to_durable": c.seconds, "bytes": c.bytes,
                     "replica_holders": list(c.replica_holders),
                     "missing": [list(m) for m in c.missing_replicas]} for c in commits]
    out["blocking"] = [e.blocking_seconds for e in events
                       if isinstance(e, cp.SaveRequested)]
    out["copies"] = [{"step": e.step, "peer": e.peer, "bytes": e.bytes, "seconds": e.seconds}
                     for e in events if isinstance(e, cp.ShardReplicated)]
    shutil.rmtree(root, ignore_errors=True)
    return out


def report(args: argparse.Namespace, runs: list[dict[str, Any]], world: int,
           device: torch.device, base: Path) -> None:
    by: dict[str, list[float]] = {}
    for run in runs:
        by.setdefault(run["variant"], []).append(run["seconds"])
    median = {v: statistics.median(s) for v, s in by.items()}
    result = {
        "benchmark": "bench_replication_fsdp", "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine_info(base), "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "runs": runs, "median_seconds": median,
        "ratio_r1_over_r0": median["r1"] / median["r0"],
        "ratio_r0_over_none": median["r0"] / median["none"],
        "ratio_r1_over_none": median["r1"] / median["none"],
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\n{'variant':8} {'runs (s)':>28} {'median':>8} {'x none':>7}")
    for variant in ("none", "r0", "r1"):
        runs_s = " ".join(f"{s:.2f}" for s in by[variant])
        print(f"{variant:8} {runs_s:>28} {median[variant]:8.2f} "
              f"{median[variant] / median['none']:7.3f}")
    print(f"replicas=1 over replicas=0: {result['ratio_r1_over_r0']:.4f}")
    for variant in ("r0", "r1"):
        done = [r for r in runs if r["variant"] == variant]
        durable = [s["seconds_to_durable"] for r in done for s in r["saves"]]
        blocking = [b for r in done for b in r["blocking"]]
        drain = [r["with_final_wait_seconds"] - r["seconds"] for r in done]
        missing = sum(len(s["missing"]) for r in done for s in r["saves"])
        print(f"{variant}: durable median {statistics.median(durable):.2f} s, blocking median "
              f"{1000 * statistics.median(blocking):.1f} ms, final wait median "
              f"{statistics.median(drain):.2f} s, missing copies {missing}")
    r1 = [r for r in runs if r["variant"] == "r1"]
    copies = [c for r in r1 for c in r["copies"]]
    if copies:
        gbps = [c["bytes"] / c["seconds"] / 1e9 for c in copies]
        print(f"copies: {len(copies)}, {copies[0]['bytes'] / 1e9:.2f} GB each, "
              f"{statistics.median(gbps):.2f} GB/s median (rank 0's)")


if __name__ == "__main__":
    main()
