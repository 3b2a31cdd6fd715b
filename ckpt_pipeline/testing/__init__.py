"""Helpers for testing code that checkpoints: a storage that injects faults, and crash points.

``FaultyStorage`` wraps the real local storage and fails the Nth call of a kind (``pwrite``,
``fsync``, ``publish``, ``make_dir``, ...) with an errno of your choice, or makes a write short.
Crash points: the pipeline calls ``crash_point(label)`` at labelled moments of save, commit,
retention and scrub (``CRASH_POINTS``); when the environment variable ``CKPT_PIPELINE_CRASH_AT``
arms a label, the process kills itself with SIGKILL there (use it in a child process). The value
is ``<label>`` (the first time the label is reached) or ``<label>:<N>`` (the N-th time, N >= 1;
``write.done:3`` dies during the third save after arming). Hits are counted per label, in the
process, from when the variable names that label; a malformed value or an unknown label makes
``crash_point`` raise ValueError instead of silently never crashing.

``PowerLossStorage`` simulates a power loss: the real local storage plus a model of what each
``fsync`` and ``fsync_dir`` made durable. ``arm(cut_at=k)`` (or ``cut_if=``, or ``cut()`` from
any thread) turns the power off at a storage call: from then on every call raises ``PowerCut``.
``materialize(dest, rng)`` then writes one possible post-crash disk image: the durable state
plus a random subset of the volatile directory changes (creates, links, unlinks, renames) and
of the writes since each file's last fsync (kept, dropped or torn). See ``_powerloss.py``.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._crash import CRASH_ENV as CRASH_ENV
from .._crash import CRASH_POINTS as CRASH_POINTS
from .._crash import crash_point as crash_point
from .._logging import LOGGER_NAME
from ..errors import StorageError
from ..storage import LocalStorage
from ._powerloss import CrashImage as CrashImage
from ._powerloss import PowerCut as PowerCut
from ._powerloss import PowerLossStorage as PowerLossStorage
from ._powerloss import StorageCall as StorageCall
from ._powerloss import VolatileChange as VolatileChange

__all__ = ("CRASH_ENV", "CRASH_POINTS", "CrashImage", "Fault", "FaultyStorage", "PowerCut",
           "PowerLossStorage", "StorageCall", "VolatileChange", "capture_logs", "crash_point")

@contextlib.contextmanager
def capture_logs(level: int = logging.DEBUG) -> Iterator[list[dict[str, Any]]]:
    """Collect the library's log lines as dicts (``event``, ``log_level`` and the fields).

    Like ``structlog.testing.capture_logs``, for the ``ckpt_pipeline`` logger: it lowers the
    logger's level to ``level`` for the duration and restores it afterwards.
    """
    logger = logging.getLogger(LOGGER_NAME)
    entries: list[dict[str, Any]] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record, "ckpt_fields", None)
            entries.append({"event": getattr(record, "ckpt_event", record.getMessage()),
                            "log_level": record.levelname.lower(),
                            **(fields if isinstance(fields, dict) else {})})

    handler = _Collect(level)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield entries
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


CALLS = ("make_dir", "create_temp", "open_direct", "pwrite", "fsync", "close", "publish",
         "fsync_dir", "unlink", "rmdir", "move", "free_bytes")


@dataclass(frozen=True, slots=True)
class Fault:
    """Fail the ``at``-th call (1-based, counted from arming) of kind ``call``."""

    call: str
    at: int
    errno: int = errno_mod.EIO
    short_write: bool = False
    """For ``pwrite``: write half the bytes, then fail (a torn write)."""


class FaultyStorage(LocalStorage):
    """LocalStorage whose calls can be made to fail on demand. Thread-safe."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._faults: list[Fault] = []
        self.fired: list[Fault] = []

    def arm(self, *faults: Fault) -> None:
        """Start counting calls from zero and fail the ones named."""
        for fault in faults:
            if fault.call not in CALLS:
                raise ValueError(f"unknown call {fault.call!r}; one of {CALLS}")
        with self._lock:
            self._counts.clear()
            self._faults = list(faults)
            self.fired = []

    def disarm(self) -> None:
        with self._lock:
            self._faults = []

    def calls(self) -> dict[str, int]:
        """Calls of each kind since the last ``arm``."""
        with self._lock:
            return dict(self._counts)

    def _check(self, call: str) -> Fault | None:
        with self._lock:
            self._counts[call] += 1
            for fault in self._faults:
                if fault.call == call and fault.at == self._counts[call]:
                    self.fired.append(fault)
                    return fault
        return None

    def _raise(self, fault: Fault) -> None:
        err = StorageError(f"{fault.call} failed: injected "
                           f"{errno_mod.errorcode.get(fault.errno, fault.errno)}",
                           path=str(self.root), errno=fault.errno)
        raise err

    def make_dir(self, rel: str) -> None:
        if (f := self._check("make_dir")) is not None:
            self._raise(f)
        super().make_dir(rel)

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        if (f := self._check("create_temp")) is not None:
            self._raise(f)
        return super().create_temp(rel_dir, final_name)

    def open_direct(self, rel_dir: str, temp_name: str) -> int | None:
        if (f := self._check("open_direct")) is not None:
            self._raise(f)
        return super().open_direct(rel_dir, temp_name)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        if (f := self._check("pwrite")) is not None:
            if f.short_write and len(data) > 1:
                super().pwrite(fd, data[:len(data) // 2], offset)
            self._raise(f)
        super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        if (f := self._check("fsync")) is not None:
            self._raise(f)
        super().fsync(fd)

    def close(self, fd: int) -> None:
        if (f := self._check("close")) is not None:
            os.close(fd)  # the descriptor is gone either way, as with a real failed close
            self._raise(f)
        super().close(fd)

    def publish(self, rel_dir: str, temp_name: str, final_name: str) -> None:
        if (f := self._check("publish")) is not None:
            self._raise(f)
        super().publish(rel_dir, temp_name, final_name)

    def fsync_dir(self, rel: str) -> None:
        if (f := self._check("fsync_dir")) is not None:
            self._raise(f)
        super().fsync_dir(rel)

    def unlink(self, rel: str) -> None:
        if (f := self._check("unlink")) is not None:
            self._raise(f)
        super().unlink(rel)

    def rmdir(self, rel: str) -> None:
        if (f := self._check("rmdir")) is not None:
            self._raise(f)
        super().rmdir(rel)

    def move(self, rel_src: str, rel_dst: str) -> None:
        if (f := self._check("move")) is not None:
            self._raise(f)
        super().move(rel_src, rel_dst)

    def free_bytes(self) -> int:
        if (f := self._check("free_bytes")) is not None:
            return 0 if f.errno == errno_mod.ENOSPC else super().free_bytes()
        return super().free_bytes()
