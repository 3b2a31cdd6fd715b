"""The training workload of ``bench_training.py``: the model, the step, and the state it saves.

A stack of ``nn.Linear(hidden, hidden)`` layers in fp32 (ReLU between), AdamW (fused on CUDA),
the forward under bf16 autocast, a fixed random batch on the device. Parameters and the two
Adam moments are the checkpointed state (about 4.8 GB with the defaults: 24 x 4096 x 4096).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = (
    "HostMirror",
    "Workload",
    "build_workload",
    "host_memory_stats",
    "release_cached_pinned_memory",
    "rss_bytes",
    "state_tensors",
    "sync",
)

ALIGN = 4096


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Workload:
    """One model, its optimizer and a fixed batch; ``step()`` is one training step."""

    model: torch.nn.Module
    optim: torch.optim.Optimizer
    x: torch.Tensor
    device: torch.device
    autocast: bool
    fused: bool

    def step(self, before_update: Callable[[], None] | None = None) -> None:
        """zero_grad, forward (bf16 autocast), backward, ``before_update()``, optimizer step."""
        self.optim.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(self.x)
        loss = out.float().square().mean()
        loss.backward()
        if before_update is not None:
            before_update()
        self.optim.step()

    def state(self) -> dict[str, Any]:
        """The objects ckpt_pipeline saves (it calls ``state_dict()`` itself)."""
        return {"model": self.model, "optim": self.optim}

    def state_dicts(self) -> dict[str, Any]:
        """The same state as plain state dicts, for torch.save and DCP."""
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def sync(self) -> None:
        sync(self.device)


def build_workload(*, layers: int, hidden: int, batch: int, device: torch.device,
                   autocast: bool, fused: bool, relu: bool = True, seed: int = 0,
                   lr: float = 1e-4) -> Workload:
    """A fresh model and optimizer (no optimizer state until the first step)."""
    torch.manual_seed(seed)
    modules: list[torch.nn.Module] = []
    for i in range(layers):
        modules.append(torch.nn.Linear(hidden, hidden, device=device))
        if relu and i < layers - 1:
            modules.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*modules)
    kwargs: dict[str, Any] = {"lr": lr}
    if fused:
        kwargs["fused"] = True
    optim = torch.optim.AdamW(model.parameters(), **kwargs)
    x = torch.randn(batch, hidden, device=device)
    return Workload(model, optim, x, device, autocast, fused)


def state_tensors(work: Workload) -> list[torch.Tensor]:
    """Parameters, then each parameter's optimizer state tensors (exp_avg, exp_avg_sq, step)."""
    tensors = [p.detach() for p in work.model.parameters()]
    for p in work.model.parameters():
        for value in work.optim.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value.detach())
    return tensors


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostMirror:
    """One preallocated host buffer (pinned when CUDA is used) laid out for a list of tensors.

    The floors copy into it, write from it and read back into it, so that they all handle the
    same bytes as the checkpoints. Offsets are 4 KiB aligned, like the library's format.
    """

    def __init__(self, tensors: list[torch.Tensor], *, pinned: bool) -> None:
        self.tensors = tensors
        self.offsets: list[int] = []
        end = 0
        for t in tensors:
            start = _align(end)
            self.offsets.append(start)
            end = start + t.numel() * t.element_size()
        self.nbytes = _align(end)
        self.tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.pinned = pinned
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.buffer.fill_(0)  # fault every page in now, not inside a measurement
        self.views = [self.buffer[o:o + t.numel() * t.element_size()].view(t.dtype)
                      for o, t in zip(self.offsets, tensors)]

    def copy_from_device(self) -> None:
        """Device-to-host copy of every tensor into the buffer (asynchronous on CUDA)."""
        for view, t in zip(self.views, self.tensors):
            view.copy_(t.reshape(-1), non_blocking=self.pinned)

    def byte_view(self, start: int = 0, stop: int | None = None) -> memoryview:
        """A writable memoryview of the buffer's bytes, without NumPy."""
        import ctypes

        stop = self.nbytes if stop is None else stop
        array = (ctypes.c_ubyte * (stop - start)).from_address(self.buffer.data_ptr() + start)
        return memoryview(array).cast("B")


def rss_bytes() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes (empty where /proc is missing)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def host_memory_stats() -> dict[str, Any] | None:
    """torch's pinned (host) caching allocator statistics, where this torch has them."""
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return None
    try:
        stats = fn()
    except Exception:
        return None
    return {k: v for k, v in stats.items() if isinstance(v, (int, float))}


def release_cached_pinned_memory() -> bool:
    """Return cached pinned blocks to the driver, so that the next allocation pays in full.

    torch keeps freed pinned blocks for reuse; without this, the pipeline's first save could
    reuse the floors' buffer and look cheaper than it is for a training job.
    """
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is None or not torch.cuda.is_available():
        return False
    import gc

    gc.collect()
    try:
        fn()
    except Exception:
        return False
    return True
