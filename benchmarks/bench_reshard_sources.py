"""What a reshard with node-local roots moves from outside its root (issue 26): the bytes each
live rank reads from the persistent tier, or from other live ranks' copy servers, against the
whole shards an earlier version fetched or downloaded first, and against its own share.

The state: one float32 matrix of ``--mib`` MiB (1024 columns), a DTensor ``Shard(0)`` on a
1-D CPU mesh of every rank, with rows that divide by neither 2 nor 4. Each rank saves into a
root of its own (``ROOT/rank-R``: node-local disks). Cases:

- ``tier_4to2``: saved on 4 ranks with a persistent tier (a directory); the roots of saved
  ranks 2 and 3 lost; restored on 2 ranks, each reading what its root lacks from the tier.
- ``tier_2to4``: saved on 2 with the tier; restored on 4 (ranks 2 and 3 on new, empty roots;
  saved rank 1's root lost, so that the live roots do not hold the step between them).
- ``peers_2to4``: saved on 2, no tier; restored on 4: the live roots 0 and 1 hold the step
  between them, so each rank reads what it lacks from their copy servers.

Each rank is a process of its own (gloo), its figures from the library's log lines
(``ckpt.recovery.reshard_tier_read``, ``ckpt.recovery.reshard_peer_read``: bytes read and
the shard's size, per saved rank). The tier here is a directory on the same disk and the
copy servers are on this host, so the seconds are not a network's: the bytes are the figure.

    python benchmarks/bench_reshard_sources.py       # 256 MiB -> results/reshard_sources_cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUT = HERE / "results" / "reshard_sources_cpu.json"
COLS = 1024
CASES = ("tier_4to2", "tier_2to4", "peers_2to4")


def _rows(mib: float) -> int:
    rows = int(mib * (1 << 20)) // (4 * COLS)
    return rows - rows % 4 + 3  # uneven over 2 and over 4 ranks


def _worker(args: argparse.Namespace) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)."""
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckpt_pipeline as cp

    events: list[tuple[str, dict[str, Any]]] = []

    class Events(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            name = getattr(record, "ckpt_event", None)
            if name:
                events.append((name, dict(getattr(record, "ckpt_fields", {}))))

    logger = logging.getLogger("ckpt_pipeline")
    logger.addHandler(Events(logging.INFO))
    logger.setLevel(logging.INFO)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = _rows(args.mib)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(rows * COLS, dtype=torch.float32).reshape(rows, COLS)
    value = distribute_tensor(full if args.worker == "save" else torch.zeros(rows, COLS), mesh,
                              [Shard(0)])
    del full
    tier = {"persistent": cp.PersistentConfig(args.tier, every=1, takeover=True)} \
        if args.tier else {}
    root = os.path.join(args.root, f"rank-{rank}")
    out: dict[str, Any] = {"rank": rank, "world": world,
                           "share_bytes": value.to_local().numel() * 4}
    with cp.CheckpointPipeline(root, coordination_timeout_s=120, **tier) as pipe:
        if args.worker == "save":
            pipe.save(1, {"t": value}, cp.TrainState(step=1)).result(300)
        else:
            dist.barrier()
            started = time.perf_counter()
            result = pipe.restore_latest({"t": value})
            out["seconds"] = time.perf_counter() - started
            assert result is not None and result.resharded_from is not None, result
            out["resharded_from"] = result.resharded_from
            local = value.to_local()
            first_row = _chunk(rows, world, rank)[0]
            expected = torch.arange(first_row * COLS, (first_row + local.shape[0]) * COLS,
                                    dtype=torch.float32).reshape(local.shape)
            out["equal"] = bool(torch.equal(local, expected))
            for name, kind in (("ckpt.recovery.reshard_tier_read", "tier"),
                               ("ckpt.recovery.reshard_peer_read", "peers")):
                for event, fields in events:
                    if event == name:
                        out[kind] = {"bytes": fields["bytes"], "sizes": fields["sizes"]}
    with open(args.out, "w") as f:
        json.dump(out, f)
    os._exit(0)  # the gloo group and the pipeline's threads are done with: no teardown


def _chunk(rows: int, world: int, rank: int) -> tuple[int, int]:
    """DTensor's Shard(0) rows of ``rank``: chunks of ceil(rows / world)."""
    size = -(-rows // world)
    return min(rank * size, rows), min((rank + 1) * size, rows)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(world: int, mode: str, root: Path, tier: str, mib: float, work: Path,
         timeout_s: float) -> list[dict[str, Any]]:
    port = _free_port()
    procs, outs = [], []
    for rank in range(world):
        out = work / f"{mode}-{world}-{rank}.json"
        out.unlink(missing_ok=True)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        log = open(work / f"{mode}-{world}-{rank}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(
            [sys.executable, __file__, "--worker", mode, "--root", str(root), "--tier", tier,
             "--mib", str(mib), "--out", str(out)], env=env, stdout=log, stderr=log), log))
        outs.append(out)
    deadline = time.monotonic() + timeout_s
    for proc, log in procs:
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    failed = [i for i, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = (work / f"{mode}-{world}-{failed[0]}.log").read_text()[-3000:]
        raise RuntimeError(f"{mode} on {world} ranks: rank(s) {failed} failed:\n{tail}")
    return [json.loads(o.read_text()) for o in outs]


def run_case(case: str, mib: float, work: Path, timeout_s: float) -> dict[str, Any]:
    source, saved, live = case.split("_")[0], *map(int, case.split("_")[1].split("to"))
    root = work / case / "ckpt"
    tier = str(work / case / "tier") if source == "tier" else ""
    _job(saved, "save", root, tier, mib, work, timeout_s)
    lost = range(live, saved) if saved > live else [1] if source == "tier" else []
    for r in lost:
        shutil.rmtree(root / f"rank-{r}")
    ranks = _job(live, "restore", root, tier, mib, work, timeout_s)
    rows = []
    for r in ranks:
        moved = r.get(source, {"bytes": {}, "sizes": {}})
        rows.append({"rank": r["rank"], "equal": r["equal"], "seconds": r["seconds"],
                     "share_bytes": r["share_bytes"], "saved_ranks_read": sorted(moved["bytes"]),
                     "read_bytes": sum(moved["bytes"].values()),
                     "whole_bytes": sum(moved["sizes"].values()),
                     "by_saved_rank": moved})
    shutil.rmtree(work / case, ignore_errors=True)
    return {"case": case, "source": source, "saved": saved, "live": live,
            "lost_roots": list(lost), "ranks": rows,
            "read_bytes": sum(r["read_bytes"] for r in rows),
            "whole_bytes": sum(r["whole_bytes"] for r in rows),
            "all_equal": all(r["equal"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("save", "restore"))
    parser.add_argument("--root", default="")
    parser.add_argument("--tier", default="")
    parser.add_argument("--mib", type=float, default=256.0)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    sys.path.insert(0, str(HERE))
    from _machine import machine_info

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-reshard-sources-") as tmp:
        results = [run_case(case, args.mib, Path(tmp), args.timeout_s)
                   for case in args.cases.split(",")]
    report = {"benchmark": "reshard_sources", "machine": machine_info(HERE),
              "mib": args.mib, "rows": _rows(args.mib), "cols": COLS, "cases": results,
              "wall_s": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'case':<11} {'rank':>4} {'share MB':>9} {'read MB':>8} {'whole MB':>9} "
          f"{'read/whole':>10} {'s':>6}  saved ranks read")
    for c in results:
        for r in c["ranks"]:
            ratio = r["read_bytes"] / r["whole_bytes"] if r["whole_bytes"] else float("nan")
            print(f"{c['case']:<11} {r['rank']:>4} {r['share_bytes'] / 1e6:>9.1f} "
                  f"{r['read_bytes'] / 1e6:>8.1f} {r['whole_bytes'] / 1e6:>9.1f} "
                  f"{ratio:>10.2f} {r['seconds']:>6.2f}  {r['saved_ranks_read']}")
    print("every restored element equal: "
          + str(all(c["all_equal"] for c in results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
