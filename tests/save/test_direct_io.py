"""Shard data written with O_DIRECT: same bytes as buffered writes, zero gaps, clean fallbacks."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.layout import DataLayout, plan_layout
from ckpt_pipeline._format.limits import ALIGN
from ckpt_pipeline._format.region import align_up
from ckpt_pipeline._format.shard import PREAMBLE_SIZE
from ckpt_pipeline.storage import LocalStorage
from ckpt_pipeline.testing import Fault, FaultyStorage

SHARD = "step-{:010d}/rank-00000.shard"


class RecordingStorage(LocalStorage):
    """LocalStorage that remembers what ``open_direct`` returned (None: not offered)."""

    def __init__(self, root: Path, *, offer_direct: bool = True) -> None:
        super().__init__(root)
        self.offer_direct = offer_direct
        self.direct: list[int | None] = []

    def open_direct(self, rel_dir: str, temp_name: str) -> int | None:
        fd = super().open_direct(rel_dir, temp_name) if self.offer_direct else None
        self.direct.append(fd)
        return fd


def _state(scale: int) -> dict[str, torch.Tensor]:
    # Odd sizes, so that every tensor but none of the chunks ends on an aligned offset.
    return {"a": torch.arange(3001, dtype=torch.float32) * scale,
            "b": torch.full((77, 13), float(scale), dtype=torch.float64),
            "c": torch.arange(5, dtype=torch.int16),
            "big": torch.arange(300_001, dtype=torch.float32) + scale}


def _shard_bytes(root: Path, step: int) -> bytes:
    return (root / SHARD.format(step)).read_bytes()


def _layout(state: dict[str, torch.Tensor]) -> DataLayout:
    """The data region the pipeline lays out for this state (file offsets)."""
    return plan_layout(list(state.values()))


def _save(root: Path, storage: LocalStorage, step: int, state: dict[str, torch.Tensor],
          **options: object) -> None:
    with cp.CheckpointPipeline(root, storage=storage, chunk_bytes=ALIGN * 16,
                               **options) as pipe:
        pipe.save(step, state).result(30)


def _restore(root: Path, like: dict[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
    live = {k: torch.zeros_like(v) for k, v in like.items()}
    with cp.CheckpointPipeline(root, restore_rng=False) as pipe:
        result = pipe.restore_latest(live)
    assert result is not None
    return result.step, live


def test_direct_and_buffered_writes_give_the_same_bytes(tmp_path: Path) -> None:
    state = _state(3)
    direct = RecordingStorage(tmp_path / "direct")
    _save(direct.root, direct, 1, state)
    if direct.direct == [None]:
        pytest.skip("this file system does not offer O_DIRECT")
    assert direct.direct and direct.direct[0] is not None
    buffered = RecordingStorage(tmp_path / "buffered")
    _save(buffered.root, buffered, 1, state, direct_io=False)
    assert buffered.direct == []  # not even asked for
    a, b = _shard_bytes(direct.root, 1), _shard_bytes(buffered.root, 1)
    layout = _layout(state)
    assert layout.gaps and layout.data_end % ALIGN  # padding, and an unaligned end
    assert a[PREAMBLE_SIZE:layout.data_end] == b[PREAMBLE_SIZE:layout.data_end]
    for start, end in layout.gaps:
        assert a[start:end] == bytes(end - start), (start, end)
    step, live = _restore(direct.root, state)
    assert step == 1
    for key, value in state.items():
        assert torch.equal(live[key], value), key


def test_gaps_are_zero_when_a_buffer_is_reused_with_another_layout(tmp_path: Path) -> None:
    """A slot that held other bytes at a gap offset must not leak them into the file."""
    storage = RecordingStorage(tmp_path / "ckpt")
    first = {"x": torch.full((400_000,), -1.0)}  # fills the slot with 0xbf80 patterns
    second = {"x": torch.arange(1100, dtype=torch.float32), "c": torch.ones(3, dtype=torch.int8),
              "big": torch.ones(262_145)}  # big starts at an aligned offset: a gap before it
    with cp.CheckpointPipeline(storage.root, storage=storage, chunk_bytes=ALIGN * 16) as pipe:
        pipe.save(1, first).result(30)
        size = pipe.host_memory_bytes
        pipe.save(2, second).result(30)
        assert pipe.host_memory_bytes == size == align_up(_layout(first).buffer_bytes)
    shard = _shard_bytes(storage.root, 2)
    gaps = _layout(second).gaps
    assert sum(end - start for start, end in gaps) > 3000
    for start, end in gaps:
        assert shard[start:end] == bytes(end - start), (start, end)
    step, live = _restore(storage.root, second)
    assert step == 2 and all(torch.equal(live[k], v) for k, v in second.items())


def test_without_direct_io_on_offer_the_save_is_buffered(tmp_path: Path) -> None:
    storage = RecordingStorage(tmp_path / "ckpt", offer_direct=False)
    state = _state(5)
    _save(storage.root, storage, 7, state)
    assert storage.direct == [None]
    step, live = _restore(storage.root, state)
    assert step == 7 and all(torch.equal(live[k], v) for k, v in state.items())


def test_a_refused_direct_write_falls_back_to_buffered(tmp_path: Path) -> None:
    """Some file systems accept the O_DIRECT open and refuse the write (EINVAL)."""
    storage = FaultyStorage(tmp_path / "ckpt")
    probe = RecordingStorage(tmp_path / "probe")
    _save(probe.root, probe, 1, _state(1))
    if probe.direct == [None]:
        pytest.skip("this file system does not offer O_DIRECT")
    state = _state(9)
    storage.arm(Fault("pwrite", at=1, errno=errno.EINVAL))
    _save(storage.root, storage, 2, state)
    assert storage.fired, "the injected EINVAL never fired"
    step, live = _restore(storage.root, state)
    assert step == 2 and all(torch.equal(live[k], v) for k, v in state.items())


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_failing_direct_open_fails_the_save_cleanly(tmp_path: Path, code: int) -> None:
    storage = FaultyStorage(tmp_path / "ckpt")
    with cp.CheckpointPipeline(storage.root, storage=storage) as pipe:
        pipe.save(1, _state(1)).result(30)
        storage.arm(Fault("open_direct", at=1, errno=code))
        handle = pipe.save(2, _state(2))
        with pytest.raises(cp.StorageError) as info:
            handle.result(30)
        assert info.value.errno == code and info.value.step == 2
    assert not list(storage.root.rglob(".*tmp-*"))
    step, live = _restore(storage.root, _state(1))
    assert step == 1 and torch.equal(live["big"], _state(1)["big"])
