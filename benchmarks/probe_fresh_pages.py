"""How fast this machine gives a process memory it has not touched: the cost that every fresh
allocation of a restore pays (``docs/benchmarks.md``, "Resharding").

Allocates ``--count`` blocks of ``--mib`` MiB one after the other, each kept alive, and times
writing each once (``torch.empty`` then ``fill_``: the page faults and the first write), then
writes the first block again (memory already touched). On a VM whose host backs guest memory
lazily and takes freed memory back (free page reporting), the first blocks come from memory
the guest freed recently and are fast, the later ones from memory the host must back first.

    python benchmarks/probe_fresh_pages.py --out benchmarks/results/fresh_pages.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    size = args.mib << 20
    kept: list[torch.Tensor] = []
    fresh = []
    for _ in range(args.count):
        started = time.perf_counter()
        block = torch.empty(size, dtype=torch.uint8)
        block.fill_(1)
        fresh.append(round(size / (time.perf_counter() - started) / (1 << 30), 2))
        kept.append(block)
    started = time.perf_counter()
    kept[0].fill_(2)
    touched = round(size / (time.perf_counter() - started) / (1 << 30), 2)
    report = {"benchmark": "probe_fresh_pages", "mib": args.mib, "count": args.count,
              "fresh_gib_s": fresh, "touched_gib_s": touched,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print("block  GiB/s (fresh)")
    for i, speed in enumerate(fresh):
        print(f"{i:5d}  {speed:6.2f}")
    print(f"touched again: {touched:.2f} GiB/s")


if __name__ == "__main__":
    main()
