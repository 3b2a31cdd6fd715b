"""The power switch of ``PowerLossStorage``: the storage calls made since ``arm()``, and the
moment the power goes off.

Every call of the storage, reads included, is counted and logged as a ``StorageCall``; the
trigger chosen at arming (the k-th call, or the first call a predicate picks) or an explicit
``cut()`` turns the power off, and from then on every call raises ``PowerCut``. The switch
holds no lock of its own: the storage calls it under its lock.
"""

from __future__ import annotations

import errno as errno_mod
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import StorageError

__all__ = ("PowerCut", "PowerSwitch", "StorageCall")


class PowerCut(StorageError):
    """The simulated power is off: every storage call fails from the cut on (errno EIO)."""


@dataclass(frozen=True, slots=True)
class StorageCall:
    """One storage call seen after ``arm()``."""

    index: int
    """1-based, counted from ``arm()``; every call counts, reads included."""
    kind: str
    """The ``Storage`` method (``make_dir``'s own ``fsync_dir`` is a call of its own)."""
    path: str
    """Relative to the root: the file or directory the call is about. For calls on a
    descriptor, the path the file had when it was created or opened."""
    name: str
    """For calls on a file being written and for ``publish``: the final name it is for."""
    thread: int
    """``threading.get_ident()`` of the calling thread."""


class PowerSwitch:
    """Counts calls and cuts the power (see the module docstring). ``where(path)`` is what a
    ``PowerCut`` names as its path (the storage's absolute path of a root-relative one)."""

    def __init__(self, where: Callable[[str], str]) -> None:
        self._where = where
        self.armed = False
        self.is_cut = False
        self.cut_call: StorageCall | None = None
        """The call refused first (None when ``cut()`` was called, or before the cut)."""
        self._cut_at: int | None = None
        self._cut_if: Callable[[StorageCall], bool] | None = None
        self._index = 0
        self._log: list[StorageCall] = []

    def arm(self, cut_at: int | None, cut_if: Callable[[StorageCall], bool] | None) -> None:
        """Count from zero, with the power on, and cut at the trigger given."""
        if cut_at is not None and cut_at < 1:
            raise ValueError("cut_at counts calls from 1")
        self._index = 0
        self._log = []
        self.is_cut = False
        self.cut_call = None
        self._cut_at = cut_at
        self._cut_if = cut_if
        self.armed = True

    def cut(self) -> None:
        """The power goes off now."""
        self.is_cut = True

    def calls(self) -> list[StorageCall]:
        """The calls made since ``arm()`` (not the refused ones), in order."""
        return list(self._log)

    def begin(self, kind: str, path: str, name: str = "") -> None:
        """Count a call; raise ``PowerCut`` if the power is or goes off now."""
        if not self.armed:
            return
        if self.is_cut:
            raise self.refusal(kind, path)
        self._index += 1
        call = StorageCall(self._index, kind, path, name, threading.get_ident())
        if (self._cut_at is not None and self._index >= self._cut_at) or (
            self._cut_if is not None and self._cut_if(call)
        ):
            self.is_cut = True
            self.cut_call = call
            raise self.refusal(kind, path)
        self._log.append(call)

    def refusal(self, kind: str, path: str) -> PowerCut:
        """The error of a call made while the power is off."""
        return PowerCut(f"{kind} failed: the power is off (simulated power cut)",
                        path=path if path.startswith("<") else self._where(path),
                        errno=errno_mod.EIO)
