"""An applied restore's journal, held until the restore completes, and undoing it.

``AppliedState`` holds the journal of an apply that succeeded (its entries: ``backups.py``):
``undo()`` puts the live state back as it was, in reverse order (another rank failed, the
final agreement failed), and ``release()`` frees the copies, in a thread of its own: handing a
state's size of memory back to the kernel takes tens of milliseconds (about 25 ms for 512 MiB
on the 2-core VM), which the restore's caller need not wait for. ``undone_on_error`` does one
or the other around the rest of a restore.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from ..errors import RestoreError
from .backups import Backup

__all__ = ("AppliedState", "undone_on_error")


class AppliedState:
    """A restore applied to the live state, with what it overwrote, until released."""

    def __init__(self, journal: list[Backup], *, step: int, rank: int | None) -> None:
        self._journal = journal
        self.step = step
        self.rank = rank

    @property
    def backup_bytes(self) -> int:
        """Memory held by the copies of what was overwritten (host, or the GPU's own where a
        GPU had room to spare)."""
        return sum(entry.nbytes for entry in self._journal)

    def release(self) -> None:
        """Keep what was applied; free the copies (in a background thread, an entry at a
        time, so that the caller's thread gets the interpreter between two frees)."""
        journal, self._journal = self._journal, []
        if sum(map(_held_bytes, journal)) < _FREE_IN_THREAD_BYTES:
            return
        threading.Thread(target=_free, args=(journal,), name="ckpt-restore-release",
                         daemon=True).start()
        del journal

    def undo(self, *, reason: str | None = None) -> None:
        """Put the live state back as it was, undoing every change in reverse order.

        Raises RestoreError if a change could not be undone (the others are undone still);
        ``reason``, why the restore is rolled back, goes into its message.
        """
        journal, self._journal = self._journal, []
        failed: list[str] = []
        first: BaseException | None = None
        for entry in reversed(journal):
            try:
                entry.undo()
            except Exception as exc:
                failed.append(f"{entry.path}: {type(exc).__name__}: {exc}")
                first = first or exc
        if failed:
            raise RestoreError(
                (f"{reason}; then " if reason else "")
                + f"rolling back the restore of step {self.step} failed for "
                f"{len(failed)} entr{'y' if len(failed) == 1 else 'ies'} ({'; '.join(failed)}):"
                " the live state is partly loaded", step=self.step, rank=self.rank,
                hint="do not train on this state: rebuild it, or restart the job") from first


_FREE_IN_THREAD_BYTES = 64 << 20
"""Copies smaller than this in all are freed on the caller's thread (a thread costs more)."""


def _held_bytes(entry: Backup) -> int:
    """The memory an entry keeps: its copies, or the old memory of a tensor that took the
    restored memory (``AdoptedBackup``, whose ``nbytes`` is 0: nothing was copied)."""
    old = getattr(entry, "old", None)
    if isinstance(old, torch.Tensor):
        return max(entry.nbytes, old.numel() * old.element_size())
    return entry.nbytes


def _free(journal: list[Backup]) -> None:
    time.sleep(0)  # lets go of the interpreter: ``start()`` returns before the first free
    while journal:
        journal.pop()


@contextlib.contextmanager
def undone_on_error(applied: AppliedState | None) -> Iterator[None]:
    """Around the rest of a restore after the apply: if it raises (another rank failed, a
    barrier, a cancellation), undo the apply on this thread; if it returns, keep it."""
    try:
        yield
    except BaseException as exc:
        if applied is not None:
            applied.undo(reason=f"the restore did not complete ({type(exc).__name__}: {exc})")
        raise
    if applied is not None:
        applied.release()
