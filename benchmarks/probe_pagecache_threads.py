"""How a host's page-cache reads and memory copies scale with threads (a probe for issue 26's
reshard, which reads with ``io_threads`` threads a rank from files in the page cache).

A file of ``--mib`` MiB is written into ``--dir`` and read through once (so that it is in the
page cache), then for 1, 2, 4, 8 and 16 threads, each thread reads its slice with
``os.preadv`` in 4 MiB calls into (a) a host buffer already touched and (b) fresh memory, and
copies (c) touched memory into touched memory with ``torch``'s ``copy_``, (d) into fresh
memory, (e) into fresh memory each thread first maps in with ``MADV_POPULATE_WRITE``
(``_hostmem.populate``), the mapping timed with the copy, (f) into fresh memory mapped with
``MADV_HUGEPAGE`` (transparent huge pages where the kernel's setting is ``madvise``; the
AnonHugePages the process held after the copy are recorded). Every figure is the whole volume over the slowest thread's wall time, the best of
``--repeats``; JSON to ``--out``, a table to stdout.

    python benchmarks/probe_pagecache_threads.py --mib 1024 --dir /tmp --out probe.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckpt_pipeline._hostmem import populate

CALL = 4 << 20


def _timed(threads: int, work: object) -> float:
    barrier = threading.Barrier(threads + 1)
    done: list[float] = []

    def run(i: int) -> None:
        barrier.wait()
        work(i)  # type: ignore[operator]
        done.append(time.perf_counter())

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in pool:
        t.join()
    return max(done) - start


def _anon_huge_kib() -> float:
    """The process's AnonHugePages now (KiB; -1 where /proc does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return float(line.split()[1])
    except OSError:
        pass
    return -1.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    size = args.mib << 20
    path = args.dir / "probe-pagecache.bin"
    with open(path, "wb") as f:
        block = os.urandom(CALL)
        for _ in range(size // CALL):
            f.write(block)
    fd = os.open(path, os.O_RDONLY)
    try:
        scratch = bytearray(CALL)
        for at in range(0, size, CALL):
            os.preadv(fd, [scratch], at)
        touched = torch.ones(size, dtype=torch.uint8)
        source = torch.ones(size, dtype=torch.uint8)
        rows = []
        for threads in (1, 2, 4, 8, 16):
            share = size // threads
            figures: dict[str, float] = {}
            for name in ("pread_touched", "pread_fresh", "copy_touched", "copy_fresh",
                         "copy_populated", "copy_huge"):
                best = float("inf")
                for _ in range(args.repeats):
                    mapped = None
                    if name == "copy_huge":
                        mapped = mmap.mmap(-1, size)
                        mapped.madvise(getattr(mmap, "MADV_HUGEPAGE", 14))
                        into = torch.frombuffer(mapped, dtype=torch.uint8)
                    else:
                        into = touched if name.endswith("touched") else \
                            torch.empty(size, dtype=torch.uint8)

                    def work(i: int, into: torch.Tensor = into, name: str = name,
                             share: int = share) -> None:
                        lo = i * share
                        for at in range(lo, lo + share, CALL):
                            n = min(CALL, lo + share - at)
                            if name == "copy_populated" and at == lo:
                                populate(into.data_ptr() + lo, share, threads=1)
                            if name.startswith("pread"):
                                os.preadv(fd, [memoryview(into[at:at + n].numpy())], at)
                            else:
                                into[at:at + n].copy_(source[at:at + n])

                    best = min(best, _timed(threads, work))
                    if mapped is not None:
                        figures["anon_huge_kib"] = _anon_huge_kib()
                        del into, work
                        mapped.close()
                    else:
                        del into
                figures[name + "_gb_s"] = round(size / best / 1e9, 2)
            rows.append({"threads": threads, **figures})
            print(threads, figures, flush=True)
    finally:
        os.close(fd)
        path.unlink()
    out = {"benchmark": "probe_pagecache_threads", "machine": machine_info(args.dir), "mib": args.mib,
           "repeats": args.repeats, "rows": rows}
    args.out.write_text(json.dumps(out, indent=1))
    print("threads  pread->touched  pread->fresh  copy->touched  copy->fresh  populated+copy"
          "  huge+copy  (GB/s; huge pages KiB)")
    for r in rows:
        print(f"{r['threads']:7d}  {r['pread_touched_gb_s']:14.2f}  {r['pread_fresh_gb_s']:12.2f}"
              f"  {r['copy_touched_gb_s']:13.2f}  {r['copy_fresh_gb_s']:11.2f}"
              f"  {r['copy_populated_gb_s']:14.2f}  {r['copy_huge_gb_s']:9.2f}"
              f"  ({r.get('anon_huge_kib', -1):.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
