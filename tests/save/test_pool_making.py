"""A host buffer being made never holds the pool's lock: a save that asks meanwhile gets an
answer at once (with device staging it then starts without its buffer), whichever thread
makes it. The making is held at a gate (a slow allocation on demand), so that the order of
events is fixed, not timed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ckpt_pipeline._save.buffers import HostPool, Slot
from ckpt_pipeline._save.shm_pool import MemoryPool, slot_dir
from tests._support.gate import Gate, gated_buffer_making

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    with gated_buffer_making(monkeypatch) as g:
        yield g


def _acquire_in_thread(pool: HostPool | MemoryPool, nbytes: int) -> tuple[threading.Thread,
                                                                             list[Slot | None]]:
    got: list[Slot | None] = []
    thread = threading.Thread(
        target=lambda: got.append(pool.acquire(nbytes, pinned=False, block=True)), daemon=True)
    thread.start()
    return thread, got


def _answer_within(fn: Callable[[], Slot | None], seconds: float = 10.0) -> list[Slot | None]:
    """Run ``fn`` in a thread; its answer, or a failure if it is still waiting (on the lock)."""
    out: list[Slot | None] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "acquire waited while another thread made the buffers"
    return out


def _pool(kind: str, tmp_path: Path) -> HostPool | MemoryPool:
    """Two slots: host buffers, or the memory tier's (shared-memory files, not registered)."""
    if kind == "host":
        return HostPool(2)
    root = tmp_path / "memory"
    (root / slot_dir(0)).mkdir(parents=True)
    return MemoryPool(str(root), 0, 2)


@pytest.mark.parametrize("kind", ["host", "memory"])
def test_a_save_asking_while_a_buffer_is_made_is_answered_at_once(
        kind: str, tmp_path: Path, gate: Gate) -> None:
    pool = _pool(kind, tmp_path)
    try:
        maker, got = _acquire_in_thread(pool, 1 << 20)
        assert gate.entered.wait(10)
        # Another save meanwhile: without making, it is told there is none; a non-blocking
        # one that may make waits for no lock either.
        assert _answer_within(lambda: pool.acquire(1 << 20, pinned=False, block=False,
                                                   make=False)) == [None]
        gate.opened.set()
        maker.join(10)
        assert len(got) == 1 and got[0] is not None and got[0].buffer.numel() >= 1 << 20
        # the other slot is made too (in the background for the memory tier): a save that
        # may not make gets it once it is there
        second = pool.acquire(1 << 20, pinned=False, block=True, timeout=10)
        assert second is not None and second.index != got[0].index
        pool.release(second)
        pool.release(got[0])
    finally:
        pool.close()


def test_host_pool_reserve_makes_outside_the_lock(gate: Gate) -> None:
    pool = HostPool(1)
    maker = threading.Thread(target=pool.reserve, args=(1 << 20,), kwargs={"register": False},
                             daemon=True)
    maker.start()
    assert gate.entered.wait(10)
    assert _answer_within(lambda: pool.acquire(1 << 20, pinned=False, block=False,
                                               make=False)) == [None]
    waiting, got = _acquire_in_thread(pool, 1 << 20)  # a blocking save waits for the reserve
    gate.opened.set()
    maker.join(10)
    waiting.join(10)
    assert len(got) == 1 and got[0] is not None
    assert pool.allocated_bytes >= 1 << 20
    assert torch.count_nonzero(got[0].buffer) == 0
    pool.close()
