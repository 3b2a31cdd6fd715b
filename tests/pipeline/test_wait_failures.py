"""``wait()`` raises the first failure since the last ``wait()``, once, whenever it settled.

Step 4's write fails (an injected EIO on its first ``pwrite``), steps 5 and 6 succeed, and
``wait()`` is called at different moments: after step 4's failure settled, while step 4 is
still in flight (held by the storage's gate), or after the later saves. Every time, a
``wait()`` raises step 4's own error, and the next ``wait()`` raises nothing. Ordering comes
from handles, the gate and the event loop's own "every task is blocked", never from sleeps.
"""

from __future__ import annotations

import asyncio
import errno
import threading
from pathlib import Path

import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked

import ckpt_pipeline as cp
from ckpt_pipeline.testing import Fault, GatedStorage

pytestmark = pytest.mark.timeout(60)

FAIL_NEXT_WRITE = Fault("pwrite", 1, errno.EIO)
"""The first data write after arming fails: the save of the next step."""


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((32,), float(step))}


def _open(root: Path, **options: object) -> tuple[cp.CheckpointPipeline, GatedStorage]:
    storage = GatedStorage(root)
    storage.gate.set()  # saves go through, until a test closes the gate
    return cp.CheckpointPipeline(root, storage=storage, **options), storage


def _save_steps_1_to_3(pipe: cp.CheckpointPipeline) -> None:
    for step in (1, 2, 3):
        pipe.save(step, _state(step)).result(30)
    pipe.wait(30)  # nothing failed: returns, and leaves nothing to raise later


def test_wait_raises_a_failure_that_settled_before_it_was_called(root: Path) -> None:
    pipe, storage = _open(root)
    with pipe:
        _save_steps_1_to_3(pipe)
        storage.arm(FAIL_NEXT_WRITE)
        error = pipe.save(4, _state(4)).exception(30)  # settled: failed
        assert isinstance(error, cp.StorageError) and error.step == 4
        with pytest.raises(cp.StorageError) as info:
            pipe.wait(30)
        assert info.value is error
        pipe.wait(30)
        for step in (5, 6):
            pipe.save(step, _state(step)).result(30)
        pipe.wait(30)


def test_wait_after_later_saves_raises_the_earlier_failure(root: Path) -> None:
    pipe, storage = _open(root)
    with pipe:
        _save_steps_1_to_3(pipe)
        storage.arm(FAIL_NEXT_WRITE)
        failed = pipe.save(4, _state(4))
        later = [pipe.save(step, _state(step)) for step in (5, 6)]
        assert [h.result(30).step for h in later] == [5, 6]
        with pytest.raises(cp.StorageError) as info:
            pipe.wait(30)
        assert info.value is failed.exception(0) and info.value.step == 4
        pipe.wait(30)
        assert pipe.latest_step() == 6


def test_wait_while_the_failing_save_is_in_flight_raises_it_once_it_fails(root: Path) -> None:
    pipe, storage = _open(root)
    with pipe:
        _save_steps_1_to_3(pipe)
        storage.gate.clear()
        storage.entered.clear()
        storage.arm(FAIL_NEXT_WRITE)
        failed = pipe.save(4, _state(4))
        assert storage.entered.wait(30)  # step 4 is held before its shard exists
        with pytest.raises(TimeoutError, match="step 4"):
            pipe.wait(0.05)  # still pending (the gate is closed): not settled, not raised
        raised: list[BaseException] = []

        def waiter() -> None:
            try:
                pipe.wait(30)
            except cp.CheckpointError as exc:
                raised.append(exc)

        thread = threading.Thread(target=waiter)
        thread.start()
        storage.gate.set()
        thread.join(30)
        assert not thread.is_alive()
        assert raised == [failed.exception(0)] and raised[0].step == 4
        for step in (5, 6):
            pipe.save(step, _state(step)).result(30)
        pipe.wait(30)


def test_wait_raises_the_first_failure_by_step_and_forgets_the_rest(root: Path) -> None:
    pipe, storage = _open(root, max_failures_in_row=5)
    with pipe:
        _save_steps_1_to_3(pipe)
        storage.arm(Fault("pwrite", 1, errno.EIO), Fault("pwrite", 2, errno.ENOSPC))
        first, second = pipe.save(4, _state(4)), pipe.save(5, _state(5))
        assert second.exception(30) is not None and first.exception(30) is not None
        pipe.save(6, _state(6)).result(30)
        with pytest.raises(cp.StorageError) as info:
            pipe.wait(30)
        assert info.value is first.exception(0)
        pipe.wait(30)


def test_a_failure_raised_by_the_failure_policy_is_not_raised_again_by_wait(root: Path) -> None:
    pipe, storage = _open(root, max_failures_in_row=2)
    with pipe:
        _save_steps_1_to_3(pipe)
        for step in (4, 5):
            storage.arm(FAIL_NEXT_WRITE)
            assert pipe.save(step, _state(step)).exception(30) is not None
        with pytest.raises(cp.SaveError, match="2 saves in a row failed"):
            pipe.save(6, _state(6))
        pipe.wait(30)  # step 4 and 5 reached the caller through save(): nothing left
        pipe.save(6, _state(6)).result(30)
        pipe.wait(30)


def test_strict_wait_raises_the_failed_save_s_own_error_once(root: Path) -> None:
    pipe, storage = _open(root, strict=True)
    with pipe:
        _save_steps_1_to_3(pipe)
        storage.arm(FAIL_NEXT_WRITE)
        error = pipe.save(4, _state(4)).exception(30)
        with pytest.raises(cp.StorageError) as info:
            pipe.wait(30)
        assert info.value is error
        pipe.wait(30)
        pipe.save(5, _state(5)).result(30)  # reported: the next save is not refused


async def _save_async(pipe: cp.AsyncCheckpointPipeline, step: int) -> cp.SaveHandle:
    """Save ``step`` and wait for it to settle, off the event loop (the pipeline runs on it)."""
    handle = await pipe.save(step, _state(step))
    await anyio.to_thread.run_sync(handle.exception, 30)
    return handle


@pytest.mark.asyncio
async def test_async_wait_while_the_failing_save_is_in_flight_raises_it_once(
        root: Path) -> None:
    storage = GatedStorage(root)
    storage.gate.set()
    async with cp.AsyncCheckpointPipeline(root, storage=storage) as pipe:
        for step in (1, 2, 3):
            await _save_async(pipe, step)
        await pipe.wait(30)
        storage.gate.clear()
        storage.arm(FAIL_NEXT_WRITE)
        failed = await pipe.save(4, _state(4))
        waiter = asyncio.ensure_future(pipe.wait(30))
        await wait_all_tasks_blocked()  # the wait is blocked on step 4, which is held
        assert not waiter.done() and not failed.done()
        storage.gate.set()
        with pytest.raises(cp.StorageError) as info:
            await waiter
        assert info.value is failed.exception(0) and info.value.step == 4
        for step in (5, 6):
            assert (await _save_async(pipe, step)).exception(0) is None
        await pipe.wait(30)


@pytest.mark.asyncio
async def test_async_wait_raises_a_failure_that_settled_before_it_was_called(
        root: Path) -> None:
    storage = GatedStorage(root)
    storage.gate.set()
    async with cp.AsyncCheckpointPipeline(root, storage=storage) as pipe:
        await _save_async(pipe, 1)
        await pipe.wait(30)
        storage.arm(FAIL_NEXT_WRITE)
        error = (await _save_async(pipe, 4)).exception(0)
        assert isinstance(error, cp.StorageError)
        for step in (5, 6):
            assert (await _save_async(pipe, step)).exception(0) is None
        with pytest.raises(cp.StorageError) as info:
            await pipe.wait(30)
        assert info.value is error
        await pipe.wait(30)
