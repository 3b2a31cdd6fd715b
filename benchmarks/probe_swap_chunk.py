"""How fast an exchange of bits between two tensors in host memory runs, by the size of the
scratch buffer it goes through (``_restore.backups.SwappedBackup``: scratch <- live, live <-
restored, restored <- scratch, a chunk at a time).

Two touched tensors of ``--mib`` MiB, exchanged through scratch buffers of 256 KiB to 4 MiB,
``--repeats`` rounds of every size in turn; the median milliseconds per size. With
``--threads N`` (default 1) the exchange is split into N contiguous parts, each exchanged by a
thread of its own with its own scratch buffer (what the apply, which exchanges on the caller's
thread alone, could do). JSON to ``--out``, a table to stdout. One process: a restore of
several ranks on one host runs as many exchanges at once.

    python benchmarks/probe_swap_chunk.py --out benchmarks/results/probe_swap_chunk_cpu_2core.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info

SIZES_KIB = (4096, 2048, 1024, 512, 256)


def exchange(a: torch.Tensor, b: torch.Tensor, step: int) -> None:
    scratch = torch.empty(step, dtype=torch.uint8)
    with torch.no_grad():
        for start in range(0, a.numel(), step):
            stop = min(start + step, a.numel())
            here = scratch[:stop - start]
            here.copy_(a[start:stop])
            a[start:stop].copy_(b[start:stop])
            b[start:stop].copy_(here)


def split_exchange(a: torch.Tensor, b: torch.Tensor, step: int, threads: int) -> None:
    if threads == 1:
        exchange(a, b, step)
        return
    n = a.numel()
    bounds = [n * i // threads // step * step for i in range(threads)] + [n]
    workers = [threading.Thread(target=exchange, args=(a[lo:hi], b[lo:hi], step))
               for lo, hi in itertools.pairwise(bounds) if hi > lo]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    n = args.mib << 20
    a, b = torch.ones(n, dtype=torch.uint8), torch.full((n,), 2, dtype=torch.uint8)
    times: dict[int, list[float]] = {kib: [] for kib in SIZES_KIB}
    for _ in range(args.repeats):
        for kib in SIZES_KIB:
            started = time.perf_counter()
            split_exchange(a, b, kib << 10, args.threads)
            times[kib].append((time.perf_counter() - started) * 1e3)
    assert bool((a == (1 if args.repeats * len(SIZES_KIB) % 2 == 0 else 2)).all())
    medians = {kib: round(statistics.median(v), 1) for kib, v in times.items()}
    if args.out is not None:
        args.out.write_text(json.dumps({
            "benchmark": "probe_swap_chunk", "machine": machine_info(Path("/tmp")),
            "mib": args.mib, "repeats": args.repeats, "threads": args.threads,
            "ms": {str(k): [round(x, 1) for x in v] for k, v in times.items()},
            "median_ms": {str(k): v for k, v in medians.items()}}, indent=1) + "\n")
    print(f"exchange of {args.mib} MiB, {args.threads} thread(s), median of {args.repeats}")
    for kib, ms in medians.items():
        print(f"{kib:5d} KiB scratch {ms:8.1f} ms")


if __name__ == "__main__":
    main()
