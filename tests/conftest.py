"""Shared fixtures: a checkpoint root, small training states, and GPU skipping."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


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


def load_script(path: Path) -> ModuleType:
    """Import a script beside the tests (a child process's code) to share its helpers."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
