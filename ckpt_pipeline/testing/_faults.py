"""Storages that misbehave on demand: injected errors, short writes, a full disk, a held write.

``FaultyStorage`` is the real local storage whose calls fail when armed: ``arm(Fault(call, at,
errno))`` fails the ``at``-th call of a kind after arming (optionally only among the calls about
files whose name ends with ``Fault.name``), a short write writes half and fails, ``free_bytes``
with ``ENOSPC`` reports a full disk. Reads count too: the persistent tier's uploads read
through ``open_read`` and ``pread_into``, its downloads write through ``truncate`` and
``pwrite``. ``GatedStorage`` is a ``FaultyStorage`` that holds the
creation of every shard (by default) until its ``gate`` is set, so that a save stays in flight
for as long as a test needs.
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
from collections import Counter
from dataclasses import dataclass

from ..errors import StorageError
from ..storage import LocalStorage

__all__ = ("CALLS", "Fault", "FaultyStorage", "GatedStorage")

CALLS = ("make_dir", "create_temp", "open_direct", "pwrite", "truncate", "fsync", "close",
         "publish", "fsync_dir", "open_read", "pread_into", "copy_out", "unlink", "rmdir",
         "move", "free_bytes")
"""The calls of ``FaultyStorage`` that a ``Fault`` can name."""


@dataclass(frozen=True, slots=True)
class Fault:
    """Fail the ``at``-th call (1-based, counted from arming) of kind ``call``."""

    call: str
    at: int
    errno: int = errno_mod.EIO
    short_write: bool = False
    """For ``pwrite``: write half the bytes, then fail (a torn write)."""
    name: str = ""
    """When set, only the calls about a file or directory whose name ends with it count
    (``".commit"``: the commit records). For ``create_temp``, ``open_direct``, ``pwrite``,
    ``truncate``, ``fsync``, ``close`` and ``publish`` that is the final name the file is written
    for; for ``pread_into`` and ``copy_out`` the name of the file ``open_read`` opened; for the
    others the last component of the path (of the source, for ``move``); ``free_bytes`` is
    about no name."""


class FaultyStorage(LocalStorage):
    """LocalStorage whose calls can be made to fail on demand. Thread-safe."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._faults: list[Fault] = []
        self._hits: list[int] = []
        self._final: dict[str, str] = {}  # temporary name -> the final name it is written for
        self._fd_final: dict[int, str] = {}  # descriptor -> the (final) name of its file
        self.fired: list[Fault] = []

    def arm(self, *faults: Fault) -> None:
        """Start counting calls from zero and fail the ones named."""
        for fault in faults:
            if fault.call not in CALLS:
                raise ValueError(f"unknown call {fault.call!r}; one of {CALLS}")
        with self._lock:
            self._counts.clear()
            self._faults = list(faults)
            self._hits = [0] * len(faults)
            self.fired = []

    def disarm(self) -> None:
        """Fail nothing from now on (the counts go on)."""
        with self._lock:
            self._faults = []
            self._hits = []

    def calls(self) -> dict[str, int]:
        """Calls of each kind since the last ``arm``."""
        with self._lock:
            return dict(self._counts)

    def _check(self, call: str, name: str = "") -> Fault | None:
        with self._lock:
            self._counts[call] += 1
            for i, fault in enumerate(self._faults):
                if fault.call != call or not name.endswith(fault.name):
                    continue
                self._hits[i] += 1
                if fault.at == self._hits[i]:
                    self.fired.append(fault)
                    return fault
        return None

    def _raise(self, fault: Fault) -> None:
        raise StorageError(f"{fault.call} failed: injected "
                           f"{errno_mod.errorcode.get(fault.errno, fault.errno)}",
                           path=str(self.root), errno=fault.errno)

    def _file_of(self, fd: int) -> str:
        with self._lock:
            return self._fd_final.get(fd, "")

    def make_dir(self, rel: str) -> None:
        if (f := self._check("make_dir", os.path.basename(rel))) is not None:
            self._raise(f)
        super().make_dir(rel)

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        if (f := self._check("create_temp", final_name)) is not None:
            self._raise(f)
        fd, temp = super().create_temp(rel_dir, final_name)
        with self._lock:
            self._final[os.path.join(rel_dir, temp)] = final_name
            self._fd_final[fd] = final_name
        return fd, temp

    def open_direct(self, rel_dir: str, temp_name: str) -> int | None:
        with self._lock:
            final = self._final.get(os.path.join(rel_dir, temp_name), temp_name)
        if (f := self._check("open_direct", final)) is not None:
            self._raise(f)
        fd = super().open_direct(rel_dir, temp_name)
        if fd is not None:
            with self._lock:
                self._fd_final[fd] = final
        return fd

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        if (f := self._check("pwrite", self._file_of(fd))) is not None:
            if f.short_write and len(data) > 1:
                super().pwrite(fd, data[:len(data) // 2], offset)
            self._raise(f)
        super().pwrite(fd, data, offset)

    def truncate(self, fd: int, size: int) -> None:
        if (f := self._check("truncate", self._file_of(fd))) is not None:
            self._raise(f)
        super().truncate(fd, size)

    def fsync(self, fd: int) -> None:
        if (f := self._check("fsync", self._file_of(fd))) is not None:
            self._raise(f)
        super().fsync(fd)

    def close(self, fd: int) -> None:
        with self._lock:
            final = self._fd_final.pop(fd, "")
        if (f := self._check("close", final)) is not None:
            os.close(fd)  # the descriptor is gone either way, as with a real failed close
            self._raise(f)
        super().close(fd)

    def publish(self, rel_dir: str, temp_name: str, final_name: str) -> None:
        with self._lock:
            self._final.pop(os.path.join(rel_dir, temp_name), None)
        if (f := self._check("publish", final_name)) is not None:
            self._raise(f)
        super().publish(rel_dir, temp_name, final_name)

    def fsync_dir(self, rel: str) -> None:
        if (f := self._check("fsync_dir", os.path.basename(rel))) is not None:
            self._raise(f)
        super().fsync_dir(rel)

    def open_read(self, rel: str, expected_size: int | None = None) -> tuple[int, int]:
        name = os.path.basename(rel)
        if (f := self._check("open_read", name)) is not None:
            self._raise(f)
        fd, size = super().open_read(rel, expected_size)
        with self._lock:
            self._fd_final[fd] = name
        return fd, size

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> None:
        if (f := self._check("pread_into", self._file_of(fd))) is not None:
            self._raise(f)
        super().pread_into(fd, buf, offset)

    def copy_out(self, fd: int, out: int, start: int, end: int) -> bool:
        if (f := self._check("copy_out", self._file_of(fd))) is not None:
            self._raise(f)
        return super().copy_out(fd, out, start, end)

    def unlink(self, rel: str) -> None:
        with self._lock:
            self._final.pop(rel, None)
        if (f := self._check("unlink", os.path.basename(rel))) is not None:
            self._raise(f)
        super().unlink(rel)

    def rmdir(self, rel: str) -> None:
        if (f := self._check("rmdir", os.path.basename(rel))) is not None:
            self._raise(f)
        super().rmdir(rel)

    def move(self, rel_src: str, rel_dst: str) -> None:
        if (f := self._check("move", os.path.basename(rel_src))) is not None:
            self._raise(f)
        super().move(rel_src, rel_dst)

    def free_bytes(self) -> int:
        if (f := self._check("free_bytes")) is not None:
            return 0 if f.errno == errno_mod.ENOSPC else super().free_bytes()
        return super().free_bytes()


class GatedStorage(FaultyStorage):
    """A ``FaultyStorage`` that holds the creation of some files until ``gate`` is set.

    Every ``create_temp`` for a final name ending with ``suffix`` (default ``".shard"``: the
    data of every save) sets ``entered``, then waits for ``gate`` (at most ``timeout``
    seconds) before it creates the file: the save stays in flight, its host buffer taken,
    until the test sets the gate. Both are ``threading.Event``s: clear them to hold the next
    save too. Faults can be armed as on any ``FaultyStorage``.
    """

    def __init__(self, root: str | os.PathLike[str], *, suffix: str = ".shard",
                 timeout: float = 60.0) -> None:
        super().__init__(root)
        self.suffix = suffix
        self.timeout = timeout
        self.gate = threading.Event()
        """Set: files are created at once. Clear (at first): their creation waits."""
        self.entered = threading.Event()
        """Set when a held creation began (whether or not it still waits)."""

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        if final_name.endswith(self.suffix):
            self.entered.set()
            self.gate.wait(self.timeout)
        return super().create_temp(rel_dir, final_name)
