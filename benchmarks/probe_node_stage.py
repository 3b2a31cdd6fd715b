"""What the control plane's exchange costs as a node grows, with nothing else running: the
coordinator alone (no pipeline, no saves, no writing threads), so that on a host with a core
per process the figures are the protocol's own, not the wait for a core.

Each layout is a job of its own (processes forked here, a gloo process group on a free port),
which makes the coordinator and times ``--exchanges`` back-to-back ``all_gather`` calls of a
75-byte payload (a commit vote's size) after ``--warmup`` more; an exchange ends on every rank
before the next can, so the time per exchange is its latency. The figure of a layout is the
slowest rank's. Layouts (``--sizes`` N):

- ``one+N``: a node of N ranks and a node of one (``HierarchicalCoordinator(nodes=...)``):
  N + 1 processes, so the node stage grows with N while the leaders' stage keeps two members.
- ``2xN``: two nodes of N (2N processes), what ``bench_scale.py --ranks-per-node N`` runs.
- ``flat``: ``DistributedCoordinator`` on N + 1 ranks.

``--rounds`` rounds, each layout once a round in turn; the median of the rounds. JSON to
``--out``, a table to stdout::

    python benchmarks/probe_node_stage.py --sizes 2,4,8,15 --rounds 3 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PAYLOAD = bytes(75)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, layout: str, nodes: list[int], exchanges: int,
          warmup: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    import anyio
    import torch.distributed as dist

    from ckpt_pipeline.coordination._control_plane import DistributedCoordinator
    from ckpt_pipeline.coordination._hierarchy import HierarchicalCoordinator

    dist.init_process_group("gloo")
    coordinator: Any = (DistributedCoordinator(timeout_s=60) if layout == "flat"
                        else HierarchicalCoordinator(nodes=nodes, timeout_s=60))

    async def run() -> float:
        for _ in range(warmup):
            await coordinator.all_gather(PAYLOAD, what="probe")
        started = time.perf_counter()
        for _ in range(exchanges):
            await coordinator.all_gather(PAYLOAD, what="probe")
        return (time.perf_counter() - started) / exchanges

    try:
        out.put((rank, anyio.run(run)))
    finally:
        coordinator.close()
        dist.destroy_process_group()


def _job(layout: str, n: int, exchanges: int, warmup: int) -> dict[str, Any]:
    if layout == "flat":
        world, nodes = n + 1, [0] * (n + 1)
    elif layout == "one+N":
        world, nodes = n + 1, [0] * n + [1]
    else:  # 2xN
        world, nodes = 2 * n, [0] * n + [1] * n
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, layout, nodes, exchanges, warmup,
                                             queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank: dict[int, float] = {}
    try:
        for _ in range(world):
            rank, seconds = queue.get(timeout=300)
            per_rank[rank] = seconds
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return {"layout": layout, "n": n, "world": world, "nodes": nodes,
            "exchange_s_per_rank": [per_rank[r] for r in sorted(per_rank)],
            "exchange_s": max(per_rank.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4,8,15",
                        help="N: ranks in the node that grows (default %(default)s)")
    parser.add_argument("--layouts", default="one+N,2xN,flat")
    parser.add_argument("--exchanges", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-processes", type=int, default=os.cpu_count() or 1,
                        help="leave out layouts of more processes (default: the cores)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sizes = [int(v) for v in args.sizes.split(",")]
    layouts = args.layouts.split(",")
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for n in sizes:
            for layout in layouts:
                world = 2 * n if layout == "2xN" else n + 1
                if world > args.max_processes:
                    continue
                run = _job(layout, n, args.exchanges, args.warmup)
                run["round"] = round_
                runs.append(run)
                print(f"round {round_ + 1} {layout:6s} N={n:2d} ({world:2d} processes): "
                      f"{run['exchange_s'] * 1e3:.3f} ms an exchange", flush=True)
    from _machine import machine_info

    medians: dict[str, dict[str, Any]] = {}
    for run in runs:
        row = medians.setdefault(f"{run['layout']} {run['n']}", {
            "layout": run["layout"], "n": run["n"], "world": run["world"], "rounds_s": []})
        row["rounds_s"].append(run["exchange_s"])
    for row in medians.values():
        row["median_s"] = statistics.median(row["rounds_s"])
    result = {"benchmark": "probe_node_stage", "machine": machine_info(Path(".")),
              "payload_bytes": len(PAYLOAD), "exchanges": args.exchanges,
              "warmup": args.warmup, "rounds": args.rounds, "medians": medians, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1))
    print("layout  N  processes  exchange, median of rounds (ms)   slope from the row above "
          "(ms a rank)")
    for layout in layouts:
        previous: dict[str, Any] | None = None
        for n in sizes:
            row = medians.get(f"{layout} {n}")
            if row is None:
                continue
            slope = ""
            if previous is not None:
                added = (row["world"] - previous["world"]) if layout == "flat" else \
                    (row["n"] - previous["n"])
                slope = f"{(row['median_s'] - previous['median_s']) / added * 1e3:+.4f}"
            print(f"{layout:6s} {n:2d} {row['world']:10d}  {row['median_s'] * 1e3:10.3f}"
                  f"                      {slope}")
            previous = row
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
