"""CUDA snapshot and restore on a real GPU (skipped without one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from tests._support.gate import gated_buffer_making
from tests._support.states import assert_same_state, make_training_state, train_one_step

pytestmark = pytest.mark.gpu


def _delay_caller_stream(ms: float = 200.0) -> None:
    """Keep the caller's stream busy so the side-stream copies start late (they wait on it)."""
    cycles = int(ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    torch.cuda._sleep(cycles)


def test_cuda_state_saves_and_restores_onto_its_device(root: Path) -> None:
    state = make_training_state(seed=1, device="cuda")
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, state, cp.TrainState(step=1)).result(60)
        assert pipe.host_memory_pinned
    fresh = make_training_state(seed=2, device="cuda")
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(fresh)
    assert result is not None and result.step == 1
    assert all(p.device.type == "cuda" for p in fresh["model"].parameters())
    for group in fresh["optimizer"].state.values():
        for value in group.values():
            if value.dim() > 0:
                assert value.device.type == "cuda"
    assert_same_state(state, fresh)


def test_plain_cuda_tensors_come_back_on_their_device_in_place(root: Path) -> None:
    src = torch.randn(1024, 1024, device="cuda")
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"t": src, "nested": {"ids": torch.arange(10, device="cuda")}}).result(60)
    live_t = torch.zeros(1024, 1024, device="cuda")
    live = {"t": live_t, "nested": {"ids": torch.zeros(10, dtype=torch.int64, device="cuda")}}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert live["t"] is live_t and live_t.device.type == "cuda"
    assert torch.equal(live_t, src)
    assert torch.equal(live["nested"]["ids"], torch.arange(10, device="cuda"))


def test_mutation_after_wait_snapshot_does_not_leak_into_the_checkpoint(root: Path) -> None:
    t = torch.full((4096, 4096), 1.0, device="cuda")  # 64 MiB
    with cp.CheckpointPipeline(root) as pipe:
        _delay_caller_stream()
        handle = pipe.save(1, {"t": t})
        pipe.wait_snapshot()  # the caller's stream now waits for the copies (GPU side)
        t.add_(1.0)  # queued after the copies on the GPU
        handle.result(60)
    live = {"t": torch.zeros(4096, 4096, device="cuda")}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert torch.equal(live["t"], torch.full((4096, 4096), 1.0, device="cuda"))
    assert torch.equal(t, torch.full((4096, 4096), 2.0, device="cuda"))


def test_mutation_before_wait_snapshot_fails_the_save_instead_of_writing_it(root: Path) -> None:
    t = torch.full((4096, 4096), 1.0, device="cuda")
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root) as pipe:
        pipe.subscribe(events.append)
        _delay_caller_stream()
        handle = pipe.save(1, {"t": t})
        t.add_(1.0)  # in place, while the copy has not started yet
        pipe.wait_snapshot()
        with pytest.raises(cp.SnapshotTornError, match="wait_snapshot"):
            handle.result(60)
    assert [e.step for e in events if isinstance(e, cp.SaveFailed)] == [1]
    assert not any(p.name.startswith("step-") for p in root.iterdir())


def test_ordered_mode_needs_no_wait_snapshot(root: Path) -> None:
    t = torch.full((4096, 4096), 1.0, device="cuda")
    with cp.CheckpointPipeline(root, snapshot_mode="ordered") as pipe:
        _delay_caller_stream()
        handle = pipe.save(1, {"t": t})
        t.add_(1.0)  # the caller's stream already waits for the copies
        handle.result(60)
    live = {"t": torch.zeros(4096, 4096, device="cuda")}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert torch.equal(live["t"], torch.full((4096, 4096), 1.0, device="cuda"))


def test_save_returns_before_the_copies_finish(root: Path) -> None:
    t = torch.full((4096, 4096), 3.0, device="cuda")
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"t": t}).result(60)  # allocate the pinned pool first
        _delay_caller_stream(500.0)
        handle = pipe.save(2, {"t": t})
        assert not handle.done(), "save() did not wait for the GPU"
        pipe.wait_snapshot()
        handle.result(60)


def test_pinned_pool_stays_flat_across_saves(root: Path) -> None:
    state = {"t": torch.randn(1024, 1024, device="cuda")}
    with cp.CheckpointPipeline(root, keep_last=1) as pipe:
        pipe.save(1, state).result(60)
        first = pipe.host_memory_bytes
        for step in range(2, 52):  # 50 saves after the first
            pipe.save(step, state)
            pipe.wait_snapshot()
        pipe.wait(60)
        assert pipe.host_memory_bytes == first
        assert pipe.host_memory_pinned


def test_a_cuda_state_larger_than_the_host_buffer_is_streamed(root: Path) -> None:
    """64 MiB through an 8 MiB pinned buffer; updates after wait_snapshot stay out of it."""
    t = torch.randn(4096, 4096, device="cuda")
    ids = torch.arange(1_000_003, device="cuda")
    on_cpu = torch.randn(300_000)
    expected = {"t": t.clone(), "ids": ids.clone(), "on_cpu": on_cpu.clone()}
    mib = 1 << 20
    with cp.CheckpointPipeline(root, host_buffer_bytes=8 * mib, chunk_bytes=mib) as pipe:
        _delay_caller_stream()
        handle = pipe.save(1, {"t": t, "ids": ids, "on_cpu": on_cpu})
        pipe.wait_snapshot()  # blocks until the last piece's copy is queued
        t.add_(1.0)  # queued after the copies on the GPU
        ids.add_(1)
        on_cpu.add_(1.0)
        handle.result(60)
        assert pipe.host_memory_bytes == 8 * mib and pipe.host_memory_pinned
    live = {"t": torch.zeros_like(t), "ids": torch.zeros_like(ids),
            "on_cpu": torch.zeros_like(on_cpu)}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    for key, value in expected.items():
        assert torch.equal(live[key], value), key


def test_streamed_training_restores_bit_exact(root: Path) -> None:
    state = make_training_state(seed=3, device="cuda")
    with cp.CheckpointPipeline(root, host_buffer_bytes=8192, chunk_bytes=4096) as pipe:
        for step in range(1, 6):
            train_one_step(state, seed=step)
            pipe.save(step, state, cp.TrainState(step=step))
            pipe.wait_snapshot()
        pipe.wait(60)
    fresh = make_training_state(seed=4, device="cuda")
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(fresh)
    assert result is not None and result.step == 5
    assert_same_state(state, fresh)


def test_device_staging_lets_the_update_wait_only_for_a_device_copy(root: Path) -> None:
    t = torch.randn(4096, 4096, device="cuda")  # 64 MiB
    expected = t.clone()
    with cp.CheckpointPipeline(root, device_staging=True, keep_last=1) as pipe:
        pipe.save(1, {"t": t}).result(60)
        staged = pipe.device_memory_bytes
        assert staged >= t.numel() * 4
        for step in range(2, 12):
            _delay_caller_stream(50.0)
            handle = pipe.save(step, {"t": t})
            pipe.wait_snapshot()
            if step == 11:
                t.add_(1.0)  # queued after the device copy: the checkpoint keeps the old bytes
            handle.result(60)
        assert pipe.device_memory_bytes == staged  # allocated once
    live = {"t": torch.zeros_like(t)}
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(live)
    assert result is not None and result.step == 11
    assert torch.equal(live["t"], expected)


def test_a_first_save_with_device_staging_does_not_wait_for_its_host_buffer(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host buffers are still being made (held at a gate) when the first save comes: it
    copies to the staging buffer and returns; an update after wait_snapshot() does not reach
    the checkpoint, which is written once the buffer exists."""
    t = torch.full((2048, 2048), 1.0, device="cuda")
    c = torch.arange(16)
    with gated_buffer_making(monkeypatch) as gate, \
            cp.CheckpointPipeline(root, device_staging=True) as pipe:
        handle = pipe.save(1, {"t": t, "c": c})
        pipe.wait_snapshot()
        assert pipe.host_memory_bytes == 0  # save() returned with no host buffer made yet
        t.add_(1.0)
        c.add_(1)
        assert gate.entered.wait(30)  # the pipeline is making it
        assert not handle.done()
        gate.opened.set()
        handle.result(60)
        assert pipe.host_memory_bytes > 0
    live = {"t": torch.zeros_like(t), "c": torch.zeros_like(c)}
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(live)
    assert result is not None and result.step == 1
    assert torch.equal(live["t"], torch.full_like(t, 1.0))
    assert torch.equal(live["c"], torch.arange(16))


def test_a_fresh_jobs_first_save_stages_on_the_gpu_until_its_host_buffer_is_made(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (device_staging=None): the first save finds no host buffer made, copies to
    a transient staging buffer and returns; the buffer is freed once its host copies are
    queued, and the next save, its host buffer made, copies straight to the host."""
    t = torch.full((2048, 2048), 1.0, device="cuda")  # 16 MiB
    with gated_buffer_making(monkeypatch) as gate, cp.CheckpointPipeline(root) as pipe:
        handle = pipe.save(1, {"t": t})
        pipe.wait_snapshot()
        assert pipe.host_memory_bytes == 0  # save() returned with no host buffer made yet
        assert pipe.device_memory_bytes >= t.numel() * 4  # the bridge holds the bytes
        t.add_(1.0)  # after wait_snapshot(): not in step 1
        assert gate.entered.wait(30)
        assert not handle.done()
        gate.opened.set()
        handle.result(60)
        assert pipe.host_memory_bytes > 0
        assert pipe.device_memory_bytes == 0  # freed
        handle = pipe.save(2, {"t": t})
        assert pipe.device_memory_bytes == 0  # a host buffer is made: no staging
        pipe.wait_snapshot()
        handle.result(60)
    for step, value in ((1, 1.0), (2, 2.0)):
        loaded = cp.load(root, step=step, map_location="cuda")
        assert torch.equal(loaded.tree["t"], torch.full_like(t, value)), step


@pytest.mark.parametrize("case", ["no_room", "never"])
def test_a_first_save_without_staging_waits_for_its_host_buffer(
        root: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """No room on the GPU beside the state (a fake free-memory figure: a full GPU cannot be
    had on demand), or device_staging=False: save() makes the host buffer itself, and no
    GPU memory is taken."""
    t = torch.randn(2048, 2048, device="cuda")
    asked: list[int] = []
    real = torch.cuda.mem_get_info

    def nearly_full(device: torch.device | int | None = None) -> tuple[int, int]:
        free, total = real(device)
        asked.append(free)
        return total // 20, total  # 5% free: under the tenth the bridge leaves

    monkeypatch.setattr(torch.cuda, "mem_get_info", nearly_full)
    staging = False if case == "never" else None
    with cp.CheckpointPipeline(root, device_staging=staging) as pipe:
        handle = pipe.save(1, {"t": t})
        assert pipe.host_memory_bytes > 0  # made by save() itself
        assert pipe.device_memory_bytes == 0
        pipe.wait_snapshot()
        handle.result(60)
    assert bool(asked) == (case == "no_room")
    assert torch.equal(cp.load(root, step=1, map_location="cuda").tree["t"], t)


def test_device_staging_that_does_not_fit_copies_straight_to_the_host(root: Path) -> None:
    t = torch.randn(8192, 8192, device="cuda")  # 256 MiB
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    allowed = (torch.cuda.memory_reserved() + (64 << 20)) / total  # no room for a copy
    torch.cuda.set_per_process_memory_fraction(allowed)
    try:
        with cp.CheckpointPipeline(root, device_staging=True) as pipe:
            handle = pipe.save(1, {"t": t})
            pipe.wait_snapshot()
            handle.result(60)
            assert pipe.device_memory_bytes == 0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    live = {"t": torch.zeros_like(t)}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert torch.equal(live["t"], t)


def test_device_staging_with_training_restores_bit_exact(root: Path) -> None:
    state = make_training_state(seed=5, device="cuda")
    with cp.CheckpointPipeline(root, device_staging=True) as pipe:
        for step in range(1, 4):
            train_one_step(state, seed=step)
            pipe.save(step, state, cp.TrainState(step=step))
            pipe.wait_snapshot()
        pipe.wait(60)
    fresh = make_training_state(seed=6, device="cuda")
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest(fresh)
    assert result is not None and result.step == 3
    assert_same_state(state, fresh)


def test_device_staging_with_two_buffers_keeps_every_save_exact(root: Path) -> None:
    """Two saves in flight share one staging buffer: the second waits until the first's host
    copies are queued, so neither sees the other's bytes."""
    t = torch.zeros(2048, 2048, device="cuda")
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root, device_staging=True, buffer_slots=2, keep_last=8) as pipe:
        pipe.subscribe(events.append)
        handles = []
        for step in range(1, 9):
            t.fill_(float(step))
            handles.append(pipe.save(step, {"t": t}))
            pipe.wait_snapshot()
        for handle in handles:
            handle.result(60)
    for step in range(8, 0, -1):  # each save holds its own bytes: restore, then hide it
        live = {"t": torch.empty_like(t)}
        with cp.CheckpointPipeline(root) as pipe:
            result = pipe.restore_latest(live)
        assert result is not None and result.step == step
        assert torch.equal(live["t"], torch.full_like(t, float(step))), step
        (root / f"step-{step:010d}").rename(root.parent / f"hidden-{step}")
    assert not [e for e in events if isinstance(e, cp.SaveFailed)]


def test_cuda_views_and_tied_weights_are_written_once_and_come_back_aliased(root: Path) -> None:
    base = torch.arange(4096, dtype=torch.float32, device="cuda")
    model = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 512)).cuda()
    model[1].weight = model[0].weight
    state = {"model": model, "d": {"base": base, "view": base[100:900], "t": base.view(64, 64).t(),
                                   "step": torch.tensor(3.0), "small": torch.ones(3, device="cuda")}}
    for options in ({}, {"device_staging": True}, {"host_buffer_bytes": 1 << 20,
                                                   "chunk_bytes": 256 * 1024}):
        target = root / str(len(list(root.iterdir())) if root.exists() else 0)
        with cp.CheckpointPipeline(target, **options) as pipe:
            pipe.save(1, state).result(60)
            pipe.wait_snapshot()
        shard = target / "step-0000000001" / "rank-00000.shard"
        unique = (512 * 64 + 512 + 4096 + 3) * 4 + 4
        with open(shard, "rb") as f:
            header = int.from_bytes(f.read(40)[24:32], "little")
        assert shard.stat().st_size <= unique + header + 64 + 4096, options
        fresh = torch.nn.Sequential(torch.nn.Embedding(512, 64),
                                    torch.nn.Linear(64, 512)).cuda()
        fresh[1].weight = fresh[0].weight
        live = {"model": fresh, "d": {}}
        with cp.CheckpointPipeline(target) as pipe:
            assert pipe.restore_latest(live) is not None
        assert fresh[1].weight is fresh[0].weight
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            assert torch.equal(a, b)
        got = live["d"]
        for key, value in state["d"].items():
            assert torch.equal(got[key], value), (key, options)
            assert got[key].device == value.device, key
        assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
        got["base"][100] = -1.0
        assert got["view"][0].item() == -1.0


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_pinned_host_buffers_are_registered_mappings_that_close_cleanly() -> None:
    """The pool's pinned slots are page-locked mappings of the slot's size (not torch's
    power-of-2 pinned blocks): copies land in them asynchronously and bit-exact, a forked
    child runs without them, and the pool's close unregisters before it unmaps (a pinned
    allocation afterwards still works)."""
    import os

    from ckpt_pipeline._format.region import align_up
    from ckpt_pipeline._save.buffers import HostPool

    nbytes = 40_000_000
    pool = HostPool(2)
    slot = pool.acquire(nbytes, pinned=True, block=True)
    assert slot is not None and pool.pinned
    assert slot.buffer.is_pinned() and slot.buffer.numel() == align_up(nbytes)
    assert pool.allocated_bytes == 2 * align_up(nbytes)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        slot.buffer[:nbytes].copy_(src, non_blocking=True)
    stream.synchronize()
    assert torch.equal(slot.buffer[:nbytes], src.cpu())
    start = f"{slot.buffer.data_ptr():x}-"
    pid = os.fork()
    if pid == 0:  # the child reads a file and exits (safe in a threaded parent): is the
        # buffer mapped here?
        with open("/proc/self/maps") as maps:
            inherited = any(line.startswith(start) for line in maps)
        os._exit(1 if inherited else 0)
    assert os.waitpid(pid, 0)[1] == 0, "a forked child inherited the pinned buffer"
    pool.release(slot)
    del slot
    pool.close()
    assert pool.allocated_bytes == 0
    after = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    assert after.is_pinned()
