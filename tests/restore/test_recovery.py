"""Recovery: corrupt, truncated and incomplete steps are reported and skipped; leftovers scrubbed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.shard import decode_preamble


def _save_steps(root: Path, steps: list[int], keep_last: int = 5) -> None:
    with cp.CheckpointPipeline(root, keep_last=keep_last) as pipe:
        for step in steps:
            pipe.save(step, {"w": torch.full((1024,), float(step))},
                      cp.TrainState(step=step)).result(30)


def _restore(root: Path) -> tuple[cp.RestoreResult | None, torch.Tensor, list[cp.Event]]:
    live = {"w": torch.zeros(1024)}
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root) as pipe:
        pipe.subscribe(events.append)
        result = pipe.restore_latest(live)
    return result, live["w"], events


def _shard(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}" / "rank-00000.shard"


def test_bit_flip_in_tensor_data_falls_back_to_previous_step(root: Path) -> None:
    _save_steps(root, [10, 20])
    with open(_shard(root, 20), "r+b") as f:
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    result, w, events = _restore(root)
    assert result is not None and result.step == 10
    assert torch.equal(w, torch.full((1024,), 10.0))
    assert [r.step for r in result.rejected] == [20]
    assert "checksum" in result.rejected[0].reason
    rejected = [e for e in events if isinstance(e, cp.CheckpointRejected)]
    assert [e.step for e in rejected] == [20]


@pytest.mark.parametrize("keep", [0, 1, 40, 64, 4096 + 10])
def test_truncated_shard_falls_back_to_previous_step(root: Path, keep: int) -> None:
    _save_steps(root, [10, 20])
    os.truncate(_shard(root, 20), keep)
    result, w, _ = _restore(root)
    assert result is not None and result.step == 10
    assert torch.equal(w, torch.full((1024,), 10.0))


@pytest.mark.parametrize("where", ["header - 1", "header", "length - 1"])
def test_shard_truncated_around_its_header_falls_back(root: Path, where: str) -> None:
    _save_steps(root, [10, 20])
    shard = _shard(root, 20)
    data = shard.read_bytes()
    _, header, _, _ = decode_preamble(data, len(data), str(shard))
    keep = {"header - 1": header - 1, "header": header, "length - 1": len(data) - 1}[where]
    os.truncate(shard, keep)
    result, w, _ = _restore(root)
    assert result is not None and result.step == 10
    assert torch.equal(w, torch.full((1024,), 10.0))
    assert [r.step for r in result.rejected] == [20]


def test_corrupt_header_falls_back_to_previous_step(root: Path) -> None:
    _save_steps(root, [10, 20])
    size = _shard(root, 20).stat().st_size
    with open(_shard(root, 20), "r+b") as f:
        f.seek(size - 5)
        f.write(b"\xff\xff\xff\xff\xff")
    result, _, _ = _restore(root)
    assert result is not None and result.step == 10


def test_step_without_commit_record_is_not_restored(root: Path) -> None:
    _save_steps(root, [10, 20])
    os.unlink(root / "step-0000000020" / "rank-00000.commit")
    result, w, _ = _restore(root)
    assert result is not None and result.step == 10
    assert torch.equal(w, torch.full((1024,), 10.0))


def test_open_scrubs_temporaries_and_uncommitted_files_but_not_committed_steps(
        root: Path) -> None:
    _save_steps(root, [10, 20])
    step30 = root / "step-0000000030"
    step30.mkdir()
    (step30 / "rank-00000.shard").write_bytes(b"partial")
    (root / "step-0000000020" / ".rank-00000.shard.tmp-abcdef").write_bytes(b"junk")
    with cp.CheckpointPipeline(root):
        pass
    assert not step30.exists()
    assert sorted(os.listdir(root / "step-0000000020")) == [
        "rank-00000.commit", "rank-00000.manifest", "rank-00000.shard"]
    result, _, _ = _restore(root)
    assert result is not None and result.step == 20


def test_unknown_files_in_the_root_are_left_alone(root: Path) -> None:
    _save_steps(root, [10])
    (root / "notes.txt").write_text("mine")
    (root / "step-12").mkdir()  # not a canonical step name
    result, _, _ = _restore(root)
    assert result is not None and result.step == 10
    assert (root / "notes.txt").read_text() == "mine"
    assert (root / "step-12").is_dir()


def test_all_checkpoints_corrupt_raises_restore_error_naming_them(root: Path) -> None:
    _save_steps(root, [10])
    os.truncate(_shard(root, 10), 100)
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.RestoreError, match="step 10"):
        pipe.restore_latest({"w": torch.zeros(1024)})


def test_newer_rejected_step_is_moved_aside_so_training_can_save_it_again(root: Path) -> None:
    _save_steps(root, [10, 20])
    os.truncate(_shard(root, 20), 10)
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest({"w": torch.zeros(1024)})
        assert result is not None and result.step == 10
        pipe.save(20, {"w": torch.full((1024,), 21.0)}, cp.TrainState(step=20)).result(30)
    moved = [n for n in os.listdir(root) if n.startswith("step-0000000020.rejected-")]
    assert len(moved) == 1, "the corrupt step is kept for inspection"
    result, w, _ = _restore(root)
    assert result is not None and result.step == 20
    assert torch.equal(w, torch.full((1024,), 21.0))


def test_shard_swapped_between_steps_is_detected(root: Path) -> None:
    _save_steps(root, [10, 20])
    _shard(root, 20).write_bytes(_shard(root, 10).read_bytes())
    result, w, _ = _restore(root)
    assert result is not None and result.step == 10
    assert torch.equal(w, torch.full((1024,), 10.0))
    assert [r.step for r in result.rejected] == [20]


def test_restore_into_a_state_of_another_shape_fails_and_rejects_nothing(root: Path) -> None:
    _save_steps(root, [10, 20])
    with cp.CheckpointPipeline(root) as pipe:
        with pytest.raises(cp.StateError, match=r"float32\[1024\]") as info:
            pipe.restore_latest({"w": torch.zeros(7)})
        assert info.value.step == 20 and info.value.path == "w"
    result, _, _ = _restore(root)
    assert result is not None and result.step == 20


@pytest.mark.parametrize("name", ["rank-00000.manifest", "rank-00000.commit"])
@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_damaged_manifest_or_commit_record_falls_back(root: Path, name: str, damage: str) -> None:
    _save_steps(root, [10, 20])
    path = root / "step-0000000020" / name
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    result, w, _ = _restore(root)
    assert result is not None and result.step == 10
    assert torch.equal(w, torch.full((1024,), 10.0))


def test_commit_record_without_its_data_falls_back(root: Path) -> None:
    _save_steps(root, [10, 20])
    os.unlink(_shard(root, 20))
    os.unlink(root / "step-0000000020" / "rank-00000.manifest")
    result, _, _ = _restore(root)
    assert result is not None and result.step == 10
    assert [r.step for r in result.rejected] == [20]


def test_appended_garbage_or_zeroed_tail_falls_back(root: Path) -> None:
    _save_steps(root, [10, 20, 30])
    with open(_shard(root, 30), "ab") as f:
        f.write(b"garbage")
    size = _shard(root, 20).stat().st_size
    with open(_shard(root, 20), "r+b") as f:
        f.seek(size - 100)
        f.write(bytes(100))
    result, w, _ = _restore(root)
    assert result is not None and result.step == 10
    assert torch.equal(w, torch.full((1024,), 10.0))
    assert sorted(r.step for r in result.rejected) == [20, 30]


def test_shard_that_is_a_symlink_or_fifo_is_rejected(root: Path, tmp_path: Path) -> None:
    _save_steps(root, [10, 20, 30])
    target = tmp_path / "elsewhere"
    target.write_bytes(_shard(root, 30).read_bytes())
    os.unlink(_shard(root, 30))
    os.symlink(target, _shard(root, 30))
    os.unlink(_shard(root, 20))
    os.mkfifo(_shard(root, 20))
    result, _, _ = _restore(root)
    assert result is not None and result.step == 10
    assert sorted(r.step for r in result.rejected) == [20, 30]


def test_a_leftover_partial_directory_of_a_step_is_saved_again_cleanly(root: Path) -> None:
    _save_steps(root, [10])
    partial = root / "step-0000000020"
    partial.mkdir(mode=0o700)
    (partial / "rank-00000.shard").write_bytes(b"torn shard of a crashed save")
    (partial / ".rank-00000.manifest.tmp-0123abcd").write_bytes(b"torn")
    _save_steps(root, [20])  # opening scrubs the leftovers; the save then succeeds
    result, w, _ = _restore(root)
    assert result is not None and result.step == 20
    assert torch.equal(w, torch.full((1024,), 20.0))
    assert sorted(p.name for p in partial.iterdir()) == [
        "rank-00000.commit", "rank-00000.manifest", "rank-00000.shard"]
