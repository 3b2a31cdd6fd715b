"""The pipeline settles a SaveHandle through its HandleControl; the handle only reads."""

from __future__ import annotations

import threading

import pytest

import ckpt_pipeline as cp
from ckpt_pipeline._save.control import HandleControl

INFO = cp.CommitInfo(step=3, rank=0, save_id="run-3", path="/r/step-3", bytes=10, seconds=0.1)


def test_the_first_outcome_stands_and_a_later_one_is_ignored() -> None:
    control = HandleControl(3, "run-3")
    assert not control.handle.done()
    control.resolve(INFO)
    control.fail(cp.SaveError("too late", step=3, rank=0))
    assert control.handle.done() and control.handle.result(0) is INFO
    assert repr(control.handle) == "SaveHandle(step=3, committed)"


def test_a_failed_save_raises_its_error_from_the_handle() -> None:
    control = HandleControl(3, "run-3")
    error = cp.SaveError("disk full", step=3, rank=0)
    control.fail(error)
    control.resolve(INFO)
    with pytest.raises(cp.SaveError, match="disk full"):
        control.handle.result(0)
    assert control.handle.exception(0) is error


def test_settled_comes_after_the_outcome_and_wakes_a_waiter() -> None:
    control = HandleControl(3, "run-3")
    assert not control.wait_settled(0)
    waiter = threading.Thread(target=control.wait_settled, args=(30,))
    waiter.start()
    control.resolve(INFO)
    assert not control.settled  # committed, retention still to run
    control.settle()
    waiter.join(30)
    assert not waiter.is_alive() and control.settled


def test_the_handle_has_no_way_to_settle_itself() -> None:
    handle = HandleControl(3, "run-3").handle
    for name in ("_resolve", "_fail", "_settled", "resolve", "fail", "settle"):
        assert not hasattr(handle, name), name
