"""Lineage: every commit record names the step it continues from and the run's timeline, and
one rule (``_format/timeline.py``) tells the steps of the current timeline from those a rewind
abandoned. Records written before lineage existed still load, and can be rewound."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.documents import decode_commit, encode_commit
from ckpt_pipeline._format.timeline import Lineage, Mark, abandoned, decode_lineage, marks_of
from ckpt_pipeline.testing import Fault, FaultyStorage


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((100,), value)}


def _record(root: Path, step: int) -> Any:
    path = root / f"step-{step:010d}" / "rank-00000.commit"
    return decode_commit(path.read_bytes(), str(path))


def _save(pipe: cp.CheckpointPipeline, step: int, value: float) -> str:
    info = pipe.save(step, _state(value), cp.TrainState(step=step)).result(30)
    return info.save_id


@pytest.mark.timeout(60)
def test_each_commit_record_names_its_parent_and_each_restore_starts_a_timeline(
    tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    with cp.CheckpointPipeline(root, direct_io=False) as pipe:
        first = _save(pipe, 1, 1.0)
        _save(pipe, 2, 2.0)
    assert _record(root, 1).lineage == Lineage(0, None)  # nothing restored: no parent
    assert _record(root, 2).lineage == Lineage(0, (1, first))
    with cp.CheckpointPipeline(root, direct_io=False) as pipe:
        result = pipe.restore_latest(_state(0.0))
        assert result is not None and result.step == 2
        _save(pipe, 3, 3.0)
    assert _record(root, 3).lineage == Lineage(1, (2, result.save_id))


@pytest.mark.timeout(60)
def test_old_commit_records_without_lineage_restore_and_can_be_rewound(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with cp.CheckpointPipeline(root, direct_io=False, keep_last=10) as pipe:
        for step in range(1, 5):
            _save(pipe, step, float(step))
    for step in range(1, 5):  # as a version before lineage wrote them
        path = root / f"step-{step:010d}" / "rank-00000.commit"
        path.write_bytes(encode_commit(replace(_record(root, step), lineage=None)))
        assert b"parent" not in path.read_bytes() and b"timeline" not in path.read_bytes()
    state = _state(0.0)
    with cp.CheckpointPipeline(root, direct_io=False, keep_last=10) as pipe:
        result = pipe.restore_latest(state)
        assert result is not None and result.step == 4 and float(state["w"][0]) == 4.0
        assert pipe.restore(state, step=2) is not None
        _save(pipe, 3, 30.0)
    state = _state(0.0)
    with cp.CheckpointPipeline(root, direct_io=False, keep_last=10) as pipe:
        result = pipe.restore_latest(state)
    assert result is not None and result.step == 3 and float(state["w"][0]) == 30.0
    assert cp.load(root).step == 3


def test_a_step_is_abandoned_only_by_a_newer_timeline_that_continues_from_an_older_step(
) -> None:
    marks = {Mark(timeline=2, step=3)}
    assert abandoned(4, Lineage(1, (3, "a")), marks)  # older timeline, past the fork
    assert abandoned(6, None, marks)  # a record without lineage is of timeline 0
    assert not abandoned(3, Lineage(1, (2, "a")), marks)  # at the fork: kept
    assert not abandoned(4, Lineage(2, (3, "b")), marks)  # the new timeline itself
    assert not abandoned(9, Lineage(3, (8, "c")), marks)  # a later timeline


def test_a_step_of_a_new_timeline_marks_the_steps_it_replaced_without_any_rewind_record(
) -> None:
    marks = marks_of([Lineage(1, (3, "s3")), Lineage(0, (5, "s5")), None])
    assert marks == {Mark(1, 3)}
    assert abandoned(6, Lineage(0, (5, "s5")), marks)
    assert not abandoned(4, Lineage(1, (3, "s3")), marks)


@pytest.mark.parametrize("doc", [
    {"timeline": -1}, {"timeline": True}, {"timeline": 1, "parent": [3, "x"]},
    {"timeline": 1, "parent": {"step": 3}}, {"timeline": 1, "parent": {"step": -1,
                                                                        "save_id": "x"}},
    {"timeline": 1, "parent": {"step": 3, "save_id": ""}},
])
def test_a_malformed_lineage_is_an_integrity_error(doc: dict[str, Any]) -> None:
    with pytest.raises(cp.CheckpointIntegrityError):
        decode_lineage(doc, "/x/rank-00000.commit")


@pytest.mark.timeout(60)
def test_a_rewind_whose_record_cannot_be_written_fails_and_changes_nothing(
    tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    with cp.CheckpointPipeline(root, direct_io=False, keep_last=10) as pipe:
        for step in range(1, 5):
            _save(pipe, step, float(step))
    storage = FaultyStorage(root)
    state = _state(7.0)
    with cp.CheckpointPipeline(root, storage=storage, direct_io=False, keep_last=10) as pipe:
        storage.arm(Fault("fsync", 1, name="rewind-0000000001-r00000"))
        with pytest.raises(cp.RestoreError, match="rewind to step 2 could not be recorded"):
            pipe.restore(state, step=2)
        assert storage.fired
    assert float(state["w"][0]) == 7.0  # the live state as it was
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".lock")) == [
        f"step-000000000{s}" for s in (1, 2, 3, 4)]  # no record, nothing moved aside
    with cp.CheckpointPipeline(root, direct_io=False, keep_last=10) as pipe:
        result = pipe.restore_latest(state)
    assert result is not None and result.step == 4 and float(state["w"][0]) == 4.0


@pytest.mark.timeout(60)
def test_falling_back_from_a_corrupt_step_is_no_rewind_and_keeps_the_evidence(
    tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    with cp.CheckpointPipeline(root, direct_io=False, keep_last=10) as pipe:
        for step in range(1, 4):
            _save(pipe, step, float(step))
    shard = root / "step-0000000003" / "rank-00000.shard"
    data = bytearray(shard.read_bytes())
    data[4096 + 17] ^= 0xFF  # the data region: the cheap scan passes, the load's checksum fails
    shard.write_bytes(bytes(data))
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root, direct_io=False, keep_last=10) as pipe:
        pipe.subscribe(events.append)
        result = pipe.restore_latest(_state(0.0))
        assert result is not None and result.step == 2
        assert [r.step for r in result.rejected] == [3]
        assert "checksum" in result.rejected[0].reason
        _save(pipe, 3, 30.0)
        pipe.wait(30)  # retention ran
    assert not any(isinstance(e, cp.CheckpointRewound) for e in events)
    assert list(root.glob("rewind-*")) == []
    assert len(list(root.glob("step-0000000003.rejected-r00000-*"))) == 1  # kept
