"""Where a benchmark ran and on what: recorded beside every result."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

__all__ = ("filesystem_of", "gpu_info", "machine_info")

GB = 1e9
REPO = Path(__file__).resolve().parents[1]


def filesystem_of(path: Path) -> dict[str, Any]:
    real = os.path.realpath(path)
    best: dict[str, Any] = {}
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            device, mount_point, fstype, options, *_ = line.split()
            inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best.get("mount_point", "")):
                best = {"device": device, "mount_point": mount_point, "type": fstype,
                        "options": options}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        df = subprocess.run(["df", "-T", "-B1", real], capture_output=True, text=True, timeout=10)
        if df.returncode == 0:
            best["df_T"] = df.stdout.strip()
    return best


def gpu_info() -> dict[str, Any] | None:
    """The GPU a CUDA benchmark ran on (the current device); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    info: dict[str, Any] = {"name": torch.cuda.get_device_name(device),
                            "count": torch.cuda.device_count(),
                            "memory_gb": round(props.total_memory / GB, 1),
                            "capability": f"{props.major}.{props.minor}",
                            "torch_cuda": torch.version.cuda}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
        if smi.returncode == 0:
            info["nvidia_smi"] = smi.stdout.strip()
    return info


def machine_info(workdir: Path, *, gpu: bool = False) -> dict[str, Any]:
    """``gpu``: record the GPU too (``gpu_info``); asked for, since it initialises CUDA in
    this process, which a benchmark that forks CUDA workers later must not do."""
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "filesystem": filesystem_of(workdir),
        "loadavg_at_start": os.getloadavg(),
    }
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                info["mem_total_gb"] = round(int(line.split()[1]) * 1024 / GB, 1)
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    if gpu:
        info["gpu"] = gpu_info()
    for package in ("numpy", "aiofiles", "anyio", "msgpack", "xxhash", "lightning",
                    "transformers", "accelerate"):
        with contextlib.suppress(Exception):
            info[package] = version(package)
    pinned = os.environ.get("CKPT_BENCH_COMMIT")
    if pinned:  # a copy of the code without its own .git (e.g. a `git archive` on a GPU host)
        info["git_commit"], info["git_dirty"] = pinned, False
        info["git_commit_source"] = "CKPT_BENCH_COMMIT"
        return info
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            info["git_commit"] = head.stdout.strip()
            info["git_dirty"] = bool(dirty.stdout.strip())
    return info
