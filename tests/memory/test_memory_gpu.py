"""The memory tier with CUDA tensors on a real GPU (skipped without one): device-to-host
copies into registered shared memory, a restore from memory after a crash, SIGKILL at random
moments while a CUDA model trains, and the buffers unregistered at close."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from tests._support.children import REPO, child_env
from tests._support.gate import gated_buffer_making
from tests._support.states import assert_same_state, make_training_state

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_cuda_saves_land_in_registered_shared_memory(tmp_path: Path, shm_dir: Path) -> None:
    state = make_training_state(seed=1, device="cuda")
    with cp.CheckpointPipeline(tmp_path / "root", memory=str(shm_dir)) as pipe:
        info = pipe.save(1, state, cp.TrainState(step=1)).result(60)
        assert info.tier == "memory"
        assert pipe.host_memory_pinned  # the shm buffer is registered with CUDA
    fresh = make_training_state(seed=2, device="cuda")
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:  # flushed to disk at close
        result = pipe.restore_latest(fresh)
    assert result is not None and result.step == 1
    assert_same_state(state, fresh)
    pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)  # unregistered cleanly
    assert pinned.is_pinned()


def test_mutation_after_wait_snapshot_does_not_reach_the_memory_step(
        tmp_path: Path, shm_dir: Path) -> None:
    t = torch.full((4096, 4096), 1.0, device="cuda")
    with cp.CheckpointPipeline(tmp_path / "root", memory=str(shm_dir),
                               device_staging=True) as pipe:
        handle = pipe.save(1, {"t": t})
        pipe.wait_snapshot()
        t.add_(1.0)
        assert handle.result(60).tier == "memory"
        live = {"t": torch.zeros(4096, 4096, device="cuda")}
        result = pipe.restore_latest(live)
        assert result is not None and result.from_memory == (0,)
    assert torch.equal(live["t"], torch.full((4096, 4096), 1.0, device="cuda"))


@pytest.mark.parametrize("staging", [True, None], ids=["device_staging", "default"])
def test_a_first_memory_save_does_not_wait_for_its_buffer(
        tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch,
        staging: bool | None) -> None:
    """A fresh job's shared-memory buffers are still being made (held at a gate) when the
    first save comes: it copies to a staging buffer (the default: a transient one) and
    returns; the step committed to memory holds the bytes of the save, not those of the
    update after wait_snapshot()."""
    t = torch.full((2048, 2048), 1.0, device="cuda")
    with gated_buffer_making(monkeypatch) as gate, \
            cp.CheckpointPipeline(tmp_path / "root", memory=str(shm_dir),
                                  device_staging=staging) as pipe:
        handle = pipe.save(1, {"t": t})
        pipe.wait_snapshot()
        assert pipe.host_memory_bytes == 0  # save() returned with no buffer made yet
        t.add_(1.0)
        assert gate.entered.wait(30)
        assert not handle.done()
        gate.opened.set()
        assert handle.result(60).tier == "memory"
        live = {"t": torch.zeros_like(t)}
        result = pipe.restore_latest(live)
        assert result is not None and result.from_memory == (0,)
    assert torch.equal(live["t"], torch.full_like(t, 1.0))


_CUDA_CHILD = """
    import os, sys, torch
    import ckpt_pipeline as cp
    root, memory, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def state(step):
        gen = torch.Generator(device="cuda").manual_seed(step)
        return {"w": torch.randn(2048, 2048, device="cuda", generator=gen),
                "m": torch.randn(2048, 2048, device="cuda", generator=gen)}
    with cp.CheckpointPipeline(root, memory=cp.MemoryConfig(memory, disk_every=4)) as pipe:
        live = state(0)
        pipe.restore_latest(live)
        for step in range(start, start + 10000):
            s = state(step)
            live["w"].copy_(s["w"]); live["m"].copy_(s["m"])
            handle = pipe.save(step, live, cp.TrainState(step=step))
            pipe.wait_snapshot()
            handle.result(60)
            print(step, flush=True)
"""


def test_sigkill_at_random_moments_restores_the_newest_acknowledged_cuda_step(
        tmp_path: Path, shm_dir: Path) -> None:
    rng = random.Random(24)
    root = tmp_path / "root"
    acknowledged = 0
    for _kill in range(10):
        child = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_CUDA_CHILD), str(root), str(shm_dir),
             str(acknowledged + 1)], cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
            text=True)
        assert child.stdout is not None
        wanted = rng.randint(1, 6)
        seen = 0
        while seen < wanted:
            line = child.stdout.readline()
            assert line, "the child ended early"
            acknowledged = int(line)
            seen += 1
        child.send_signal(signal.SIGKILL)
        child.wait(60)
        live = {"w": torch.zeros(2048, 2048, device="cuda"),
                "m": torch.zeros(2048, 2048, device="cuda")}
        with cp.CheckpointPipeline(root, memory=cp.MemoryConfig(str(shm_dir),
                                                                disk_every=4)) as pipe:
            result = pipe.restore_latest(live)
        assert result is not None and result.step >= acknowledged
        gen = torch.Generator(device="cuda").manual_seed(result.step)
        assert torch.equal(live["w"], torch.randn(2048, 2048, device="cuda", generator=gen))
        assert torch.equal(live["m"], torch.randn(2048, 2048, device="cuda", generator=gen))
        acknowledged = result.step
