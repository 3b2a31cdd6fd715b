"""Every stage emits a typed event, to subscribers and to structlog."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import capture_logs

STAGES = [cp.SaveRequested, cp.SnapshotTaken, cp.ShardDataWritten, cp.ShardSealed,
          cp.CheckpointCommitted]


def test_a_save_emits_one_event_per_stage_in_order(root: Path) -> None:
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root) as pipe:
        pipe.subscribe(events.append)
        pipe.save(1, {"x": torch.ones(1000)}).result(30)
        pipe.wait()
    assert [type(e) for e in events][:5] == STAGES
    for event in events:
        assert event.step == 1 and event.rank == 0
    written = next(e for e in events if isinstance(e, cp.ShardSealed))
    assert written.bytes > 4000 and written.seconds >= 0


def test_events_are_frozen_dataclasses(root: Path) -> None:
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root) as pipe:
        pipe.subscribe(events.append)
        pipe.save(1, {"x": torch.ones(10)}).result(30)
    with pytest.raises(dataclasses.FrozenInstanceError):
        events[0].step = 2  # type: ignore[misc]


def test_structlog_sees_namespaced_events_with_step_rank_bytes_seconds(root: Path) -> None:
    with capture_logs() as logs, cp.CheckpointPipeline(root) as pipe:
        pipe.save(3, {"x": torch.ones(10)}).result(30)
    names = [entry["event"] for entry in logs]
    for name in ("ckpt.save.requested", "ckpt.snapshot.done", "ckpt.write_data.done",
                 "ckpt.seal.done", "ckpt.commit.done"):
        assert name in names
    committed = next(e for e in logs if e["event"] == "ckpt.commit.done")
    assert committed["step"] == 3 and committed["rank"] == 0
    assert committed["bytes"] > 0 and committed["seconds"] > 0
    assert committed["log_level"] == "info"


def test_unsubscribe_stops_delivery(root: Path) -> None:
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root) as pipe:
        unsubscribe = pipe.subscribe(events.append)
        pipe.save(1, {"x": torch.ones(1)}).result(30)
        unsubscribe()
        count = len(events)
        pipe.save(2, {"x": torch.ones(1)}).result(30)
    assert len(events) == count


def test_a_failing_subscriber_does_not_break_the_save(root: Path) -> None:
    def broken(event: cp.Event) -> None:
        raise RuntimeError("subscriber bug")

    with capture_logs() as logs, cp.CheckpointPipeline(root) as pipe:
        pipe.subscribe(broken)
        info = pipe.save(1, {"x": torch.ones(1)}).result(30)
    assert info.step == 1
    assert any(e["event"] == "ckpt.subscriber.failed" for e in logs)


def test_the_pipeline_runs_in_one_named_background_thread(root: Path) -> None:
    threads: set[str] = set()
    with cp.CheckpointPipeline(root) as pipe:
        pipe.subscribe(lambda e: threads.add(threading.current_thread().name)
                       if isinstance(e, cp.CheckpointCommitted) else None)
        pipe.save(1, {"x": torch.ones(1)}).result(30)
        assert "ckpt-pipeline" in {t.name for t in threading.enumerate()}
    assert threads == {"ckpt-pipeline"}
    assert "ckpt-pipeline" not in {t.name for t in threading.enumerate()}


@pytest.mark.parametrize(("old", "new"), [("ShardSerialized", "ShardDataWritten"),
                                          ("ShardWritten", "ShardSealed")])
def test_an_old_event_name_is_a_deprecated_alias_of_the_renamed_class(
        root: Path, old: str, new: str) -> None:
    import ckpt_pipeline.events as events_module

    renamed = getattr(cp, new)
    for module in (cp, events_module):
        with pytest.warns(DeprecationWarning, match=f"{old} was renamed {new}"):
            assert getattr(module, old) is renamed
        assert old not in module.__all__
    with pytest.warns(DeprecationWarning):
        exec(f"from ckpt_pipeline.events import {old} as alias", namespace := {})
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root) as pipe:
        pipe.subscribe(events.append)
        pipe.save(1, {"x": torch.ones(10)}).result(30)
    assert any(isinstance(e, namespace["alias"]) for e in events)
    with pytest.raises(AttributeError, match="ShardTeleported"):
        cp.ShardTeleported  # noqa: B018


def test_save_failed_takes_only_a_stage_name() -> None:
    fields = {"step": 1, "rank": 0, "save_id": "run-1", "error": "disk full"}
    for stage in ("copy", "write_data", "seal", "commit", "retain", "submit", "close"):
        assert cp.SaveFailed(stage=stage, **fields).stage == stage  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'write'"):
        cp.SaveFailed(stage="write", **fields)  # type: ignore[arg-type]
