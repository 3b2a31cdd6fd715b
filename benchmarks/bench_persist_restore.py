"""Restore from the persistent tier: the streamed restore against downloading first.

One step of a state of ``--gb`` (on the GPU when there is one) is saved and promoted to a
directory tier (``--tier``, default a directory in ``/dev/shm``: a tier with a bandwidth of its
own), and every local root is then wiped before each timed restore:

- ``streamed``: ``restore_latest`` with the tier: the shard downloads into the local root while
  the load reads it (checksums and host-to-device copies overlapped with the download);
- ``download_then_load``: the same files downloaded first (``download_rank``, every part
  checked, published), then ``restore_latest`` from the local root alone: what the restore did
  before the download was streamed;
- ``local``: ``restore_latest`` with the files already in the local root (the floor).

Each is run ``--repeats`` times in turns, after an untimed warm-up of each; medians, and the
ratio streamed / download_then_load, are printed and written as JSON.

    python benchmarks/bench_persist_restore.py --gb 4 --out results/persist_restore.json
    python benchmarks/bench_persist_restore.py --gb 0.2 --repeats 1 --out /tmp/r.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from _machine import machine_info  # noqa: E402

import ckpt_pipeline as cp  # noqa: E402
from ckpt_pipeline._tiers.persistent.promote import complete_steps, download_rank  # noqa: E402
from ckpt_pipeline._tiers.persistent.urls import open_remote  # noqa: E402
from ckpt_pipeline.storage import LocalStorage  # noqa: E402


def make_state(gb: float, device: torch.device) -> dict[str, torch.Tensor]:
    count = 16
    each = max(1, int(gb * 1e9 / 4 / count))
    gen = torch.Generator(device=device).manual_seed(0)
    return {f"t{i}": torch.randn(each, device=device, generator=gen) for i in range(count)}


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tier", type=Path, default=None)
    parser.add_argument("--out", type=Path,
                        default=REPO / "benchmarks" / "results" / "persist_restore.json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(prefix="bench-persist-restore-", dir=REPO))
    shm = Path("/dev/shm")
    tier = args.tier or (shm / f"ckpt-bench-restore-{os.getpid()}" if shm.is_dir()
                         else work / "tier")
    local = work / "local"
    try:
        state = make_state(args.gb, device)
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        with cp.CheckpointPipeline(local, persistent=str(tier)) as pipe:
            pipe.save(1, state, cp.TrainState(step=1)).result(600)
        expected = {k: v.clone() for k, v in state.items()}
        del state

        def check(live: dict[str, torch.Tensor]) -> None:
            if not all(torch.equal(live[k], expected[k]) for k in expected):
                raise SystemExit("a restore gave other bytes")

        def timed_restore(persistent: str | None, downloaded: tuple[int, ...],
                          fetch: Callable[[], None] | None = None) -> float:
            """Seconds of ``fetch()`` (if any) and a restore_latest, checked bit-exact."""
            live = zeros_like(expected)
            started = time.perf_counter()
            if fetch is not None:
                fetch()
            options = {} if persistent is None else {"persistent": persistent}
            with cp.CheckpointPipeline(local, **options) as pipe:
                result = pipe.restore_latest(live)
            seconds = time.perf_counter() - started
            assert result is not None and result.downloaded == downloaded
            check(live)
            return seconds

        def download() -> None:
            remote = open_remote(str(tier))
            try:
                record = complete_steps(remote)[1]
                local.mkdir(parents=True, exist_ok=True)
                download_rank(remote, LocalStorage(local), record, 0)
            finally:
                remote.close()

        def streamed() -> float:
            shutil.rmtree(local, ignore_errors=True)
            return timed_restore(str(tier), (0,))

        def download_then_load() -> float:
            shutil.rmtree(local, ignore_errors=True)
            return timed_restore(None, (), download)

        def local_only() -> float:
            return timed_restore(None, ())

        methods = {"streamed": streamed, "download_then_load": download_then_load,
                   "local": local_only}
        times: dict[str, list[float]] = {name: [] for name in methods}
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for name, fn in methods.items():
                seconds = fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if round_:
                    times[name].append(seconds)
        medians = {k: statistics.median(v) for k, v in times.items()}
        result: dict[str, Any] = {
            "benchmark": "persist_restore", "machine": machine_info(work),
            "device": str(device), "bytes": nbytes, "tier": str(tier),
            "seconds": times, "median_s": medians,
            "median_gb_s": {k: nbytes / v / 1e9 for k, v in medians.items()},
            "ratio_streamed_vs_download_then_load":
                medians["streamed"] / medians["download_then_load"],
            "command": " ".join(sys.argv),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{nbytes / 1e9:.2f} GB on {device}, tier {tier}")
    print(f"{'method':<20} {'median s':>9} {'GB/s':>7}")
    for name, seconds in medians.items():
        print(f"{name:<20} {seconds:9.3f} {nbytes / seconds / 1e9:7.2f}")
    print(f"streamed / download_then_load: {result['ratio_streamed_vs_download_then_load']:.3f}")


if __name__ == "__main__":
    main()
