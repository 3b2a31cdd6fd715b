"""Many saves in one process: nothing grows (open files, threads, host memory, disk)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_500_saves_with_keep_last_2_grow_nothing(root: Path) -> None:
    state = {"w": torch.randn(256, 1024), "step": torch.zeros(1, dtype=torch.int64)}
    before = threading.active_count()
    with cp.CheckpointPipeline(root, keep_last=2) as pipe:
        # Worker threads are pooled (anyio starts one when every idle one is busy, and retires
        # it after 10 s idle), so their number moves with timing; what must not happen is
        # growth with the number of saves: at most the pipeline's thread, the I/O limiter's
        # threads and a few waiters, whatever the count of saves.
        bound = before + 1 + pipe.config.io_threads + 4
        for step in range(1, 51):  # warm up: pool, worker threads, allocator
            state["step"].fill_(step)
            pipe.save(step, state)
        pipe.wait(60)
        files = _open_files()
        rss, disk, pool = _rss_bytes(), _disk_bytes(root), pipe.host_memory_bytes
        most_threads = threading.active_count()
        for step in range(51, 501):
            state["step"].fill_(step)
            pipe.save(step, state)
            if step % 25 == 0:
                most_threads = max(most_threads, threading.active_count())
        pipe.wait(120)
        assert _open_files() <= files
        assert max(most_threads, threading.active_count()) <= bound
        assert pipe.host_memory_bytes == pool
        assert _rss_bytes() - rss < 64 * 1024 * 1024
        assert _disk_bytes(root) <= disk + 64 * 1024
        assert sorted(n for n in os.listdir(root) if not n.startswith(".lock-")) == ["step-0000000499", "step-0000000500"]
