"""A save that fails leaves no temporaries, keeps the previous checkpoint, and says why."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import Fault, FaultyStorage, GatedStorage

FAULTS = {"pwrite": Fault("pwrite", 1, errno.EIO), "fsync": Fault("fsync", 1, errno.EIO),
          "publish": Fault("publish", 1, errno.EIO),
          "publish_commit": Fault("publish", 1, errno.EIO, name=".commit")}
"""The first call of a kind after arming fails (``publish_commit``: of a commit record)."""


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("call", ["pwrite", "fsync", "publish", "publish_commit"])
def test_io_failure_fails_the_save_and_keeps_the_previous_checkpoint(root: Path,
                                                                      call: str) -> None:
    storage = FaultyStorage(root)
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root, storage=storage) as pipe:
        pipe.subscribe(events.append)
        pipe.save(1, {"w": torch.full((100,), 1.0)}).result(30)
        before = _files(root)
        storage.arm(FAULTS[call])
        handle = pipe.save(2, {"w": torch.full((100,), 2.0)})
        with pytest.raises(cp.StorageError) as info:
            handle.result(30)
        storage.disarm()
        assert info.value.step == 2
        assert _files(root) == before, "no temporaries or partial files remain"
        failed = [e for e in events if isinstance(e, cp.SaveFailed)]
        assert [e.step for e in failed] == [2]
        pipe.save(3, {"w": torch.full((100,), 3.0)}).result(30)  # training goes on
    live = {"w": torch.zeros(100)}
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(live)
    assert result is not None and result.step == 3


def test_too_little_free_space_fails_the_save_before_writing(root: Path) -> None:
    storage = FaultyStorage(root)
    with cp.CheckpointPipeline(root, storage=storage) as pipe:
        pipe.save(1, {"w": torch.ones(10)}).result(30)
        storage.arm(Fault("free_bytes", 1, errno.ENOSPC))  # the disk reports itself full
        with pytest.raises(cp.StorageError, match="not enough free space") as info:
            pipe.save(2, {"w": torch.ones(10)}).result(30)
    assert info.value.step == 2 and info.value.rank == 0
    assert sorted(n for n in os.listdir(root) if not n.startswith(".lock-")) == ["step-0000000001"]


def test_wait_raises_the_failure_of_a_pending_save(root: Path) -> None:
    storage = FaultyStorage(root)
    with cp.CheckpointPipeline(root, storage=storage) as pipe:
        storage.arm(Fault("fsync", 1, errno.EIO))
        pipe.save(1, {"w": torch.ones(10)})
        with pytest.raises(cp.StorageError):
            pipe.wait(30)


def test_skip_policy_drops_a_save_while_the_buffer_is_busy(root: Path) -> None:
    storage = GatedStorage(root)
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root, storage=storage, when_busy="skip") as pipe:
        pipe.subscribe(events.append)
        first = pipe.save(1, {"w": torch.ones(10)})
        assert storage.entered.wait(30)
        skipped = pipe.save(2, {"w": torch.ones(10)})
        with pytest.raises(cp.PoolBusyError, match="skipped"):
            skipped.result(0)
        storage.gate.set()
        assert first.result(30).step == 1
        pipe.save(3, {"w": torch.ones(10)}).result(30)
    assert [e.step for e in events if isinstance(e, cp.SaveSkipped)] == [2]


def test_block_policy_waits_for_a_free_buffer(root: Path) -> None:
    storage = GatedStorage(root)
    with cp.CheckpointPipeline(root, storage=storage, when_busy="block") as pipe:
        first = pipe.save(1, {"w": torch.ones(10)})
        assert storage.entered.wait(30)
        storage.gate.set()  # the second save() below blocks until the first releases its slot
        second = pipe.save(2, {"w": torch.full((10,), 2.0)})
        assert first.result(30).step == 1 and second.result(30).step == 2
