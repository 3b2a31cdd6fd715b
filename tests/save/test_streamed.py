"""States larger than the host buffer: copied a piece at a time, each piece written meanwhile."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.shard import PREAMBLE_SIZE, decode_preamble
from ckpt_pipeline.storage import LocalStorage
from ckpt_pipeline.testing import Fault, FaultyStorage

KiB = 1024
CHUNK = 64 * KiB
CAP = 256 * KiB  # four chunks: the states below are 10 to 40 times larger


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1000, 1000, generator=g),          # 4 MB: many pieces
            "b": torch.randn(333, generator=g),                 # a small tensor between
            "ids": torch.randint(0, 1 << 40, (50_001,), generator=g),
            "empty": torch.zeros(0),
            "flags": torch.rand(70_000, generator=g) > 0.5}


def _zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _restore(root: Path, like: dict[str, torch.Tensor]) -> tuple[int | None,
                                                                  dict[str, torch.Tensor]]:
    live = _zeros_like(like)
    with cp.CheckpointPipeline(root, restore_rng=False) as pipe:
        result = pipe.restore_latest(live)
    return (None if result is None else result.step), live


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class SlowStorage(LocalStorage):
    """Real storage whose writes take a little longer: the stream is surely still running."""

    def __init__(self, root: Path, delay_s: float) -> None:
        super().__init__(root)
        self.delay_s = delay_s
        self.writes = 0

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        time.sleep(self.delay_s)
        self.writes += 1
        super().pwrite(fd, data, offset)


def test_a_state_larger_than_the_buffer_round_trips_with_the_same_bytes(tmp_path: Path) -> None:
    state = _state(1)
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(tmp_path / "streamed", host_buffer_bytes=CAP,
                               chunk_bytes=CHUNK) as pipe:
        pipe.subscribe(events.append)
        handle = pipe.save(1, state)
        pipe.wait_snapshot()
        info = handle.result(60)
        assert pipe.host_memory_bytes == CAP  # never the state's 4.8 MB
    with cp.CheckpointPipeline(tmp_path / "whole", chunk_bytes=CHUNK) as pipe:
        pipe.save(1, state).result(60)
    streamed = (tmp_path / "streamed" / "step-0000000001" / "rank-00000.shard").read_bytes()
    whole = (tmp_path / "whole" / "step-0000000001" / "rank-00000.shard").read_bytes()
    assert info.bytes == len(streamed) == len(whole)
    _, header_at, _, _ = decode_preamble(whole, len(whole), "whole")
    assert decode_preamble(streamed, len(streamed), "streamed")[1] == header_at
    # Same layout, same bytes (the headers differ only in their timestamps).
    assert streamed[PREAMBLE_SIZE:header_at] == whole[PREAMBLE_SIZE:header_at]
    step, live = _restore(tmp_path / "streamed", state)
    assert step == 1 and _same(live, state)
    kinds = [type(e).__name__ for e in events if e.step == 1]
    assert kinds.index("SnapshotTaken") < kinds.index("ShardSealed")


def test_wait_snapshot_returns_once_every_piece_is_copied(tmp_path: Path) -> None:
    """After wait_snapshot the caller may update in place: the checkpoint keeps the old bytes."""
    storage = SlowStorage(tmp_path / "ckpt", delay_s=0.005)
    state = _state(2)
    expected = {k: v.clone() for k, v in state.items()}
    with cp.CheckpointPipeline(storage.root, storage=storage, host_buffer_bytes=CAP,
                               chunk_bytes=CHUNK) as pipe:
        handle = pipe.save(1, state)
        pipe.wait_snapshot()
        assert not handle.done()  # the last pieces are still being written
        for value in state.values():
            if value.dtype == torch.bool:
                value.logical_not_()
            else:
                value.add_(1)
        handle.result(60)
    step, live = _restore(storage.root, expected)
    assert step == 1 and _same(live, expected)


@pytest.mark.slow
def test_an_update_before_wait_snapshot_fails_that_save_as_torn(tmp_path: Path) -> None:
    storage = SlowStorage(tmp_path / "ckpt", delay_s=0.01)
    state = _state(3)
    with cp.CheckpointPipeline(storage.root, storage=storage, host_buffer_bytes=CAP,
                               chunk_bytes=CHUNK) as pipe:
        pipe.save(1, state).result(60)
        handle = pipe.save(2, state)
        state["w"].mul_(2)  # the stream is still copying: the protocol is broken
        pipe.wait_snapshot()
        with pytest.raises(cp.SnapshotTornError) as info:
            handle.result(60)
        assert info.value.step == 2 and "w" in str(info.value)
    assert not list(storage.root.rglob(".*tmp-*"))
    step, _ = _restore(storage.root, state)
    assert step == 1


def test_a_write_error_mid_stream_fails_cleanly_and_never_blocks_the_caller(
        tmp_path: Path) -> None:
    storage = FaultyStorage(tmp_path / "ckpt")
    first, second = _state(4), _state(5)
    with cp.CheckpointPipeline(storage.root, storage=storage, host_buffer_bytes=CAP,
                               chunk_bytes=CHUNK) as pipe:
        pipe.save(1, first).result(60)
        storage.arm(Fault("pwrite", at=20, errno=errno.EIO))
        handle = pipe.save(2, second)
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (pipe.wait_snapshot(), done.set()))
        waiter.start()
        waiter.join(30)
        assert done.is_set(), "wait_snapshot hung after the stream failed"
        with pytest.raises(cp.StorageError) as info:
            handle.result(60)
        assert info.value.errno == errno.EIO and info.value.step == 2
        storage.disarm()
        pipe.save(3, second).result(60)  # the buffer was given back
    assert storage.fired
    assert not list(storage.root.rglob(".*tmp-*"))
    step, live = _restore(storage.root, second)
    assert step == 3 and _same(live, second)


def test_saves_in_a_row_reuse_one_capped_buffer(tmp_path: Path) -> None:
    with cp.CheckpointPipeline(tmp_path / "ckpt", host_buffer_bytes=CAP, chunk_bytes=CHUNK,
                               keep_last=2) as pipe:
        for step in range(1, 6):
            state = _state(10 + step)
            pipe.save(step, state)
            pipe.wait_snapshot()
        pipe.wait(60)
        assert pipe.host_memory_bytes == CAP
    step, live = _restore(tmp_path / "ckpt", _state(15))
    assert step == 5 and _same(live, _state(15))


def test_a_small_state_under_the_cap_is_not_streamed(tmp_path: Path) -> None:
    small = {"x": torch.arange(1000.0)}
    with cp.CheckpointPipeline(tmp_path / "ckpt", host_buffer_bytes=CAP,
                               chunk_bytes=CHUNK) as pipe:
        pipe.save(1, small).result(60)
        assert pipe.host_memory_bytes == 4096  # sized to the state, below the cap


def test_a_non_contiguous_tensor_cannot_be_streamed(tmp_path: Path) -> None:
    state = {"t": torch.randn(1000, 1000).t()}
    with cp.CheckpointPipeline(tmp_path / "ckpt", host_buffer_bytes=CAP,
                               chunk_bytes=CHUNK) as pipe:
        with pytest.raises(cp.StateError, match="not contiguous") as info:
            pipe.save(1, state)
        assert info.value.path == "t"
        pipe.save(1, {"t": state["t"].contiguous()}).result(60)


@pytest.mark.parametrize("options", [
    {"host_buffer_bytes": 64 * KiB, "chunk_bytes": 64 * KiB},   # less than two chunks
    {"host_buffer_bytes": 300_000},                             # not a multiple of 4096
    {"host_buffer_bytes": 1 << 30, "snapshot_mode": "ordered"},
])
def test_invalid_buffer_caps_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(cp.ConfigError):
        cp.PipelineConfig(**options)  # type: ignore[arg-type]
