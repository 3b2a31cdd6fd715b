"""Faults of the local disk reach the persistent tier: its uploads read the committed files and
its downloads write the restored ones through the pipeline's ``Storage``, so that a
``FaultyStorage`` (and a ``PowerLossStorage``) sees those calls as it sees a save's. A failed
read fails the promotion (the step stays local, the next one persists); a failed write fails
the download (the restore falls back to the step before, and the half-written files go)."""

from __future__ import annotations

import errno
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import Fault, FaultyStorage, capture_logs


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(32, 32), "big": torch.randn(100_000)}


def _open(storage: FaultyStorage, tier: Path) -> cp.CheckpointPipeline:
    return cp.CheckpointPipeline(storage.root, storage=storage, persistent=str(tier),
                                 direct_io=False)


def _until(found: Any) -> Any:
    """Poll ``found()`` until it is truthy (the pipeline's threads report as they go)."""
    deadline = time.monotonic() + 60
    while not (result := found()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return result


def _uploaded(events: list[cp.Event], step: int) -> bool:
    return any(isinstance(e, cp.ShardUploaded) and e.step == step for e in list(events))


def _persist(root: Path, tier: Path, steps: list[int]) -> None:
    """Save ``steps`` into ``root``, each uploaded before the next; all persisted at close."""
    events: list[cp.Event] = []
    with _open(FaultyStorage(root), tier) as pipe:
        pipe.subscribe(events.append)
        for step in steps:
            pipe.save(step, _state(step)).result(60)
            _until(lambda step=step: _uploaded(events, step))
    assert [e.step for e in events if isinstance(e, cp.StepPersisted)] == steps


def test_a_read_fault_during_an_upload_fails_that_promotion_only(tmp_path: Path) -> None:
    storage = FaultyStorage(tmp_path / "local")
    events: list[cp.Event] = []
    with capture_logs(logging.WARNING) as logs, _open(storage, tmp_path / "tier") as pipe:
        pipe.subscribe(events.append)
        pipe.save(1, _state(1)).result(60)
        _until(lambda: _uploaded(events, 1))
        storage.arm(Fault("pread_into", 1, errno.EIO, name=".shard"))
        pipe.save(2, _state(2)).result(60)
        _until(lambda: [e for e in list(logs) if e["event"] == "ckpt.persist.upload_failed"])
        assert [f.call for f in storage.fired] == ["pread_into"]
        pipe.save(3, _state(3)).result(60)
        _until(lambda: _uploaded(events, 3))
    failed = [e for e in events if isinstance(e, cp.PersistFailed)]
    assert [e.step for e in failed] == [2] and "injected EIO" in failed[0].error, failed
    assert storage.calls()["open_read"] >= 3  # the committed files were opened through it
    assert [e.step for e in events if isinstance(e, cp.StepPersisted)] == [1, 3]
    committed = [e.step for e in events if isinstance(e, cp.CheckpointCommitted)]
    assert committed == [1, 2, 3]  # the save itself never saw the fault


def test_a_write_fault_during_a_download_fails_it_and_the_restore_falls_back(
    tmp_path: Path
) -> None:
    _persist(tmp_path / "old", tmp_path / "tier", [10, 20])
    shutil.rmtree(tmp_path / "old")
    storage = FaultyStorage(tmp_path / "new")
    storage.arm(Fault("pwrite", 1, errno.EIO, name=".shard"))
    state = _state(999)
    with _open(storage, tmp_path / "tier") as pipe:
        result = pipe.restore_latest(state)
    assert [f.call for f in storage.fired] == ["pwrite"]
    assert result is not None and result.step == 10 and result.downloaded == (0,)
    assert [r.step for r in result.rejected] == [20]
    assert "injected EIO" in result.rejected[0].reason, result.rejected
    assert torch.equal(state["big"], _state(10)["big"])
    assert not (storage.root / "step-0000000020").exists()  # the failed download went


def test_a_download_that_cannot_size_its_file_fails_and_the_restore_falls_back(
    tmp_path: Path
) -> None:
    _persist(tmp_path / "old", tmp_path / "tier", [10, 20])
    shutil.rmtree(tmp_path / "old")
    storage = FaultyStorage(tmp_path / "new")
    storage.arm(Fault("truncate", 1, errno.ENOSPC))
    with _open(storage, tmp_path / "tier") as pipe:
        result = pipe.restore_latest(_state(999))
    assert [f.call for f in storage.fired] == ["truncate"]
    assert result is not None and result.step == 10
    assert "cannot size the download of step 20" in result.rejected[0].reason
