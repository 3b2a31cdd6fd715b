"""AsyncCheckpointPipeline inside the test's own event loop (pytest-asyncio)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import GatedStorage
from tests._support.states import assert_same_state, make_training_state


@pytest.mark.asyncio
async def test_async_pipeline_saves_and_restores_in_the_callers_loop(root: Path) -> None:
    state = make_training_state(seed=5)
    loop = asyncio.get_running_loop()
    async with cp.AsyncCheckpointPipeline(root, keep_last=2) as pipe:
        handles = []
        for step in (1, 2, 3):
            handles.append(await pipe.save(step, state, cp.TrainState(step=step)))
            await pipe.wait_snapshot()
        await pipe.wait(timeout=30)
        assert [h.result(0).step for h in handles] == [1, 2, 3]
        assert await pipe.latest_step() == 3
        assert asyncio.get_running_loop() is loop
    fresh = make_training_state(seed=6)
    async with cp.AsyncCheckpointPipeline(root) as pipe:
        result = await pipe.restore_latest(fresh)
    assert result is not None and result.step == 3
    assert_same_state(state, fresh)


@pytest.mark.asyncio
async def test_event_loop_stays_responsive_while_a_save_is_written(root: Path) -> None:
    storage = GatedStorage(root)
    async with cp.AsyncCheckpointPipeline(root, storage=storage) as pipe:
        handle = await pipe.save(1, {"x": torch.ones(1000)})
        # the write is held in a worker thread; the loop still runs other tasks
        ticks = 0
        assert await asyncio.to_thread(storage.entered.wait, 30)
        for _ in range(100):
            await asyncio.sleep(0)
            ticks += 1
        assert ticks == 100 and not handle.done()
        storage.gate.set()
        await pipe.wait(timeout=30)
        assert handle.result(0).step == 1


@pytest.mark.asyncio
async def test_async_save_after_close_is_refused(root: Path) -> None:
    pipe = cp.AsyncCheckpointPipeline(root)
    async with pipe:
        pass
    with pytest.raises(cp.PipelineClosedError):
        await pipe.save(1, {"x": torch.ones(1)})


@pytest.mark.asyncio
async def test_async_skip_policy_does_not_block_the_loop(root: Path) -> None:
    storage = GatedStorage(root)
    async with cp.AsyncCheckpointPipeline(root, storage=storage, when_busy="skip") as pipe:
        first = await pipe.save(1, {"x": torch.ones(10)})
        assert await asyncio.to_thread(storage.entered.wait, 30)
        skipped = await pipe.save(2, {"x": torch.ones(10)})
        with pytest.raises(cp.PoolBusyError):
            skipped.result(0)
        storage.gate.set()
        await pipe.wait(timeout=30)
        assert first.result(0).step == 1
