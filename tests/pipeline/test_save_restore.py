"""Saving and restoring through the synchronous pipeline, on CPU."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from tests._support.states import assert_same_state, make_training_state, train_one_step


def test_restore_returns_none_when_root_is_empty(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        assert pipe.restore_latest(make_training_state()) is None
        assert pipe.latest_step() is None


def test_restore_loads_model_optimizer_and_scheduler_bit_exact(root: Path) -> None:
    state = make_training_state(seed=1)
    with cp.CheckpointPipeline(root) as pipe:
        info = pipe.save(10, state, cp.TrainState(step=10)).result(30)
    assert info.step == 10 and info.bytes > 0 and info.seconds > 0
    fresh = make_training_state(seed=2)
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(fresh)
    assert result is not None and result.step == 10
    assert_same_state(state, fresh)


def test_restored_training_continues_identically(root: Path) -> None:
    state = make_training_state(seed=3)
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, state, cp.TrainState(step=1)).result(30)
    train_one_step(state, seed=99)
    resumed = make_training_state(seed=4)
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(resumed)
    train_one_step(resumed, seed=99)
    assert_same_state(state, resumed)


def test_nested_tensors_and_plain_values_are_restored_in_place(root: Path) -> None:
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {
        "buffers": {"w": weights, "ids": [torch.tensor([1, 2, 3]), torch.ones(2, dtype=torch.bool)]},
        "meta": {"name": "run-a", "lr": 0.5, "tags": ("x", 1), "blob": b"\x00\x01", "none": None},
        "empty": torch.empty(0, 5, dtype=torch.bfloat16),
    }
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(5, state).result(30)
    live_w = torch.zeros(3, 4)
    live = {
        "buffers": {"w": live_w, "ids": [torch.zeros(3, dtype=torch.int64),
                                         torch.zeros(2, dtype=torch.bool)]},
        "meta": {"name": "", "lr": 0.0, "tags": (), "blob": b"", "none": 1},
        "empty": torch.empty(0, 5, dtype=torch.bfloat16),
    }
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert live["buffers"]["w"] is live_w, "tensors are loaded in place"
    assert torch.equal(live_w, weights)
    assert torch.equal(live["buffers"]["ids"][0], torch.tensor([1, 2, 3]))
    assert live["buffers"]["ids"][1].all()
    assert live["meta"] == state["meta"]
    assert isinstance(live["meta"]["tags"], tuple)


def test_cpu_tensor_mutated_right_after_save_keeps_saved_values(root: Path) -> None:
    t = torch.full((256, 256), 1.0)
    with cp.CheckpointPipeline(root) as pipe:
        handle = pipe.save(1, {"t": t})
        t.fill_(2.0)  # before the pipeline has written anything
        handle.result(30)
    live = {"t": torch.zeros(256, 256)}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert torch.equal(live["t"], torch.full((256, 256), 1.0))


def test_train_state_round_trips_with_extra_fields(root: Path) -> None:
    ts = cp.TrainState(step=7, consumed_train_samples=7 * 32, skipped_train_samples=3,
                       floating_point_operations_so_far=1.5e15,
                       extra={"epoch": 2, "data": {"shard": "a", "offset": 17}})
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(7, {"x": torch.ones(3)}, ts).result(30)
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest({"x": torch.zeros(3)})
    assert result is not None
    got = result.train_state
    assert (got.step, got.consumed_train_samples, got.skipped_train_samples) == (7, 224, 3)
    assert got.floating_point_operations_so_far == 1.5e15
    assert got.extra == {"epoch": 2, "data": {"shard": "a", "offset": 17}}
    assert got.rng is not None


def test_rng_streams_continue_after_restore(root: Path) -> None:
    import numpy as np

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"x": torch.ones(1)}).result(30)
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest({"x": torch.zeros(1)})
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2])


def test_restore_rng_can_be_turned_off(root: Path) -> None:
    torch.manual_seed(1)
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"x": torch.ones(1)}).result(30)
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    with cp.CheckpointPipeline(root, restore_rng=False) as pipe:
        pipe.restore_latest({"x": torch.zeros(1)})
    assert torch.equal(torch.rand(2), expected)


def test_retention_keeps_the_newest_keep_last_steps(root: Path) -> None:
    pruned: list[int] = []
    with cp.CheckpointPipeline(root, keep_last=2) as pipe:
        pipe.subscribe(lambda e: pruned.append(e.step)
                       if isinstance(e, cp.CheckpointPruned) else None)
        for step in range(1, 6):
            pipe.save(step, {"x": torch.full((4,), float(step))}).result(30)
        pipe.wait()
    assert sorted(n for n in os.listdir(root) if not n.startswith(".lock-")) == ["step-0000000004", "step-0000000005"]
    assert sorted(pruned) == [1, 2, 3]


def test_wait_returns_after_retention_has_pruned(root: Path) -> None:
    with cp.CheckpointPipeline(root, keep_last=1) as pipe:
        for step in (1, 2, 3):
            pipe.save(step, {"x": torch.full((4,), float(step))})
        pipe.wait(60)
        assert sorted(n for n in os.listdir(root) if not n.startswith(".lock-")) == ["step-0000000003"]
        assert pipe.pending_steps() == []


def test_latest_step_follows_commits(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(3, {"x": torch.ones(1)}).result(30)
        assert pipe.latest_step() == 3
    with cp.CheckpointPipeline(root) as pipe:
        assert pipe.latest_step() == 3


def test_wait_returns_after_every_pending_save_committed(root: Path) -> None:
    with cp.CheckpointPipeline(root, buffer_slots=2) as pipe:
        handles = [pipe.save(s, {"x": torch.full((1000,), float(s))}) for s in (1, 2, 3)]
        pipe.wait(timeout=60)
        assert all(h.done() for h in handles)
        assert pipe.pending_steps() == []
        assert [h.result().step for h in handles] == [1, 2, 3]


def test_close_finishes_pending_saves(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        handle = pipe.save(1, {"x": torch.ones(10_000)})
    assert handle.done() and handle.result().step == 1


def test_host_buffer_is_allocated_once_and_reused(root: Path) -> None:
    state = {"x": torch.ones(100_000)}
    with cp.CheckpointPipeline(root, keep_last=1) as pipe:
        pipe.save(1, state).result(30)
        first = pipe.host_memory_bytes
        for step in range(2, 12):
            pipe.save(step, state).result(30)
        assert pipe.host_memory_bytes == first
    assert first >= 400_000
    assert first < 2 * 400_000 + 8192, "one slot, sized to the state"


def test_committed_files_are_private(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        info = pipe.save(1, {"x": torch.ones(4)}).result(30)
    assert os.stat(root).st_mode & 0o777 == 0o700
    assert os.stat(info.path).st_mode & 0o777 == 0o700
    for name in os.listdir(info.path):
        assert os.stat(os.path.join(info.path, name)).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int8,
                                   torch.uint8, torch.int32, torch.complex64, torch.bool])
def test_every_allowed_dtype_round_trips(root: Path, dtype: torch.dtype) -> None:
    src = (torch.arange(24) % 7).to(dtype).reshape(2, 3, 4)
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"t": src}).result(30)
    live = {"t": torch.zeros(2, 3, 4, dtype=dtype)}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert torch.equal(live["t"], src)


def test_non_contiguous_tensor_is_saved_by_value(root: Path) -> None:
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"t": base.t()}).result(30)
    live = {"t": torch.zeros(5, 4)}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert torch.equal(live["t"], base.t())


def test_chunked_checksums_cover_tensors_larger_than_a_chunk(root: Path) -> None:
    big = torch.randn(3 * 4096 + 5)  # about 12 chunks of 4 KiB
    with cp.CheckpointPipeline(root, chunk_bytes=4096) as pipe:
        pipe.save(1, {"big": big}).result(30)
    live = {"big": torch.zeros_like(big)}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert torch.equal(live["big"], big)


def test_shards_are_checksummed_in_blocks_of_4_mib_whatever_the_write_chunk(root: Path) -> None:
    """Writes go in chunks of ``chunk_bytes``; each chunk's 4 MiB blocks get a checksum each,
    so that a range read verifies at most 4 MiB beyond each end (docs/format.md). The blocks
    verify, and a restore reads the shard back."""
    from ckpt_pipeline._format.region import checksum
    from ckpt_pipeline._format.scan import scan

    big = torch.randn(5 * 1024 * 1024)  # 20 MiB and the preamble: six blocks
    with cp.CheckpointPipeline(root, io_threads=1) as pipe:  # written in chunks of 8 MiB
        pipe.save(1, {"big": big}).result(60)
    (status,) = scan(cp.LocalStorage(root), 0)
    assert status.valid and status.header is not None
    checks = status.header.checks()
    assert status.header.chunk_bytes == 4 * 1024 * 1024 and len(checks) == 6
    with open(os.path.join(status.path, status.shard_file or "rank-00000.shard"), "rb") as f:
        for start, end, expected in checks:
            f.seek(start)
            assert checksum(f.read(end - start)) == expected
    live = {"big": torch.zeros_like(big)}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert torch.equal(live["big"], big)
