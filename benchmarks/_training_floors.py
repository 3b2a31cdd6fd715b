"""The floors of ``bench_training.py``: what the machine does with the same bytes, plainly.

- ``plain_copy``: device-to-host copy of the state's tensors into a preallocated pinned buffer.
- ``plain_write``: those bytes written from host memory with ``os.pwrite`` in 64 MiB pieces (one
  thread, or a pool of threads into disjoint ranges; buffered, and with ``O_DIRECT``), fsync,
  rename, fsync of the directory.
- ``plain_read``: a freshly written file read back with ``os.preadv`` from a pool of threads into
  the pinned buffer, then one host-to-device copy; the file's pages are dropped from the page
  cache first (``POSIX_FADV_DONTNEED`` after fsync), which a VM's host cache may still defeat.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from _baselines import (
    chunked,
    drop_page_cache,
    drop_page_cache_tree,
    plain_read_threads,
    plain_write_fsync,
    pwrite_threads_fsync,
)
from _training_workload import HostMirror, sync

__all__ = ("drop_page_cache", "drop_page_cache_tree", "plain_copy", "plain_read", "plain_write")

MiB = 1 << 20


def plain_copy(mirror: HostMirror, device: torch.device, repeats: int = 3) -> list[float]:
    """Seconds of each device-to-host copy of every tensor into the mirror (after one warm-up)."""
    mirror.copy_from_device()
    sync(device)
    samples = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        mirror.copy_from_device()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return samples


def plain_write(mirror: HostMirror, workdir: Path, *, thread_counts: tuple[int, ...],
                repeats: int, chunk_bytes: int = 64 * MiB, direct_threads: int = 0,
                keep: Path | None = None) -> dict[str, list[float]]:
    """Seconds of each durable write of the mirror's bytes, per method, interleaved.

    Methods: ``threads_N`` (buffered ``pwrite`` from N threads) for each thread count, and
    ``direct_N`` (``O_DIRECT`` from N threads) when ``direct_threads`` is set and the buffer is
    aligned (skipped where the file system refuses it). Every file is deleted (untimed, then
    ``os.sync()``) except the very last buffered one, moved to ``keep`` when given, for
    ``plain_read``.
    """
    pieces = chunked([mirror.byte_view()], chunk_bytes)
    methods: list[tuple[str, int, bool]] = [(f"threads_{n}", n, False) for n in thread_counts]
    aligned = mirror.buffer.data_ptr() % 4096 == 0 and mirror.nbytes % 4096 == 0 \
        and chunk_bytes % 4096 == 0
    if direct_threads and aligned and hasattr(os, "O_DIRECT"):
        methods.append((f"direct_{direct_threads}", direct_threads, True))
    samples: dict[str, list[float]] = {key: [] for key, _, _ in methods}
    pools = {n: ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"plain-write-{n}")
             for _, n, _ in methods if n > 1}
    try:
        runs = [(r, m) for r in range(repeats) for m in methods]
        last_buffered = max(i for i, (_, m) in enumerate(runs) if not m[2])
        for index, (_, (key, n, direct)) in enumerate(runs):
            final = workdir / f"plain-write-{key}-{index}.bin"
            t0 = time.perf_counter()
            try:
                if direct:
                    pwrite_threads_fsync(pieces, final, pools[n], direct=True)
                elif n == 1:
                    plain_write_fsync(pieces, final)
                else:
                    pwrite_threads_fsync(pieces, final, pools[n])
            except OSError:
                if not direct:
                    raise
                samples.pop(key, None)  # this file system refuses O_DIRECT
                final.with_suffix(".tmp").unlink(missing_ok=True)
                methods = [m for m in methods if m[0] != key]
                continue
            if key in samples:
                samples[key].append(time.perf_counter() - t0)
            if keep is not None and index == last_buffered:
                os.replace(final, keep)
            else:
                final.unlink(missing_ok=True)
            os.sync()
    finally:
        for pool in pools.values():
            pool.shutdown()
    return samples


def plain_read(mirror: HostMirror, path: Path, device: torch.device, *, threads: int,
               repeats: int, chunk_bytes: int = 64 * MiB) -> list[dict[str, Any]]:
    """Read ``path`` (the mirror's bytes) into the mirror, then copy it to the device.

    Each repeat drops the file from the page cache first. The device copy goes into one
    preallocated device buffer of the same size (not into the live tensors).
    """
    size = path.stat().st_size
    if size > mirror.nbytes:
        raise ValueError(f"{path} holds {size} bytes, more than the {mirror.nbytes} of the buffer")
    target = torch.empty(mirror.nbytes, dtype=torch.uint8, device=device) \
        if device.type == "cuda" else None
    out = []
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="plain-read") as pool:
        for _ in range(repeats):
            dropped = drop_page_cache(path)
            t0 = time.perf_counter()
            plain_read_threads(path, mirror.byte_view(0, size), pool, chunk_bytes)
            t1 = time.perf_counter()
            if target is not None:
                sync(device)
                t2 = time.perf_counter()
                target.copy_(mirror.buffer, non_blocking=mirror.pinned)
                sync(device)
                h2d = time.perf_counter() - t2
            else:
                h2d = 0.0
            out.append({"read_s": t1 - t0, "h2d_s": h2d, "total_s": t1 - t0 + h2d,
                        "bytes": size, "page_cache_dropped": dropped})
    del target
    with contextlib.suppress(Exception):
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out
