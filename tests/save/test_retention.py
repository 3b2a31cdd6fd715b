"""Retention that cannot remove a step reaches the caller and ``ckpt-pipeline ls``."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.cli import main as cli_main
from ckpt_pipeline.testing import Fault, FaultyStorage


def _ls_json(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[int, dict[str, object]]:
    capsys.readouterr()
    assert cli_main(["ls", str(root), "--json"]) == 0
    return {row["step"]: row for row in json.loads(capsys.readouterr().out)["steps"]}


@pytest.mark.timeout(60)
def test_a_step_retention_cannot_remove_is_an_event_and_shown_by_ls(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage = FaultyStorage(root)
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(root, storage=storage, keep_last=1) as pipe:
        pipe.subscribe(events.append)
        pipe.save(1, {"x": torch.ones(4)}).result(30)
        storage.arm(Fault("unlink", 1, errno.EACCES))  # pruning step 1 fails at its first file
        info = pipe.save(2, {"x": torch.ones(4)}).result(30)
        pipe.wait(30)
    assert info.step == 2  # the save itself is committed: retention never fails it
    failed = [e for e in events if isinstance(e, cp.RetentionFailed)]
    assert [(e.step, e.committed_step) for e in failed] == [(1, 2)]
    assert "unlink failed" in failed[0].error
    rows = _ls_json(root, capsys)
    assert rows[1]["retention_failed"] is not None
    assert "retention could not remove it" in str(rows[1]["reason"])
    assert rows[2]["retention_failed"] is None
    capsys.readouterr()
    assert cli_main(["ls", str(root)]) == 0
    assert "retention could not remove it" in capsys.readouterr().out

    # the next prune removes it, and the marker goes with it
    with cp.CheckpointPipeline(root, keep_last=1) as pipe:
        pipe.save(3, {"x": torch.ones(4)}).result(30)
        pipe.wait(30)
    rows = _ls_json(root, capsys)
    assert sorted(rows) == [3]
    assert not list(root.glob(".retain-failed-*"))


@pytest.mark.timeout(60)
def test_retention_failure_is_logged_as_a_warning(root: Path) -> None:
    from ckpt_pipeline.testing import capture_logs

    storage = FaultyStorage(root)
    with capture_logs() as logs, cp.CheckpointPipeline(root, storage=storage,
                                                      keep_last=1) as pipe:
        pipe.save(1, {"x": torch.ones(4)}).result(30)
        storage.arm(Fault("unlink", 1, errno.EIO))
        pipe.save(2, {"x": torch.ones(4)}).result(30)
        pipe.wait(30)
    warned = [e for e in logs if e["event"] == "ckpt.retain.failed"]
    assert [(e["log_level"], e["step"]) for e in warned] == [("warning", 1)]
