"""Small training states for the tests, their exact comparison, and digests of their tensors."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = ("assert_same_state", "make_training_state", "tensor_hashes", "train_one_step")


def make_training_state(seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """A small model with AdamW and a scheduler, after one optimizer step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    x = torch.randn(8, 16, device=device)
    model(x).pow(2).mean().backward()
    opt.step()
    sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched}


def train_one_step(state: dict[str, Any], seed: int) -> None:
    """One optimizer and scheduler step of a ``make_training_state`` state, on inputs drawn
    from ``seed``."""
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g).to(device)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    sched.step()


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Model, optimizer and scheduler states are bit-identical."""
    for (ka, va), (kb, vb) in zip(a["model"].state_dict().items(),
                                  b["model"].state_dict().items(), strict=True):
        assert ka == kb
        assert torch.equal(va.cpu(), vb.cpu()), ka
    oa, ob = a["optimizer"].state_dict(), b["optimizer"].state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for key in oa["state"]:
        for name, value in oa["state"][key].items():
            assert torch.equal(value.cpu(), ob["state"][key][name].cpu()), (key, name)
    assert a["scheduler"].state_dict() == b["scheduler"].state_dict()


def tensor_hashes(obj: Any, path: str = "") -> dict[str, str]:
    """sha256 of each tensor's bytes (row-major) by '/'-joined path, objects with
    ``state_dict()`` walked through it: what ``tests/format/fixtures/format-v1/expected.json``
    holds."""
    out: dict[str, str] = {}
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().reshape(-1).contiguous()
        raw = bytes(flat.view(torch.uint8).tolist()) if flat.numel() else b""
        out[path] = hashlib.sha256(raw).hexdigest()
    elif hasattr(obj, "state_dict"):
        out.update(tensor_hashes(obj.state_dict(), path))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            out.update(tensor_hashes(value, f"{path}/{key}" if path else str(key)))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(tensor_hashes(value, f"{path}/{i}"))
    return out
