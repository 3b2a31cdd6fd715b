"""Write backends for bulk checkpoint data, on the disk at hand: which is fastest?

Writes the same host buffer (a page-aligned tensor) to a new file with fsync, 64 MiB pieces, by:
``pwrite_1`` (one thread), ``pwrite_8`` (eight threads, disjoint ranges), ``odirect_8`` (eight
threads, ``O_DIRECT``: no page cache, aligned buffers and sizes), and ``aiofiles`` (sequential
``await f.write``, fsync in a thread). Methods run round-robin, ``--repeats`` rounds, in one run.

    python benchmarks/bench_io_backends.py --size-gb 4 --repeats 2 --out results.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ckpt_pipeline._hostmem import byte_view

PIECE = 64 << 20


def _threads(fd: int, host: torch.Tensor, threads: int) -> None:
    n = host.numel()
    ranges = [(s, min(s + PIECE, n)) for s in range(0, n, PIECE)]

    def work(part: list[tuple[int, int]]) -> None:
        for s, e in part:
            view = byte_view(host, s, e)
            done = 0
            while done < e - s:
                done += os.pwrite(fd, view[done:], s + done)

    workers = [threading.Thread(target=work, args=(ranges[i::threads],))
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def pwrite(threads: int) -> Callable[[Path, torch.Tensor], None]:
    def run(path: Path, host: torch.Tensor) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _threads(fd, host, threads)
            os.fsync(fd)
        finally:
            os.close(fd)
    return run


def odirect(path: Path, host: torch.Tensor) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    try:
        _threads(fd, host, 8)
        os.fsync(fd)
    finally:
        os.close(fd)


def aiofiles_write(path: Path, host: torch.Tensor) -> None:
    import aiofiles

    async def main() -> None:
        async with aiofiles.open(path, "xb") as f:
            for s in range(0, host.numel(), PIECE):
                await f.write(byte_view(host, s, min(s + PIECE, host.numel())))
            await f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path.cwd())
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/io_backends.json"))
    args = parser.parse_args()
    size = int(args.size_gb * 1e9) // 4096 * 4096
    raw = torch.empty(size + 4096, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % 4096  # O_DIRECT needs a page-aligned buffer
    host = raw[skip:skip + size]
    host.random_(0, 256)
    methods: dict[str, Callable[[Path, torch.Tensor], None]] = {
        "pwrite_1": pwrite(1), "pwrite_8": pwrite(8), "odirect_8": odirect,
        "aiofiles": aiofiles_write,
    }
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix=".io-backends-"))
    samples: dict[str, list[float]] = {m: [] for m in methods}
    errors: dict[str, str] = {}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            if name in errors:
                continue
            path = work / f"{name}.bin"
            os.sync()
            started = time.perf_counter()
            try:
                fn(path, host)
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            finally:
                if path.exists():
                    path.unlink()
            samples[name].append(time.perf_counter() - started)
    work.rmdir()
    summary = {name: {"best_s": min(s), "median_s": statistics.median(s),
                      "gbps_best": size / min(s) / 1e9}
               for name, s in samples.items() if s}
    base = summary["pwrite_8"]["best_s"] if "pwrite_8" in summary else None
    for item in summary.values():
        item["x_pwrite_8"] = item["best_s"] / base if base else None
    result = {"bytes": size, "repeats": args.repeats, "samples": samples, "errors": errors,
              "summary": summary,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M %z")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'backend':10s} {'best s':>8s} {'GB/s':>6s} {'x pwrite_8':>10s}")
    for name, item in summary.items():
        ratio = item["x_pwrite_8"]
        print(f"{name:10s} {item['best_s']:8.3f} {item['gbps_best']:6.2f} "
              f"{ratio if ratio is None else round(ratio, 3)!s:>10s}")
    for name, err in errors.items():
        print(f"{name}: {err}")


if __name__ == "__main__":
    main()
