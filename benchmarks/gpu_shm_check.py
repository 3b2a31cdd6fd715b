"""A look at the memory tier's buffer on the GPU machine: a /dev/shm file made by the tier's
ShmBuffer (posix_fallocate, mmap, cudaHostRegister), whether torch sees it as pinned, and the
device-to-host copy speed into it against a pinned torch buffer, measured in the same run.

    python benchmarks/gpu_shm_check.py [--gib 4] [--out shm_check.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from ckpt_pipeline._tiers.memory.shm import ShmBuffer


def _d2h_gbps(dst: torch.Tensor, src: torch.Tensor, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return src.numel() / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    size = int(args.gib * (1 << 30)) // 4096 * 4096
    path = f"/dev/shm/ckpt-shm-check-{os.getpid()}"
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    started = time.perf_counter()
    shm = ShmBuffer(path, size, register=True)
    made = time.perf_counter() - started
    try:
        assert shm.tensor is not None
        out = {
            "bytes": size, "make_register_s": made, "registered": shm.registered,
            "torch_is_pinned": bool(shm.tensor.is_pinned()),
            "d2h_shm_gbps": _d2h_gbps(shm.tensor, src),
        }
        started = time.perf_counter()
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        out["pin_alloc_s"] = time.perf_counter() - started
        out["d2h_pinned_gbps"] = _d2h_gbps(pinned, src)
        out["bytes_equal"] = bool(torch.equal(shm.tensor[:1 << 20].cuda(), src[:1 << 20]))
        del pinned
    finally:
        shm.close()
        os.unlink(path)
    out["pinned_after_unregister_ok"] = torch.empty(1 << 20, dtype=torch.uint8,
                                                    pin_memory=True).is_pinned()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
