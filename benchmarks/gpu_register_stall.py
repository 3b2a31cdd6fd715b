"""What making a host buffer in a background thread costs a training loop running meanwhile.

A loop of bf16 matmuls (about 30 ms a step, each step ending on its stream) runs on the GPU
while another thread makes one buffer of ``--gib`` GiB in one of these ways:

- ``fallocate``: a /dev/shm file sized with posix_fallocate and mapped (no CUDA);
- ``register``: ``cudaHostRegister`` of such a file, already sized, in one call;
- ``register_chunks``: the same in pieces of ``--chunk-mib`` MiB, one call each;
- ``populate``: ``madvise(MADV_POPULATE_WRITE)`` of such a file's mapping (the library's
  ``populate``, 4 threads), then ``register_prefaulted``: ``cudaHostRegister`` of it, to see whether
  registration costs less when it need not fault the pages in;
- ``shm_buffer``: the memory tier's own ``ShmBuffer`` (fallocate, map, populate, register);
- ``pinned_mapping``: the host pool's own ``PinnedMapping`` (an anonymous mapping, populated,
  registered), what the pool is made of since it no longer uses torch's pinned allocator;
- ``pinned``: ``torch.empty(..., pin_memory=True)`` (cudaHostAlloc, the tier-off pool);
  ``--only pinned`` under ``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,...``
  measures PyTorch's other way of making pinned memory (malloc, fault in, register).

For each: the making's seconds, and the loop's steps while it ran against the median step
of a baseline run in the same process (``slowdown``: the time those steps took over the
time they would have taken at the baseline's pace). Then a check that one device-to-host
copy into a range spanning two separately registered pieces lands bit-exact, and how fast
it runs beside a copy inside one piece (an error, if CUDA refuses it, is recorded).

    python3 benchmarks/gpu_register_stall.py --out /tmp/stall.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from ckpt_pipeline._hostmem import PinnedMapping
from ckpt_pipeline._hostmem import populate as populate_pages
from ckpt_pipeline._tiers.memory.shm import ShmBuffer


def _loop_while(action: Callable[[], None] | None, steps_min: int, a: torch.Tensor
                ) -> tuple[list[tuple[float, float]], float, float]:
    """Run steps until ``action`` (in a thread) is done and ``steps_min`` steps ran; the
    (start, seconds) of each step, and the action's start and end."""
    times: list[tuple[float, float]] = []
    span = [0.0, 0.0]
    done = threading.Event()

    def run() -> None:
        span[0] = time.perf_counter()
        try:
            if action is not None:
                action()
        finally:
            span[1] = time.perf_counter()
            done.set()

    stream = torch.cuda.current_stream()
    thread = threading.Thread(target=run)
    thread.start()
    while len(times) < steps_min or not done.is_set():
        t0 = time.perf_counter()
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        stream.synchronize()
        times.append((t0, time.perf_counter() - t0))
    thread.join()
    return times, span[0], span[1]


def _shm(size: int) -> tuple[int, mmap.mmap, str]:
    path = f"/dev/shm/ckpt-stall-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, size)
    return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), path


def _ptr(m: mmap.mmap) -> int:
    return torch.frombuffer(m, dtype=torch.uint8).data_ptr()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.5)
    p.add_argument("--chunk-mib", type=int, default=256)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="comma-separated makings to run (default: all)")
    args = p.parse_args()
    size = int(args.gib * (1 << 30)) // (1 << 21) * (1 << 21)
    chunk = args.chunk_mib << 20
    cudart = torch.cuda.cudart()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    _loop_while(None, 20, a)  # warm-up
    base, _, _ = _loop_while(None, 60, a)
    step = statistics.median(s for _, s in base)
    results: dict[str, Any] = {"bytes": size, "chunk_bytes": chunk, "baseline_step_s": step,
                               "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    keep: list[Any] = []

    def fallocate() -> None:
        keep.append(_shm(size))

    registered: list[tuple[int, int]] = []
    chunked: list[int] = []

    def register() -> None:
        m = keep[-1][1]
        registered.append((_ptr(m), size))
        assert int(cudart.cudaHostRegister(_ptr(m), size, 0)) == 0

    def register_chunks() -> None:
        m = keep[-1][1]
        base_ptr = _ptr(m)
        chunked.append(base_ptr)
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            assert int(cudart.cudaHostRegister(base_ptr + off, n, 0)) == 0
            registered.append((base_ptr + off, n))

    def register_prefaulted() -> None:
        m = keep[-1][1]
        registered.append((_ptr(m), size))
        assert int(cudart.cudaHostRegister(_ptr(m), size, 0)) == 0

    def populate() -> None:
        m = keep[-1][1]
        populate_pages(_ptr(m), size)

    def shm_buffer() -> None:
        path = f"/dev/shm/ckpt-stall-{uuid.uuid4().hex[:8]}"
        keep.append((ShmBuffer(path, size, register=True), path))

    def pinned_mapping() -> None:
        keep.append(PinnedMapping(size))

    def pinned() -> None:
        keep.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))

    plan: list[tuple[str, Callable[[], None], Callable[[], None] | None]] = [
        ("fallocate", fallocate, None),
        ("register", register, None),
        ("fallocate_2", fallocate, None),
        ("register_chunks", register_chunks, None),
        ("fallocate_3", fallocate, None),
        ("populate", populate, None),
        ("register_prefaulted", register_prefaulted, None),
        ("shm_buffer", shm_buffer, None),
        ("pinned_mapping", pinned_mapping, None),
        ("pinned", pinned, None),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        plan = [entry for entry in plan if entry[0] in wanted]
    results["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    for name, action, _ in plan:
        times, t0, t1 = _loop_while(action, 20, a)
        during = [s for start, s in times if t0 <= start + s and start <= t1]
        results[name] = {
            "seconds": round(t1 - t0, 4),
            "steps_during": len(during),
            "slowdown": round(sum(during) / (step * len(during)), 4) if during else None,
            "max_step_s": round(max(during), 4) if during else None,
        }
        print(name, results[name], flush=True)
    checks = _copy_across_pieces(keep, chunked, chunk) if chunked else {}
    results["copy_across_pieces"] = checks
    for ptr, _ in registered:
        cudart.cudaHostUnregister(ptr)
    for item in keep:
        if isinstance(item, tuple) and isinstance(item[0], ShmBuffer):
            item[0].close()
            os.unlink(item[1])
        elif isinstance(item, PinnedMapping):
            item.close()
        elif isinstance(item, tuple):
            os.close(item[0])
            os.unlink(item[2])
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("| making | seconds | slowdown of the loop meanwhile | longest step s |")
    print("|---|---:|---:|---:|")
    for name, _, _ in plan:
        r = results[name]
        print(f"| {name} | {r['seconds']} | {r['slowdown']} | {r['max_step_s']} |")
    print(f"baseline step {step:.4f} s; alloc conf {results['alloc_conf']!r}; "
          f"copy across pieces {checks}")


def _copy_across_pieces(keep: list[Any], chunked: list[int], chunk: int) -> dict[str, Any]:
    """One copy inside a piece and one spanning two pieces of the register_chunks file."""
    m = next(k[1] for k in keep if isinstance(k, tuple) and isinstance(k[1], mmap.mmap)
             and _ptr(k[1]) == chunked[0])
    host = torch.frombuffer(m, dtype=torch.uint8)
    src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    checks = {}
    for label, offset in (("inside", chunk // 4), ("spanning", chunk - (32 << 20))):
        dest = host[offset:offset + src.numel()]
        best = None
        try:
            for _ in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                dest.copy_(src, non_blocking=True)
                enq = time.perf_counter() - t
                torch.cuda.synchronize()
                total = time.perf_counter() - t
                best = (enq, total) if best is None or total < best[1] else best
        except RuntimeError as exc:  # CUDA refuses a copy across pieces: record it
            checks[label] = {"error": str(exc).splitlines()[0]}
            print(label, checks[label], flush=True)
            continue
        assert best is not None
        checks[label] = {"enqueue_s": round(best[0], 6), "copy_s": round(best[1], 6),
                         "gbps": round(src.numel() / best[1] / 1e9, 2),
                         "bytes_equal": bool(torch.equal(dest, src.cpu()))}
        print(label, checks[label], flush=True)
    return checks


if __name__ == "__main__":
    main()
