"""Logging behaves like a library's: silent by default, standard levels, best-effort sinks."""

from __future__ import annotations

import io
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import capture_logs
from tests._support.children import run_child

CHILD = "logging_child.py"
CHILD_TIMEOUT_S = 120


def _run_child(mode: str, tmp_path: Path, *, stdout: int | None = None
               ) -> tuple[subprocess.CompletedProcess[bytes], str]:
    result = tmp_path / "result"
    proc = run_child(CHILD, mode, tmp_path / "ckpt", result, timeout=CHILD_TIMEOUT_S,
                     stdout=subprocess.PIPE if stdout is None else stdout)
    return proc, result.read_text() if result.exists() else ""


def _run_child_with_closed_stdout(mode: str, tmp_path: Path
                                  ) -> tuple[subprocess.CompletedProcess[bytes], str]:
    """stdout is a pipe whose reader is gone before the child starts (``... | head``)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return _run_child(mode, tmp_path, stdout=write_end)
    finally:
        os.close(write_end)


def _restored_step(root: Path) -> int | None:
    with cp.CheckpointPipeline(root) as pipe:
        restored = pipe.restore_latest({"w": torch.zeros(64)})
    return None if restored is None else restored.step


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_unconfigured_library_prints_nothing(tmp_path: Path) -> None:
    proc, result = _run_child("silent", tmp_path)
    assert result == "ok 5\n", proc.stderr.decode()
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == b""
    assert b"ckpt." not in proc.stderr, proc.stderr.decode()


@pytest.mark.timeout(60)
def test_standard_logging_level_controls_the_lines(root: Path) -> None:
    logger = logging.getLogger("ckpt_pipeline")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    previous = logger.level
    try:
        for level, step in ((logging.WARNING, 1), (logging.INFO, 2), (logging.DEBUG, 3)):
            logger.setLevel(level)
            start = stream.tell()
            with cp.CheckpointPipeline(root) as pipe:
                pipe.save(step, {"x": torch.ones(4)}).result(30)
            lines = stream.getvalue()[start:].splitlines()
            events = [line.split(" ", 1)[0] for line in lines]
            if level == logging.WARNING:
                assert events == []
            elif level == logging.INFO:
                assert "ckpt.commit.done" in events
                assert "ckpt.seal.done" not in events and "ckpt.save.requested" not in events
            else:
                for name in ("ckpt.save.requested", "ckpt.write_data.done", "ckpt.seal.done",
                             "ckpt.commit.done"):
                    assert name in events, lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@pytest.mark.timeout(60)
def test_log_lines_carry_the_event_and_plain_numbers(root: Path) -> None:
    with capture_logs(logging.INFO) as logs, cp.CheckpointPipeline(root) as pipe:
        pipe.save(7, {"x": torch.ones(4)}).result(30)
    committed = next(entry for entry in logs if entry["event"] == "ckpt.commit.done")
    assert committed["step"] == 7 and committed["rank"] == 0 and committed["bytes"] > 0
    stream = io.StringIO()
    handler = cp.enable_logging(logging.INFO, stream=stream)
    try:
        with cp.CheckpointPipeline(root) as pipe:
            pipe.save(8, {"x": torch.ones(4)}).result(30)
    finally:
        logging.getLogger("ckpt_pipeline").removeHandler(handler)
        logging.getLogger("ckpt_pipeline").setLevel(logging.NOTSET)
        logging.getLogger("ckpt_pipeline").propagate = True
    line = next(line for line in stream.getvalue().splitlines() if "ckpt.commit.done" in line)
    assert " step=8 " in line and "rank=0" in line
    assert "e-0" not in line, f"float noise in {line!r}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["stdout-basic", "stdout-enabled"])
@pytest.mark.slow
def test_saves_commit_when_stdout_is_a_closed_pipe(mode: str, tmp_path: Path) -> None:
    proc, result = _run_child_with_closed_stdout(mode, tmp_path)
    assert result == "ok 5\n", proc.stderr.decode()[-3000:]
    assert _restored_step(tmp_path / "ckpt") == 5
    if mode == "stdout-enabled":  # our handler reports its failure once, not per line
        assert proc.stderr.decode().count("writing a log line failed") == 1, proc.stderr


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_saves_commit_when_the_log_file_is_on_a_full_disk(tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    proc, result = _run_child("full-disk", tmp_path)
    assert result == "ok 5\n", proc.stderr.decode()[-3000:]
    assert _restored_step(tmp_path / "ckpt") == 5


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_raising_handler_and_subscriber_are_reported_once(tmp_path: Path) -> None:
    proc, result = _run_child("raising-handler", tmp_path)
    assert result == "ok 5\n", proc.stderr.decode()[-3000:]
    assert proc.returncode == 0
    stderr = proc.stderr.decode()
    assert stderr.count("ckpt_pipeline: logging failed (RuntimeError") == 1, stderr
    assert _restored_step(tmp_path / "ckpt") == 5
