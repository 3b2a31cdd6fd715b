"""The ``ckpt-pipeline`` command, run as a user runs it: a real process on real checkpoints."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.cli._output import _progress_text, ranks_text
from tests._support.children import child_env
from tests._support.cli import run_cli as _cli


def _save_steps(root: Path, steps: list[int]) -> None:
    with cp.CheckpointPipeline(root, keep_last=5) as pipe:
        for step in steps:
            pipe.save(step, {"w": torch.randn(1024), "opt": {"m": torch.zeros(256)}},
                      cp.TrainState(step=step)).result(30)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


@pytest.mark.slow
def test_the_command_runs_as_its_own_process(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"x": torch.ones(4)}).result(30)
    done = subprocess.run([sys.executable, "-m", "ckpt_pipeline.cli", "ls", str(root)],
                          capture_output=True, text=True, env=child_env(), timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "complete" in done.stdout


def _rows(stdout: str) -> list[list[str]]:
    """The cells of a table's rows (header dropped), split on runs of spaces."""
    return [line.split() for line in stdout.splitlines()[1:]]


def _ls_json(root: Path) -> dict[str, Any]:
    done = _cli("ls", root, "--json")
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_ls_lists_steps_newest_first_as_complete(root: Path) -> None:
    _save_steps(root, [10, 20, 30])
    done = _cli("ls", root)
    assert done.returncode == 0, done.stderr
    rows = _rows(done.stdout)
    assert [r[0] for r in rows] == ["30", "20", "10"]
    assert [r[1] for r in rows] == ["complete"] * 3


def test_ls_json_reports_steps_and_their_on_disk_sizes(root: Path) -> None:
    _save_steps(root, [10, 20])
    data = _ls_json(root)
    assert data["root"] == str(root)
    assert [s["step"] for s in data["steps"]] == [20, 10]
    for entry in data["steps"]:
        on_disk = sum(p.stat().st_size for p in _step_dir(root, entry["step"]).iterdir()
                      if p.name.startswith("rank-00000."))
        assert entry["bytes"] == on_disk
        assert entry["status"] == "complete"
        assert entry["ranks_committed"] == [0]
        assert entry["save_id"]
        assert entry["age_seconds"] >= 0


def test_ls_shows_truncated_shard_as_corrupt(root: Path) -> None:
    _save_steps(root, [10, 20])
    os.truncate(_step_dir(root, 20) / "rank-00000.shard", 4096 + 10)
    done = _cli("ls", root)
    assert done.returncode == 0, done.stderr
    rows = {r[0]: r for r in _rows(done.stdout)}
    assert rows["20"][1] == "corrupt"
    assert "truncated" in done.stdout
    assert rows["10"][1] == "complete"


def test_ls_shows_step_without_commit_record_as_incomplete(root: Path) -> None:
    _save_steps(root, [10, 20])
    os.unlink(_step_dir(root, 20) / "rank-00000.commit")
    data = _ls_json(root)
    by_step = {s["step"]: s for s in data["steps"]}
    assert by_step[20]["status"] == "incomplete"
    assert by_step[20]["ranks_committed"] == []
    assert by_step[10]["status"] == "complete"


def test_ls_shows_directory_moved_aside_by_recovery_as_rejected(root: Path) -> None:
    _save_steps(root, [10, 20])
    os.rename(_step_dir(root, 20), root / "step-0000000020.rejected-r00000-0badcafe")
    data = _ls_json(root)
    assert [(s["step"], s["status"]) for s in data["steps"]] == [(20, "rejected"),
                                                                 (10, "complete")]


def test_ls_counts_ranks_by_their_commit_records(root: Path) -> None:
    _save_steps(root, [10])
    step = _step_dir(root, 10)
    shutil.copy(step / "rank-00000.commit", step / "rank-00002.commit")
    shutil.copy(step / "rank-00000.shard", step / "rank-00001.shard")
    (entry,) = _ls_json(root)["steps"]
    assert entry["ranks_committed"] == [0, 2]
    assert entry["ranks_present"] == [0, 1, 2]


def test_ls_on_empty_root_prints_no_checkpoints(tmp_path: Path) -> None:
    done = _cli("ls", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no checkpoints" in done.stdout


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_missing_root_exits_2_with_a_message(tmp_path: Path, command: str) -> None:
    done = _cli(command, tmp_path / "nowhere")
    assert done.returncode == 2
    assert "nowhere" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_verify_exits_0_when_newest_step_is_intact(root: Path) -> None:
    _save_steps(root, [10, 20])
    done = _cli("verify", root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [(r[0], r[1]) for r in _rows(done.stdout)] == [("20", "OK")]


def test_verify_fails_on_flipped_data_byte_naming_step_and_tensor(root: Path) -> None:
    _save_steps(root, [10, 20])
    _flip_byte(_step_dir(root, 20) / "rank-00000.shard", 4096 + 100)
    done = _cli("verify", root)
    assert done.returncode == 1
    (row,) = _rows(done.stdout)
    assert row[:2] == ["20", "FAILED"]
    assert "checksum mismatch" in done.stdout
    assert "'w'" in done.stdout
    assert "Traceback" not in done.stderr


def test_verify_all_json_reports_every_step_and_exits_1_if_one_fails(root: Path) -> None:
    _save_steps(root, [10, 20, 30])
    _flip_byte(_step_dir(root, 20) / "rank-00000.shard", 4096)
    done = _cli("verify", root, "--all", "--json")
    assert done.returncode == 1
    results = json.loads(done.stdout)["results"]
    assert [(r["step"], r["ok"]) for r in results] == [(30, True), (20, False), (10, True)]
    assert results[0]["bytes"] == (1024 + 256) * 4
    assert results[0]["reason"] is None
    assert "checksum" in results[1]["reason"]


def test_verify_step_selects_that_step(root: Path) -> None:
    _save_steps(root, [10, 20])
    done = _cli("verify", root, "--step", 10, "--json")
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in json.loads(done.stdout)["results"]] == [10]


def test_verify_unknown_step_exits_2(root: Path) -> None:
    _save_steps(root, [10])
    done = _cli("verify", root, "--step", 11)
    assert done.returncode == 2
    assert "step 11 not found" in done.stderr


def test_ranks_are_shown_as_ranges_with_the_world_size_when_some_are_missing() -> None:
    assert ranks_text([0, 1, 2, 3], 4) == "0-3"
    assert ranks_text([0, 2], 4) == "0,2 of 4"
    assert ranks_text([0, 1, 2, 5, 6], None) == "0-2,5-6"
    assert ranks_text([], None) == "-"


def test_progress_text_shows_bar_percent_and_sizes_in_the_unit_of_the_total() -> None:
    mib = 1024**2
    text = _progress_text(1920 * mib, 2560 * mib, width=10)
    assert text == "[#######...]  75% 1.9/2.5 GiB"


def test_progress_bar_on_a_closed_terminal_never_stops_verification() -> None:

    from ckpt_pipeline.cli._output import Progress

    stream = io.StringIO()
    stream.close()  # writes raise ValueError, as a closed pipe raises OSError
    bar = Progress(100, "step 1", stream)
    bar(50)
    bar(50)
    bar.close()
    assert bar.done == 100
