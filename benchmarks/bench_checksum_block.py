"""The checksum block's cost at a full save and restore: 4 MiB blocks against one block per
64 MiB write chunk (what shards had before blocks were cut from the write chunk).

One process, CPU tensors of ``--gb`` in total, saved into ``--root`` and restored whole, at the
same world size; each block size in turns, ``--repeats`` times, after one untimed warm-up of
each. The 64 MiB case sets the writer's block to the write chunk for the run (the only
difference between the two). The files are in the page cache when restored (written just
before). Medians, and the ratios 4 MiB / 64 MiB, are printed and written as JSON.

    python benchmarks/bench_checksum_block.py --gb 1 --out benchmarks/results/checksum_block.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from _machine import machine_info  # noqa: E402

import ckpt_pipeline as cp  # noqa: E402
from ckpt_pipeline._save import write_data  # noqa: E402

MiB = 1024 * 1024


def once(root: Path, state: dict[str, torch.Tensor], block: int) -> tuple[float, float, int]:
    """(save seconds, restore seconds, the header's block) of one save and restore."""
    shutil.rmtree(root, ignore_errors=True)
    write_data.CHECKSUM_BLOCK_BYTES = block  # type: ignore[attr-defined]
    started = time.perf_counter()
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, state).result(600)
    saved = time.perf_counter() - started
    live = {k: torch.empty_like(v) for k, v in state.items()}
    started = time.perf_counter()
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(live)
    restored = time.perf_counter() - started
    assert result is not None and all(torch.equal(live[k], v) for k, v in state.items())
    from ckpt_pipeline._format.scan import scan

    (status,) = scan(cp.LocalStorage(root), 0)
    assert status.header is not None
    return saved, restored, status.header.chunk_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    count = 16
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(int(args.gb * 1e9 / 4 / count), generator=gen)
             for i in range(count)}
    base = Path(args.root or tempfile.mkdtemp(prefix="ckpt-block-", dir="/tmp"))
    cases = {"4MiB": 4 * MiB, "64MiB": 64 * MiB}
    samples: dict[str, list[tuple[float, float, int]]] = {k: [] for k in cases}
    base.mkdir(parents=True, exist_ok=True)
    machine = machine_info(base)
    try:
        for name, block in cases.items():  # warm-up
            once(base / name, state, block)
        for _ in range(args.repeats):
            for name, block in cases.items():
                samples[name].append(once(base / name, state, block))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows: dict[str, Any] = {}
    for name, got in samples.items():
        rows[name] = {"block_bytes": got[0][2], "save_s": [s for s, _, _ in got],
                      "restore_s": [r for _, r, _ in got],
                      "save_median_s": statistics.median(s for s, _, _ in got),
                      "restore_median_s": statistics.median(r for _, r, _ in got)}
    ratios = {what: rows["4MiB"][f"{what}_median_s"] / rows["64MiB"][f"{what}_median_s"]
              for what in ("save", "restore")}
    report = {"benchmark": "checksum_block", "gb": args.gb, "repeats": args.repeats,
              "cases": rows, "ratio_4MiB_over_64MiB": ratios, "machine": machine,
              "page_cache": "restores read files written just before (page cache)"}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'block':<7} {'header block':>13} {'save s':>8} {'restore s':>10}")
    for name, row in rows.items():
        print(f"{name:<7} {row['block_bytes']:>13} {row['save_median_s']:8.3f} "
              f"{row['restore_median_s']:10.3f}")
    print(f"4 MiB / 64 MiB: save {ratios['save']:.3f}, restore {ratios['restore']:.3f}")


if __name__ == "__main__":
    main()
