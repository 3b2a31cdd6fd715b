"""``cp.load``, ``show`` and ``export`` of a persistent tier's steps, by URL: against moto's S3
server and a shared directory (``file://PATH``), after the local root is gone.

The steps are promoted by a real pipeline (``_save_steps`` of ``test_persist.py``); the
loads stream each rank's files into a temporary directory and must leave nothing there, and
write nothing under the URL.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._tiers.persistent.urls import open_remote
from tests._support.cli import run_cli

from .test_persist import _save_steps


# S3 in the slow suite: the fast one covers S3 in test_remote.py, test_owner.py and the CLI's URLs
@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.slow), "dir"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    """(URL, options) of an empty persistent tier; the directory is named by file://."""
    if request.param == "dir":
        return f"file://{tmp_path / 'shared' / 'run'}", None
    url, options = request.getfixturevalue("s3_url")
    return url, options


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TMPDIR for the test: where the downloads go (no ckpt-* left there afterwards)."""
    import tempfile

    where = tmp_path / "tmpdir"
    where.mkdir()
    monkeypatch.setenv("TMPDIR", str(where))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    return where


def _objects(url: str, options: dict[str, Any] | None) -> dict[str, dict[str, int]]:
    remote = open_remote(url, options=options)
    try:
        return {name: remote.list_dir(name) for name in remote.list_steps()}
    finally:
        remote.close()


def _flat_loaded(tree: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in tree["model"].items()}
    out["big"] = tree["big"]
    for i, s in tree["optimizer"]["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{i}.{k}"] = v
    return out


@pytest.mark.slow  # 2.5 s; loading by URL stays in the fast suite through show/export
@pytest.mark.timeout(120)
def test_load_by_url_reads_a_persisted_step_after_the_local_root_is_gone(
        tmp_path: Path, tier: tuple[str, dict[str, Any] | None], temp_dir: Path) -> None:
    url, options = tier
    saved = _save_steps(tmp_path / "local", tier, [10, 20], settle=True)
    shutil.rmtree(tmp_path / "local")
    before = _objects(url, options)

    newest = cp.load(url, options=options)
    assert (newest.step, newest.rank, newest.world_size) == (20, 0, 1)
    assert newest.path.endswith("/step-0000000020") and "local" not in newest.path
    assert newest.train_state.extra == {"tag": "s20"}
    assert newest.train_state.consumed_train_samples == 160
    got = _flat_loaded(newest.tree)
    assert got.keys() == saved[20].keys()
    assert all(torch.equal(got[k], saved[20][k]) for k in got)

    older = cp.load(url, 10, options=options, consolidate=True)
    assert (older.step, older.rank) == (10, None)
    assert torch.equal(older.tree["big"], saved[10]["big"])

    assert _objects(url, options) == before  # nothing written under the URL
    assert list(temp_dir.glob("ckpt-*")) == []  # the downloads are gone
    assert not (tmp_path / "local").exists()


@pytest.mark.slow  # 2.5 s for the dir case (the fast suite's minute)
@pytest.mark.timeout(120)
def test_load_by_url_names_what_is_there_when_the_step_or_rank_is_not(
        tmp_path: Path, tier: tuple[str, dict[str, Any] | None], temp_dir: Path) -> None:
    url, options = tier
    _save_steps(tmp_path / "local", tier, [10, 20], settle=True)
    with pytest.raises(cp.CheckpointError) as info:
        cp.load(url, 15, options=options)
    assert "step 15 is not committed" in str(info.value) and "(committed: 20, 10)" in str(
        info.value)
    assert info.value.step == 15
    with pytest.raises(cp.CheckpointError) as info:
        cp.load(url, rank=1, options=options)
    assert "saved by 1 rank(s); there is no rank 1" in str(info.value)
    with pytest.raises(cp.ConfigError, match="applies to a persistent tier's URL"):
        cp.load(tmp_path / "local", options={"endpoint": "http://x"})
    assert list(temp_dir.glob("ckpt-*")) == []


@pytest.mark.timeout(120)
def test_a_damaged_object_fails_the_load_and_leaves_no_download(
        tmp_path: Path, temp_dir: Path) -> None:
    """A shard object changed after its upload: the part that differs from the commit
    object fails the load with an error naming the step, and the temporary files are gone."""
    shared = tmp_path / "shared" / "run"
    url = f"file://{shared}"
    _save_steps(tmp_path / "local", (url, None), [10], settle=True)
    shard = shared / "step-0000000010" / "rank-00000.shard"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(cp.CheckpointIntegrityError) as info:
        cp.load(url)
    assert info.value.step == 10
    assert list(temp_dir.glob("ckpt-*")) == []
    assert cp.load(tmp_path / "local").step == 10  # the local root was never involved


@pytest.mark.timeout(120)
def test_show_and_export_take_a_url_with_its_options(
        tmp_path: Path, s3_url: tuple[str, dict[str, Any]], temp_dir: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    url, options = s3_url
    saved = _save_steps(tmp_path / "local", (url, options), [10, 20], settle=True)
    shutil.rmtree(tmp_path / "local")
    flags = [a for k, v in options.items() for a in ("--option", f"{k}={v}")]

    done = run_cli("show", url, *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"step 20 of {url}/step-0000000020 (rank 0 of 1")
    assert "extra.tag = 's20'" in done.stdout and "model/weight" in done.stdout

    out = tmp_path / "export" / "model.safetensors"
    done = run_cli("export", url, str(out), "--step", "10", "--only", "model", *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("step 10: 2 tensors")
    exported = safetensors_torch.load_file(out)
    assert exported.keys() == {"weight", "bias"}
    assert torch.equal(exported["weight"], saved[10]["model.weight"])

    missing = run_cli("show", url)  # without the endpoint the store cannot be reached
    assert missing.returncode != 0
    assert list(temp_dir.glob("ckpt-*")) == []
    assert os.path.exists(out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
def test_load_by_url_onto_the_gpu(tmp_path: Path, temp_dir: Path) -> None:
    """A directory tier's step streamed straight into GPU memory (``map_location="cuda"``),
    every tensor equal to what was saved."""
    url = f"file://{tmp_path / 'shared' / 'run'}"
    saved = _save_steps(tmp_path / "local", (url, None), [10], settle=True)
    shutil.rmtree(tmp_path / "local")
    loaded = cp.load(url, map_location="cuda")
    got = _flat_loaded(loaded.tree)
    assert all(t.is_cuda for t in got.values())
    assert all(torch.equal(got[k].cpu(), saved[10][k]) for k in saved[10])
    assert list(temp_dir.glob("ckpt-*")) == []
