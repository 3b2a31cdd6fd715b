"""Resharded restore of CUDA DTensors on one GPU (issue 26): two gloo ranks sharing the GPU
save a state of ``--mib`` MiB, one rank restores it (2 -> 1); the baseline is the same state
saved by one rank and restored by one (1 -> 1), in the same run. Each restore is timed in the
restoring process between a barrier and ``torch.cuda.synchronize()``; the files are in the page
cache for both (written just before). Writes JSON to ``--out`` and prints a table.

    python benchmarks/gpu_reshard.py --mib 4096 --repeats 3 --out results/reshard_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE.parent / "tests" / "children" / "reshard_gpu_worker.py"


def run_ranks(world: int, *args: str, port: int) -> None:
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": os.pathsep.join(
                   p for p in (str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env))
    codes = [p.wait(timeout=500) for p in procs]
    if any(codes):
        raise SystemExit(f"ranks failed: {codes} ({args})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    port = 29650
    rows = []
    for saved in (1, 2):
        root = Path(args.dir) / f"reshard-gpu-{saved}"
        shutil.rmtree(root, ignore_errors=True)
        port += 1
        run_ranks(saved, "save", "--root", str(root), "--mib", str(args.mib), port=port)
        samples = []
        for i in range(args.repeats):
            out = root.parent / f"reshard-gpu-out-{saved}-{i}.json"
            port += 1
            run_ranks(1, "restore", "--root", str(root), "--mib", str(args.mib), "--out",
                      str(out), port=port)
            result = json.loads(out.read_text())
            assert all(result["right"].values()), result
            samples.append(result)
        seconds = [s["seconds"] for s in samples]
        rows.append({"saved": saved, "live": 1, "resharded_from": samples[0]["resharded_from"],
                     "state_bytes": samples[0]["state_bytes"], "bytes_read": samples[0]["bytes"],
                     "seconds": seconds, "median_s": statistics.median(seconds)})
        shutil.rmtree(root, ignore_errors=True)
    base = rows[0]["median_s"]
    report = {"benchmark": "gpu_reshard", "mib": args.mib, "repeats": args.repeats,
              "rows": rows, "reshard_over_same_size": rows[1]["median_s"] / base,
              "page_cache": "files written just before each restore: read from the page cache"}
    try:
        import torch

        report["device"] = torch.cuda.get_device_name(0)
        report["torch"] = torch.__version__
    except Exception:  # the report still says what was measured
        pass
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'case':<8} {'GB':>6} {'median s':>9} {'GB/s':>6}")
    for row in rows:
        gb = row["state_bytes"] / 1e9
        print(f"{row['saved']}->1{'':<5} {gb:6.2f} {row['median_s']:9.3f} "
              f"{gb / row['median_s']:6.2f}")
    print(f"reshard / same size: {report['reshard_over_same_size']:.3f}")


if __name__ == "__main__":
    main()
