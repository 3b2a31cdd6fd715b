"""First look at the CUDA save path: blocking time, snapshot speed and time to durable.

Against baselines of the same run on the same machine: a plain pinned device-to-host copy of the
same bytes into a preallocated buffer, and a plain write + fsync of the same bytes from host
memory (4 threads, 64 MiB pwrites). Not a training-loop measurement (issue 4 builds that); it
tells where the pipeline stands before the performance work.

    python benchmarks/gpu_first_look.py --size-gb 2 --saves 5 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

import ckpt_pipeline as cp


def _plain_write(path: Path, host: torch.Tensor, threads: int = 4, chunk: int = 64 << 20) -> float:
    from ckpt_pipeline._hostmem import byte_view

    n = host.numel()
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    ranges = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]

    def work(part: list[tuple[int, int]]) -> None:
        for s, e in part:
            os.pwrite(fd, byte_view(host, s, e), s)

    workers = [threading.Thread(target=work, args=(ranges[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - started
    os.unlink(path)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path.cwd())
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_first_look.json"))
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    count = 16
    numel = int(args.size_gb * 1e9 / 4 / count)
    state = {f"w{i}": torch.randn(numel, device="cuda") for i in range(count)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix=".gpu-first-look-"))

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    views = []
    off = 0
    for t in state.values():
        views.append(host[off:off + t.numel() * 4].view(torch.float32))
        off += t.numel() * 4
    copy_s = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for v, t in zip(views, state.values(), strict=True):
            v.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        copy_s.append(time.perf_counter() - t0)
    write_s = [_plain_write(work / "plain.bin", host) for _ in range(2)]
    del host, views

    events: list[cp.Event] = []
    blocking, snapshot, durable = [], [], []
    with cp.CheckpointPipeline(work / "ckpt", keep_last=1) as pipe:
        pipe.subscribe(events.append)
        t0 = time.perf_counter()
        pipe.save(1, state).result(600)
        first_save = time.perf_counter() - t0
        for step in range(2, args.saves + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = pipe.save(step, state)
            pipe.wait_snapshot()
            blocking.append(time.perf_counter() - t0)
            info = handle.result(600)
            durable.append(info.seconds)
        snapshot = [e.seconds for e in events if isinstance(e, cp.SnapshotTaken)][1:]
        pool = pipe.host_memory_bytes

    t0 = time.perf_counter()
    with cp.CheckpointPipeline(work / "ckpt") as pipe:
        live = {k: torch.empty_like(v) for k, v in state.items()}
        pipe.restore_latest(live)
    restore_s = time.perf_counter() - t0
    ok = all(torch.equal(live[k], state[k]) for k in state)

    med = statistics.median
    result: dict[str, Any] = {
        "machine": {"gpu": torch.cuda.get_device_name(0), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S %z")},
        "bytes": nbytes,
        "plain_pinned_copy_s": copy_s,
        "plain_write_fsync_s": write_s,
        "first_save_s": first_save,
        "blocking_s": blocking,
        "snapshot_stage_s": snapshot,
        "time_to_durable_s": durable,
        "restore_s": restore_s,
        "restore_bit_exact": ok,
        "pool_bytes": pool,
        "summary": {
            "plain_copy_GBps": nbytes / min(copy_s) / 1e9,
            "plain_write_GBps": nbytes / min(write_s) / 1e9,
            "blocking_ms_median": med(blocking) * 1e3,
            "durable_s_median": med(durable),
            "durable_vs_plain_write": med(durable) / min(write_s),
            "restore_GBps": nbytes / restore_s / 1e9,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for k, v in result["summary"].items():
        print(f"{k:28s} {v:10.3f}")
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
