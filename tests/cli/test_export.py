"""``ckpt-pipeline show`` and ``export`` (and ``ckpt_pipeline.export``): every dtype, subtrees,
torch.compile prefixes, tied weights, sharded files with an index, bad input, and the example's
model taken to safetensors and back."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.limits import DTYPES
from ckpt_pipeline.export import export
from tests._support.children import child_env
from tests._support.cli import run_cli as _cli

safetensors_torch = pytest.importorskip("safetensors.torch")
REPO = Path(__file__).resolve().parents[2]


def _sample(dtype: torch.dtype, n: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high, (n,), generator=g, dtype=torch.int64).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
        if b.element_size() == 1 else b)


class Tied(torch.nn.Module):
    """An embedding whose output projection shares its weight (GPT-style tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.emb(x))))


def _save(root: Path, state: dict[str, Any], step: int = 5, **extra: Any) -> None:
    with cp.CheckpointPipeline(root, direct_io=False) as pipe:
        pipe.save(step, state, cp.TrainState(step=step, consumed_train_samples=step * 4,
                                             extra=extra)).result(60)


# ------------------------------------------------------------------------------ dtypes


def test_every_dtype_round_trips_through_load_torch_and_safetensors(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    tensors = {name: _sample(dtype) for name, dtype in DTYPES.items()}
    _save(root, {"t": tensors})
    loaded = cp.load(root).tree["t"]
    assert all(_same(loaded[k], v) for k, v in tensors.items())

    result = export(root, tmp_path / "out" / "all.bin", to="torch", only="t")
    back = torch.load(result.files[0], weights_only=True)
    assert set(back) == set(tensors) and all(_same(back[k], v) for k, v in tensors.items())

    # safetensors stores every dtype it has a type for; complex128 it has not: a clear
    # error naming the tensor, never a silent cast.
    supported = {k: v for k, v in tensors.items() if k != "complex128"}
    root2 = tmp_path / "ckpt2"
    _save(root2, {"ok": supported, "other": {"c": tensors["complex128"]}})
    result = export(root2, tmp_path / "st" / "all.safetensors", only="ok")
    back = safetensors_torch.load_file(result.files[0])
    assert set(back) == set(supported)
    assert all(_same(back[k], v) for k, v in supported.items())
    with pytest.raises(cp.CheckpointError, match="complex128") as info:
        export(root2, tmp_path / "st" / "c.safetensors", only="other")
    assert "'c'" in str(info.value) and "--to torch" in (info.value.hint or "")
    assert not (tmp_path / "st" / "c.safetensors").exists()


# ------------------------------------------------------------------- model to inference


@pytest.mark.slow
def test_compiled_model_exports_with_stripped_prefix_into_a_fresh_model(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    _save(root, {"model": compiled, "optim": opt}, loss=0.5)
    hinted = _cli("export", root, tmp_path / "a" / "model.safetensors", "--only", "model")
    assert hinted.returncode == 0, hinted.stderr
    assert "--strip-prefix _orig_mod." in hinted.stderr  # detected and offered
    done = _cli("export", root, tmp_path / "b" / "model.safetensors", "--only", "model",
                "--strip-prefix", "_orig_mod.")
    assert done.returncode == 0, done.stderr
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    fresh.load_state_dict(safetensors_torch.load_file(tmp_path / "b" / "model.safetensors"),
                          strict=True)
    x = torch.randn(4, 8)
    assert torch.equal(fresh(x), model(x))


def test_tied_weights_are_stored_once_and_come_back_tied(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    model = Tied()
    _save(root, {"model": model})
    result = export(root, tmp_path / "st" / "model.safetensors", only="model")
    assert dict(result.tied) == {"head.weight": "emb.weight"}
    stored = safetensors_torch.load_file(result.files[0])
    assert set(stored) == {"emb.weight", "body.weight", "body.bias"}  # the tied one once
    fresh = Tied()
    missing, unexpected = safetensors_torch.load_model(fresh, result.files[0])
    assert not missing and not unexpected
    assert fresh.head.weight.data_ptr() == fresh.emb.weight.data_ptr()
    assert torch.equal(fresh.emb.weight, model.emb.weight)
    with open(result.files[0], "rb") as f:  # the metadata says which name it stands for
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert json.loads(header["__metadata__"]["ckpt_pipeline.tied"]) == {
        "head.weight": "emb.weight"}

    result = export(root, tmp_path / "pt" / "model.bin", to="torch", only="model")
    back = torch.load(result.files[0], weights_only=True)
    assert back["head.weight"].data_ptr() == back["emb.weight"].data_ptr()
    fresh = Tied()
    fresh.load_state_dict(back, strict=True)
    x = torch.arange(10)
    assert torch.equal(fresh(x), model(x))


def test_a_sharded_export_loads_through_its_index(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    _save(root, {"model": model, "step_count": 7})
    out = tmp_path / "hf" / "model.safetensors"
    done = _cli("export", root, out, "--only", "model", "--max-shard-size", "20KB",
                "--dtype", "bf16", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    assert report["files"][-1] == str(index_path) and not out.exists()
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(report["files"]) - 1 >= 3
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged: dict[str, torch.Tensor] = {}
    for name in files:
        part = safetensors_torch.load_file(tmp_path / "hf" / name)
        assert all(index["weight_map"][k] == name for k in part)
        merged.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in merged.values())
    assert all(t.dtype == torch.bfloat16 for t in merged.values())
    fresh = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    fresh.load_state_dict({k: v.float() for k, v in merged.items()}, strict=True)
    assert all(torch.equal(a, b.detach().to(torch.bfloat16).float())
               for a, b in zip(fresh.state_dict().values(), model.state_dict().values(),
                               strict=True))


# ------------------------------------------------------------------------------ input


def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, {"model": torch.nn.Linear(4, 4), "meta": {"name": "x"}})
    out = tmp_path / "out" / "model.safetensors"
    unknown = _cli("export", root, out, "--step", 99)
    assert unknown.returncode == 1 and "step 99" in unknown.stderr
    assert str(root) in unknown.stderr
    subtree = _cli("export", root, out, "--only", "modle")
    assert subtree.returncode == 1 and "'modle'" in subtree.stderr
    assert "model, meta" in subtree.stderr or "meta, model" in subtree.stderr
    assert "step-0000000005" in subtree.stderr
    plain = _cli("export", root, out, "--only", "meta")
    assert plain.returncode == 1 and "no tensors" in plain.stderr
    assert not out.parent.exists() or not any(out.parent.iterdir())
    assert _cli("export", root, out, "--only", "model").returncode == 0
    again = _cli("export", root, out, "--only", "model")
    assert again.returncode == 1 and "exists" in again.stderr and "--force" in again.stderr
    assert _cli("export", root, out, "--only", "model", "--force").returncode == 0
    assert _cli("export", root, out, "--dtype", "int4").returncode == 2
    assert _cli("export", root, out, "--max-shard-size", "lots").returncode == 2


# ------------------------------------------------------------------------ show and ls


def test_show_lists_tensors_and_the_train_state(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, {"model": torch.nn.Linear(8, 4)}, loss=0.25, tokens=1024)
    done = _cli("show", root)
    assert done.returncode == 0, done.stderr
    assert "model/weight" in done.stdout and "float32" in done.stdout and "4x8" in done.stdout
    assert "extra.loss = 0.25" in done.stdout and "consumed samples 20" in done.stdout
    data = json.loads(_cli("show", root, "--json").stdout)
    assert {t["path"]: (t["dtype"], t["shape"], t["bytes"]) for t in data["tensors"]} == {
        "model/weight": ("float32", [4, 8], 128), "model/bias": ("float32", [4], 16)}
    assert data["train_state"]["extra"] == {"loss": 0.25, "tokens": 1024}
    listed = _cli("ls", root)
    assert "samples=20" in listed.stdout and "loss=0.25" in listed.stdout
    assert json.loads(_cli("ls", root, "--json").stdout)["steps"][0]["extra"] == {
        "loss": 0.25, "tokens": 1024}
    assert _cli("show", root, "--step", 4).returncode == 1


# -------------------------------------------------------------- the example, end to end


@pytest.mark.slow
def test_the_example_model_goes_to_safetensors_and_back_with_the_same_outputs(
    tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, str(REPO / "examples" / "train_resume.py"),
                          "--root", str(root), "--steps", "60", "--save-every", "30",
                          "--device", "cpu"], capture_output=True, text=True, timeout=240,
                         env=child_env(), check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    out = tmp_path / "export" / "model.safetensors"
    done = subprocess.run([sys.executable, "-m", "ckpt_pipeline.cli", "export", str(root),
                           str(out), "--only", "model"], capture_output=True, text=True,
                          timeout=120, env=child_env(), check=False)
    assert done.returncode == 0, done.stderr
    spec = importlib.util.spec_from_file_location("train_resume",
                                                  REPO / "examples" / "train_resume.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    device = torch.device("cpu")
    from_file = example.build_model(123, device).eval()
    from_file.load_state_dict(safetensors_torch.load_file(out), strict=True)
    restored = example.build_model(456, device).eval()  # the trained model, as checkpointed
    checkpoint = cp.load(root)
    restored.load_state_dict(checkpoint.tree["model"], strict=True)
    x = torch.randn(32, example.IN_FEATURES)
    assert checkpoint.step == 60
    assert torch.equal(from_file(x), restored(x))
