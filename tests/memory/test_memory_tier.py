"""The memory tier on one process: commits in shared memory, every K-th save written through
to disk, the flush and clean-up at close, a stalled disk, shared memory that is too small or
fills up, shared memory wiped (a reboot), and its configuration."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.region import align_up
from ckpt_pipeline.testing import GatedStorage
from tests._support.children import REPO, child_env
from tests._support.logs import watching

pytestmark = pytest.mark.timeout(120)



def _state(step: int) -> dict[str, torch.Tensor]:
    """A state whose every byte is a function of the step."""
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=gen), "b": torch.arange(step, step + 100)}


def _blank() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(256, 64), "b": torch.zeros(100, dtype=torch.int64)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_saves_commit_in_memory_and_every_kth_is_written_through(tmp_path: Path,
                                                                  shm_dir: Path) -> None:
    events: list[cp.Event] = []
    durable: list[bool] = []
    with cp.CheckpointPipeline(tmp_path / "root", keep_last=10,
                               memory=cp.MemoryConfig(str(shm_dir), disk_every=2)) as pipe:
        pipe.subscribe(events.append)
        for step in range(1, 7):
            handle = pipe.save(step, _state(step))
            info = handle.result(30)
            assert info.tier == "memory" and info.path.startswith(str(shm_dir))
            disk = handle.durable(30)
            durable.append(disk is not None)
            if disk is not None:
                assert disk.tier == "disk" and disk.path.startswith(str(tmp_path / "root"))
            # the write-through counts as running until its retain stage is done: without
            # this wait, a loaded machine may see the next due step skipped (as designed)
            pipe.wait(30)
        assert repr(handle).endswith("committed in memory)")
    assert durable == [True, False, True, False, True, False]  # the 1st, then every 2nd
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("MemoryCommitted") == 6
    assert kinds.count("CheckpointCommitted") == 4  # 1, 3, 5 and the flush of 6 at close
    assert not shm_dir.exists()  # removed at a clean close once the newest step is on disk
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "root").glob("step-*"))
        assert steps == [1, 3, 5, 6]
        live = _blank()
        result = pipe.restore_latest(live)
        assert result is not None and result.step == 6 and result.from_memory == ()
        assert _equal(live, _state(6))


def test_memory_retention_keeps_the_newest_and_frees_the_others(tmp_path: Path,
                                                                 shm_dir: Path) -> None:
    config = cp.MemoryConfig(str(shm_dir), slots=4, keep=2, disk_every=100, keep_files=True)
    with cp.CheckpointPipeline(tmp_path / "root", memory=config) as pipe:
        for step in range(1, 6):
            pipe.save(step, _state(step)).result(30)
        pipe.wait(30)  # retention runs after the commit
        held = sorted(p.name for p in shm_dir.glob("step-*"))
        assert held == ["step-0000000004", "step-0000000005"]
        assert len(list((shm_dir / "slots" / "rank-0").iterdir())) == 2  # the free buffers
        assert pipe.host_memory_bytes > 0
    # keep_files: the memory steps stay after close; the newest also went to disk
    assert (shm_dir / "step-0000000005" / "rank-00000.commit").is_file()
    assert (tmp_path / "root" / "step-0000000005" / "rank-00000.commit").is_file()


def test_the_persistent_tier_receives_only_steps_written_through_to_disk(
        tmp_path: Path, shm_dir: Path) -> None:
    events: list[cp.Event] = []
    shared = tmp_path / "shared" / "run"
    with cp.CheckpointPipeline(tmp_path / "root", keep_last=10,
                               memory=cp.MemoryConfig(str(shm_dir), disk_every=2),
                               persistent=cp.PersistentConfig(str(shared), every=1)) as pipe:
        pipe.subscribe(events.append)
        for step in range(1, 7):
            pipe.save(step, _state(step)).result(30)
            pipe.wait(30)
    on_disk = [e.step for e in events if isinstance(e, cp.CheckpointCommitted)]
    persisted = [e.step for e in events if isinstance(e, cp.StepPersisted)]
    assert on_disk == [1, 3, 5, 6]  # every 2nd save, then the newest at close
    assert persisted == on_disk  # a memory-only step never reaches the persistent tier
    shutil.rmtree(tmp_path / "root")  # the node is gone: its disk and its shared memory
    shutil.rmtree(shm_dir, ignore_errors=True)
    live = _blank()
    with cp.CheckpointPipeline(tmp_path / "root",
                               persistent=cp.PersistentConfig(str(shared))) as pipe:
        result = pipe.restore_latest(live)
    assert result is not None and result.step == 6 and result.downloaded == (0,)
    assert _equal(live, _state(6))


def test_a_fresh_jobs_restore_makes_every_memory_buffer_in_the_background(
        tmp_path: Path, shm_dir: Path) -> None:
    state = _state(1)
    config = cp.MemoryConfig(str(shm_dir), slots=3)
    with watching("ckpt.pool.reserved") as reserved, \
            cp.CheckpointPipeline(tmp_path / "root", memory=config) as pipe:
        assert pipe.restore_latest(state) is None  # nothing yet: the state gives the size
        assert reserved.seen.wait(30)
        made = pipe.host_memory_bytes
        assert made == 3 * align_up(reserved.fields[0]["bytes"], 4096)  # type: ignore[arg-type]
        assert len(list((shm_dir / "slots" / "rank-0").iterdir())) == 3
        pipe.save(1, state).result(30)
        assert pipe.host_memory_bytes == made  # the first save made no buffer


def _run_child(code: str, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=90, check=False)


_CRASHING_CHILD = """
    import os, sys, torch
    import ckpt_pipeline as cp
    root, memory, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def state(step):
        gen = torch.Generator().manual_seed(step)
        return {"w": torch.randn(256, 64, generator=gen), "b": torch.arange(step, step + 100)}
    pipe = cp.CheckpointPipeline(root, memory=cp.MemoryConfig(memory, disk_every=3))
    pipe.__enter__()
    handles = [pipe.save(step, state(step)) for step in range(1, last + 1)]
    print(max(h.step for h in handles if h.durable(30) is not None), flush=True)
    os._exit(0)  # a crash: no close, no flush
"""


@pytest.mark.slow  # 3 s: a child process that crashes (the fast suite's minute)
def test_a_crash_restores_the_newest_memory_step(tmp_path: Path, shm_dir: Path) -> None:
    done = _run_child(_CRASHING_CHILD, tmp_path / "root", shm_dir, 5)
    assert done.returncode == 0, done.stderr
    with cp.CheckpointPipeline(tmp_path / "root", memory=str(shm_dir)) as pipe:
        live = _blank()
        result = pipe.restore_latest(live)
        assert result is not None and result.step == 5 and result.from_memory == (0,)
        assert _equal(live, _state(5))
    # restored from memory and not saved since: its files stay for the next run
    assert (shm_dir / "step-0000000005" / "rank-00000.commit").is_file()


@pytest.mark.slow
def test_shared_memory_wiped_falls_back_to_disk(tmp_path: Path, shm_dir: Path) -> None:
    done = _run_child(_CRASHING_CHILD, tmp_path / "root", shm_dir, 5)
    assert done.returncode == 0, done.stderr
    on_disk = int(done.stdout.split()[-1])  # the newest step durable on disk: 1, or 4
    assert on_disk in (1, 4)  # step 4's write-through is skipped if step 1's still ran
    shutil.rmtree(shm_dir)  # a reboot: /dev/shm is empty again
    with cp.CheckpointPipeline(tmp_path / "root", memory=str(shm_dir)) as pipe:
        live = _blank()
        result = pipe.restore_latest(live)
        assert result is not None and result.step == on_disk
        assert result.from_memory == ()
        assert _equal(live, _state(on_disk))


def test_memory_too_small_fails_at_open(tmp_path: Path, shm_dir: Path) -> None:
    shm_dir.mkdir()
    free = shutil.disk_usage(shm_dir).free
    too_big = (free // 4096 + 1) * 4096
    pipe = cp.CheckpointPipeline(tmp_path / "root",
                                 memory=cp.MemoryConfig(str(shm_dir), slot_bytes=too_big))
    with pytest.raises(cp.StorageError) as caught:
        pipe.__enter__()
    message = str(caught.value)
    assert str(3 * too_big) in message and "free" in message and str(shm_dir) in message
    assert "--shm-size" in message
    assert not list(shm_dir.rglob("*-*-*"))  # no buffer was made (nor left behind)
    with cp.CheckpointPipeline(tmp_path / "root") as again:  # the root was released
        assert again.save(1, _state(1)).result(30).tier == "disk"


def test_shared_memory_that_fills_up_fails_the_save_cleanly(
        tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer that cannot be made (the state grew, no room is left) fails that save; the
    step before stays restorable and training goes on. (No room is produced by answering
    the pool's free-space question with 0: a tmpfs cannot be filled on demand here.)"""
    import ckpt_pipeline._save.shm_pool as shm_pool

    failed: list[cp.SaveFailed] = []
    with cp.CheckpointPipeline(tmp_path / "root", memory=cp.MemoryConfig(
            str(shm_dir), disk_every=100)) as pipe:
        pipe.subscribe(lambda e: failed.append(e) if isinstance(e, cp.SaveFailed) else None)
        for step in (1, 2, 3):  # every buffer is made
            pipe.save(step, _state(step)).result(30)
        pipe.wait(30)
        monkeypatch.setattr(shm_pool, "free_bytes", lambda path: 0)
        grown = {**_state(4), "extra": torch.ones(4096)}
        handle = pipe.save(4, grown)
        with pytest.raises(cp.StorageError, match="the memory tier needs"):
            handle.result(30)
        pipe.save(5, _state(5)).result(30)  # as large as before: a free buffer fits
        monkeypatch.undo()
        live = _blank()
        result = pipe.restore_latest(live)
        assert result is not None and result.step == 5 and _equal(live, _state(5))
    assert [e.step for e in failed] == [4]


def test_a_stalled_disk_never_blocks_memory_commits(tmp_path: Path, shm_dir: Path) -> None:
    storage = GatedStorage(tmp_path / "root", timeout=60)
    skipped: list[cp.WriteThroughSkipped] = []
    with cp.CheckpointPipeline(tmp_path / "root", storage=storage,
                               memory=cp.MemoryConfig(str(shm_dir), disk_every=1)) as pipe:
        pipe.subscribe(lambda e: skipped.append(e)
                       if isinstance(e, cp.WriteThroughSkipped) else None)
        first = pipe.save(1, _state(1))
        assert first.result(30).tier == "memory"
        assert storage.entered.wait(30)  # its write-through waits for the disk
        for step in range(2, 7):
            assert pipe.save(step, _state(step)).result(30).tier == "memory"
        assert not _done(first)
        assert [e.step for e in skipped] == [2, 3, 4, 5, 6]
        assert skipped[-1].skipped == 5 and skipped[-1].busy_ranks == (0,)
        storage.gate.set()
        assert first.durable(30) is not None
    # at close the newest step went to disk too
    assert (tmp_path / "root" / "step-0000000006" / "rank-00000.commit").is_file()


def _done(handle: cp.SaveHandle) -> bool:
    try:
        handle.durable(0.01)
    except TimeoutError:
        return False
    return True


def test_memory_config_is_checked() -> None:
    assert cp.PipelineConfig(memory="/dev/shm/x").memory == cp.MemoryConfig("/dev/shm/x")
    with pytest.raises(cp.ConfigError, match="slots=2 is too few for keep=1"):
        cp.MemoryConfig("/dev/shm/x", slots=2)
    with pytest.raises(cp.ConfigError, match="disk_every"):
        cp.MemoryConfig("/dev/shm/x", disk_every=0)
    with pytest.raises(cp.ConfigError, match="slot_bytes"):
        cp.MemoryConfig("/dev/shm/x", slot_bytes=1000)
    with pytest.raises(cp.ConfigError, match="must be a directory"):
        cp.MemoryConfig("")
    with pytest.raises(cp.ConfigError, match="host_buffer_bytes cannot be combined"):
        cp.PipelineConfig(memory="/dev/shm/x", host_buffer_bytes=256 << 20)


def test_durable_without_the_tier_is_the_result(tmp_path: Path) -> None:
    with cp.CheckpointPipeline(tmp_path) as pipe:
        handle = pipe.save(1, _state(1))
        assert handle.durable(30) == handle.result(30)
        assert handle.result().tier == "disk"


def test_buffers_made_at_open_when_their_size_is_given(tmp_path: Path, shm_dir: Path) -> None:
    with cp.CheckpointPipeline(tmp_path / "root", memory=cp.MemoryConfig(
            str(shm_dir), slot_bytes=1 << 20)) as pipe:
        assert pipe.host_memory_bytes == 3 << 20  # before any save
        assert len(os.listdir(shm_dir / "slots" / "rank-0")) == 3
        pipe.save(1, _state(1)).result(30)
        assert pipe.host_memory_bytes == 3 << 20  # the state fits: nothing re-made


def _resident_bytes(address: int) -> int:
    """The resident bytes of this process's mapping that starts at ``address`` (smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split(maxsplit=1)[0]
        if "-" in head and int(head.split("-")[0], 16) == address:
            for entry in lines[i + 1:]:
                if entry.startswith("Rss:"):
                    return int(entry.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_a_buffers_pages_are_mapped_in_before_it_is_registered(shm_dir: Path) -> None:
    """Registration should not also fault the pages in (it holds the CUDA driver while it
    does): ``populate`` maps the whole buffer in first."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps")
    from ckpt_pipeline._hostmem import populate
    from ckpt_pipeline._tiers.memory import shm

    shm_dir.mkdir()
    size = 16 << 20
    buffer = shm.ShmBuffer(str(shm_dir / "b"), size, register=False)
    try:
        assert buffer.tensor is not None
        address = buffer.tensor.data_ptr()
        assert _resident_bytes(address) < size  # fallocate gave the file pages, not the map
        assert populate(address, size, threads=3)
        assert _resident_bytes(address) == size
    finally:
        buffer.close()
