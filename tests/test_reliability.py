"""Faults at every I/O call of a save, short writes, the failure policy, labelled crash points."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import CRASH_POINTS, Fault, FaultyStorage

CHILD = Path(__file__).with_name("crash_point_child.py")


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 1024), float(step)), "b": torch.arange(100) * step}


def _temporaries(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(".*tmp-*")]


def _restore(root: Path) -> tuple[int | None, dict[str, torch.Tensor]]:
    live = {"w": torch.zeros(64, 1024), "b": torch.zeros(100, dtype=torch.int64)}
    with cp.CheckpointPipeline(root, restore_rng=False) as pipe:
        result = pipe.restore_latest(live)
    return (None if result is None else result.step), live


def _calls_of_one_save(root: Path) -> dict[str, int]:
    storage = FaultyStorage(root / "probe")
    with cp.CheckpointPipeline(storage.root, storage=storage, keep_last=1,
                               chunk_bytes=64 * 1024) as pipe:
        pipe.save(1, _state(1)).result(30)
        storage.arm()
        pipe.save(2, _state(2)).result(30)
        pipe.wait(30)
        return storage.calls()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_fault_at_every_io_call_of_a_save_loses_nothing(tmp_path: Path, code: int) -> None:
    calls = _calls_of_one_save(tmp_path)
    assert calls["pwrite"] >= 4 and calls["fsync"] >= 3
    root = tmp_path / "ckpt"
    storage = FaultyStorage(root)
    step = 0
    with cp.CheckpointPipeline(root, storage=storage, keep_last=1, chunk_bytes=64 * 1024,
                               max_failures_in_row=10_000) as pipe:
        step += 1
        pipe.save(step, _state(step)).result(30)
        committed = step
        for call, count in sorted(calls.items()):
            for at in range(1, count + 1):
                step += 1
                storage.arm(Fault(call, at, code))
                handle = pipe.save(step, _state(step))
                pipe.wait_snapshot()
                failed = handle.exception(30) is not None
                with contextlib.suppress(cp.CheckpointError):
                    pipe.wait(30)
                storage.disarm()
                where = f"{call} #{at}"
                assert not _temporaries(root), where
                if failed:
                    assert not (root / f"step-{step:010d}").exists(), where
                else:
                    committed = step
                names = sorted(os.listdir(root))
                assert f"step-{committed:010d}" in names, (where, names)
    restored, live = _restore(root)
    assert restored == committed
    assert torch.equal(live["w"], _state(committed)["w"])


def test_a_short_write_fails_the_save_cleanly(root: Path) -> None:
    storage = FaultyStorage(root)
    with cp.CheckpointPipeline(root, storage=storage, chunk_bytes=64 * 1024) as pipe:
        pipe.save(1, _state(1)).result(30)
        storage.arm(Fault("pwrite", 2, errno.EIO, short_write=True))
        with pytest.raises(cp.StorageError, match="injected EIO"):
            pipe.save(2, _state(2)).result(30)
    assert not _temporaries(root)
    assert _restore(root)[0] == 1


def test_after_three_failures_in_a_row_the_next_save_raises(root: Path) -> None:
    storage = FaultyStorage(root)
    with cp.CheckpointPipeline(root, storage=storage) as pipe:
        pipe.save(1, _state(1)).result(30)
        for step in (2, 3, 4):
            storage.arm(Fault("fsync", 1, errno.EIO))
            handle = pipe.save(step, _state(step))  # training goes on after each failure
            assert handle.exception(30) is not None
        storage.disarm()
        with pytest.raises(cp.SaveError, match="3 saves in a row failed"):
            pipe.save(5, _state(5))
        pipe.save(6, _state(6)).result(30)  # the next one tries again, and works
    assert _restore(root)[0] == 6


def test_strict_mode_raises_at_the_next_save_after_any_failure(root: Path) -> None:
    storage = FaultyStorage(root)
    with cp.CheckpointPipeline(root, storage=storage, strict=True) as pipe:
        storage.arm(Fault("fsync", 1, errno.EIO))
        handle = pipe.save(1, _state(1))
        assert handle.exception(30) is not None
        storage.disarm()
        with pytest.raises(cp.SaveError, match="a previous save failed"):
            pipe.save(2, _state(2))
        pipe.save(3, _state(3)).result(30)


def _run_child(root: Path, label: str) -> int:
    proc = subprocess.run([sys.executable, str(CHILD), str(root), label],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode


@pytest.mark.slow
@pytest.mark.parametrize("label", [p for p in CRASH_POINTS if p != "scrub.removed"])
def test_a_crash_at_each_labelled_point_keeps_the_last_acknowledged_step(
        tmp_path: Path, label: str) -> None:
    root = tmp_path / "ckpt"
    code = _run_child(root, label)
    assert code == -signal.SIGKILL, f"{label}: the child was not killed there ({code})"
    acked = [int(x) for x in Path(str(root) + ".ack").read_text().split()]
    assert acked[:1] == [1]  # step 2 is acknowledged before its retention runs
    restored, live = _restore(root)
    assert restored is not None and restored >= acked[-1], label
    assert torch.equal(live["w"], _state(restored)["w"]), label
    assert torch.equal(live["b"], _state(restored)["b"]), label
    assert not _temporaries(root), label


@pytest.mark.slow
def test_a_crash_during_the_start_up_scrub_is_finished_by_the_next_start(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, _state(1)).result(30)
    step_dir = root / "step-0000000001"
    for name in ("a1", "b2"):
        (step_dir / f".rank-00000.shard.tmp-{name}").write_bytes(b"partial")
    assert _run_child(root, "scrub.removed") == -signal.SIGKILL
    assert len(_temporaries(root)) == 1, "killed after removing one of two leftovers"
    restored, live = _restore(root)
    assert restored == 1 and torch.equal(live["w"], _state(1)["w"])
    assert not _temporaries(root)
