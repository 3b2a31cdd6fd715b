"""Failed saves are never silent: without a logging set-up each one is a CheckpointWarning.

The library logs a failed save as the ERROR line ``ckpt.save.failed``; an application that
configured no logging (the library's ``NullHandler`` only) sees no line, so the failure is also
issued through ``warnings``, once per failed save, from the pipeline's thread. Where a handler
shows the line, no warning repeats it. A warnings filter applies as to any warning, and one that
turns it into an exception never breaks the pipeline.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import Fault, FaultyStorage
from tests._support.children import run_child

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def _unlogged() -> Iterator[list[warnings.WarningMessage]]:
    """The library's records reach no handler but its NullHandler, as in an application that
    configured no logging (pytest's capture handlers are set aside while it lasts; the child
    process of the last test has no logging set-up at all); the warnings issued are recorded."""
    lib = logging.getLogger("ckpt_pipeline")
    saved = lib.handlers, lib.propagate
    lib.handlers = [h for h in lib.handlers if isinstance(h, logging.NullHandler)]
    lib.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            yield caught
    finally:
        lib.handlers, lib.propagate = saved


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _checkpoint_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, cp.CheckpointWarning)]


def _fail_save(pipe: cp.CheckpointPipeline, storage: FaultyStorage, step: int
               ) -> cp.CheckpointError:
    storage.arm(Fault("free_bytes", 1, errno.ENOSPC))  # the disk reports itself full
    error = pipe.save(step, {"w": torch.full((16,), float(step))}).exception(30)
    assert isinstance(error, cp.StorageError), error
    return error


def test_each_failed_save_warns_once_naming_step_rank_path_and_what_to_do(root: Path) -> None:
    storage = FaultyStorage(root)
    with _unlogged() as recorded, cp.CheckpointPipeline(root, storage=storage,
                                                        max_failures_in_row=3) as pipe:
        pipe.save(1, {"w": torch.ones(16)}).result(30)
        assert _checkpoint_warnings(recorded) == []
        errors = [_fail_save(pipe, storage, step) for step in (2, 3, 4)]
        with pytest.raises(cp.SaveError, match="3 saves in a row failed"):
            pipe.save(5, {"w": torch.ones(16)})
    messages = _checkpoint_warnings(recorded)
    assert len(messages) == 3, messages
    for n, (step, message, error) in enumerate(zip((2, 3, 4), messages, errors), start=1):
        assert f"the save of step {step} failed on rank 0" in message
        assert str(root) in message and str(error) in message
        assert "newest committed step, 1, is intact" in message
        assert ("the next save() raises once 3 saves in a row have failed "
                f"(max_failures_in_row; {n} so far)") in message


def test_no_warning_repeats_a_failure_that_a_logging_handler_shows(root: Path) -> None:
    handler = _Records()
    storage = FaultyStorage(root)
    with _unlogged() as recorded:
        logging.getLogger("ckpt_pipeline").addHandler(handler)  # the application's set-up
        with cp.CheckpointPipeline(root, storage=storage) as pipe:
            _fail_save(pipe, storage, 1)
    assert _checkpoint_warnings(recorded) == []
    failed = [r for r in handler.records if getattr(r, "ckpt_event", "") == "ckpt.save.failed"]
    assert [r.levelno for r in failed] == [logging.ERROR]


def test_the_warning_is_filtered_like_any_warning(root: Path) -> None:
    storage = FaultyStorage(root)
    with _unlogged() as recorded:
        warnings.filterwarnings("ignore", category=cp.CheckpointWarning)
        with cp.CheckpointPipeline(root, storage=storage) as pipe:
            _fail_save(pipe, storage, 1)
            warnings.resetwarnings()
            warnings.simplefilter("default")
            _fail_save(pipe, storage, 2)
    assert [m.split(" failed")[0] for m in _checkpoint_warnings(recorded)] == [
        "ckpt_pipeline: the save of step 2"]


def test_a_warning_turned_into_an_error_does_not_break_the_pipeline(root: Path) -> None:
    storage = FaultyStorage(root)
    with _unlogged(), cp.CheckpointPipeline(root, storage=storage) as pipe:
        warnings.simplefilter("error", cp.CheckpointWarning)  # as under -W error
        error = _fail_save(pipe, storage, 1)  # the handle holds the save's own error
        with pytest.raises(cp.StorageError) as info:
            pipe.wait(30)
        assert info.value is error
        assert pipe.save(2, {"w": torch.ones(16)}).result(30).step == 2
    with cp.CheckpointPipeline(root) as pipe:
        restored = pipe.restore_latest({"w": torch.zeros(16)})
    assert restored is not None and restored.step == 2


def test_a_raising_showwarning_does_not_break_the_pipeline(root: Path) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("stderr is gone")

    storage = FaultyStorage(root)
    with _unlogged(), cp.CheckpointPipeline(root, storage=storage) as pipe:
        warnings.showwarning = broken  # restored by the catch_warnings of _unlogged
        _fail_save(pipe, storage, 1)
        assert pipe.save(2, {"w": torch.ones(16)}).result(30).step == 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_readme_loop_with_default_logging_prints_every_failed_save(tmp_path: Path) -> None:
    result = tmp_path / "result"
    proc = run_child("logging_child.py", "failing-saves", tmp_path / "ckpt", result,
                     timeout=120)
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert result.read_text() == "raised 5\n", stderr
    lines = [line for line in stderr.splitlines() if "CheckpointWarning" in line]
    assert len(lines) == 3, stderr
    for step, line in zip((2, 3, 4), lines):
        assert f"the save of step {step} failed on rank 0" in line
        assert "not enough free space" in line
    assert proc.stdout == b""
