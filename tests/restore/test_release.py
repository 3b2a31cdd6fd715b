"""Releasing an applied restore: the copies are freed, off the caller's thread when large."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch

from ckpt_pipeline._restore import rollback
from ckpt_pipeline._restore.backups import Backup, BackupCopies, TensorBackup
from ckpt_pipeline._restore.rollback import _FREE_IN_THREAD_BYTES, AppliedState


def _released(nbytes: int) -> tuple[weakref.ref[torch.Tensor], set[threading.Thread]]:
    live = torch.ones(nbytes // 4)
    entry = TensorBackup(live, "t", BackupCopies())
    old = weakref.ref(entry.old)
    before = set(threading.enumerate())
    applied = AppliedState([entry], step=3, rank=0)
    del entry
    applied.release()
    return old, set(threading.enumerate()) - before


def test_large_copies_are_freed_by_a_thread_of_their_own(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    freed_on: list[str] = []
    free = rollback._free

    def recorded(journal: list[Backup]) -> None:
        freed_on.append(threading.current_thread().name)
        free(journal)

    monkeypatch.setattr(rollback, "_free", recorded)
    old, started = _released(_FREE_IN_THREAD_BYTES)
    for thread in started:
        thread.join(timeout=30)
    assert freed_on == ["ckpt-restore-release"]
    assert old() is None


def test_small_copies_are_freed_on_the_spot() -> None:
    old, started = _released(1 << 20)
    assert not started
    assert old() is None


def test_an_undo_after_release_changes_nothing() -> None:
    live = torch.ones(16)
    applied = AppliedState([TensorBackup(live, "t", BackupCopies())], step=3, rank=0)
    live.fill_(2.0)
    applied.release()
    applied.undo()
    assert torch.equal(live, torch.full((16,), 2.0))
