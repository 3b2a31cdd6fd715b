"""Shared fixtures: a checkpoint root, small training states, GPU skipping, child processes.

The scripts that tests run as other processes live in ``tests/children/``; ``spawn_child``
starts one (``run_child`` runs one to its end) with this Python, in the checkout, with the
checkout first on ``PYTHONPATH``; ``load_script`` imports one to share its helpers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import pytest
import torch

from ckpt_pipeline.testing import CRASH_ENV

REPO = Path(__file__).resolve().parents[1]
"""The checkout: children run in it, and import ``ckpt_pipeline`` from it."""
CHILDREN = Path(__file__).resolve().parent / "children"
"""The scripts that tests run as child processes."""


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


def child_script(name: str) -> Path:
    """The path of a child's script in ``tests/children/`` (``"crash_child.py"``)."""
    path = CHILDREN / name
    assert path.is_file(), f"no child script {path}"
    return path


def load_script(path: str | Path) -> ModuleType:
    """Import a child's script (a name in ``tests/children/``, or a path) to share its helpers."""
    path = child_script(path) if isinstance(path, str) else path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: this one's with the checkout first on ``PYTHONPATH`` and no
    crash point armed (``CKPT_PIPELINE_CRASH_AT``), then ``extra``."""
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


Stream = int | IO[Any] | Path | None
"""Where a child's stdout or stderr goes: as for ``subprocess.Popen``, or a log file (Path)."""


def spawn_child(script: str | Path, *args: object, env: Mapping[str, str] | None = None,
                unbuffered: bool = False, stdin: int | IO[Any] | None = None,
                stdout: Stream = None, stderr: Stream = None,
                text: bool = False) -> subprocess.Popen[Any]:
    """Start a child: ``script`` (a name in ``tests/children/``, or a path) with ``args``, run
    by this Python (``-u`` when ``unbuffered``) in the checkout, its environment
    ``child_env(env)``. A ``Path`` for ``stdout`` or ``stderr`` is a log file, created or
    truncated, that the child writes."""
    path = child_script(script) if isinstance(script, str) else script
    command = [sys.executable, *(["-u"] if unbuffered else []), str(path), *map(str, args)]
    with contextlib.ExitStack() as logs:
        out, err = (logs.enter_context(s.open("wb")) if isinstance(s, Path) else s
                    for s in (stdout, stderr))
        return subprocess.Popen(command, stdin=stdin, stdout=out, stderr=err, cwd=REPO,
                                env=child_env(env), text=text)


def run_child(script: str | Path, *args: object, timeout: float,
              env: Mapping[str, str] | None = None, stdout: Stream = subprocess.PIPE,
              stderr: Stream = subprocess.PIPE,
              text: bool = False) -> subprocess.CompletedProcess[Any]:
    """Run a child (as ``spawn_child`` starts it) to its end, its output captured unless
    redirected; past ``timeout`` seconds it is killed and ``TimeoutExpired`` raised."""
    with spawn_child(script, *args, env=env, stdout=stdout, stderr=stderr, text=text) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(*args: object) -> subprocess.CompletedProcess[str]:
    """Run the ``ckpt-pipeline`` command in this process (its ``main``), its output captured.

    ``tests/cli/test_cli.py::test_the_command_runs_as_its_own_process`` checks the real
    process once."""
    from ckpt_pipeline.cli import main as cli_main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
