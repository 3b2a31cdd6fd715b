"""One job per checkpoint root and rank: an advisory lock taken when a pipeline opens.

Why: two live processes saving into the same root and rank (a duplicated job, or a requeued
job whose old copy is still running) corrupt each other's view of it: one's start-up recovery
moves aside steps that the other has acknowledged. Nothing on disk tells them apart, so the
second opener must be refused before it touches anything.

What: each rank holds ``fcntl.flock(LOCK_EX | LOCK_NB)`` on its own file in the root,
``.lock-rank-NNNNN`` (a name that no step-directory, rank-file or temporary pattern of
``_format`` matches, so recovery, retention and the CLI never see it). The holder writes a JSON
record (pid, host, start time, rank, root) into it, so that a refused opener can say who holds
the root (``RootInUseError``). The descriptor stays open for the pipeline's lifetime.

- A holder that dies (even by SIGKILL) loses the lock: the kernel releases a ``flock`` when
  the last descriptor of its open file description is closed. The next opener takes it over
  and overwrites the record (logged at INFO, ``ckpt.lock.taken_over``, when the record left
  behind shows that the previous holder never released it).
- A forked child inherits the descriptor, and with it the lock, which would outlive the parent
  (a DataLoader worker, say). An ``os.register_at_fork`` hook closes, in the child, every lock
  descriptor of the parent; that leaves the parent's lock held (it is one open file
  description, still open in the parent). ``O_CLOEXEC`` does the same for ``exec``.
- ``release()`` truncates the record, unlocks and closes; it never unlinks the file (removing
  it could remove a file that another process has meanwhile opened and locked).
- Where ``flock`` does not exist (not POSIX) or the file system refuses it (``ENOLCK``,
  ``EOPNOTSUPP``/``ENOTSUP``, ``EINVAL``, ``ENOSYS``: some network or cluster file systems), the
  open is not failed: a warning is logged on the ``ckpt_pipeline`` logger and the returned lock
  protects nothing. docs/reliability.md ("One job per root: the lock") covers network file
  systems.

The lock is advisory: it stops other pipelines, not other programs writing into the root.
Messages go through the library's log (``_logging``: stdlib ``logging``, logger
``ckpt_pipeline``, silent unless the application configures logging); nothing is printed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import threading
import time
import weakref
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .._logging import log
from ..errors import RootInUseError, StorageError, UnsafeRootError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    _HAVE_FLOCK = False
else:
    _HAVE_FLOCK = True

__all__ = ("RootLock",)

LOCK_PREFIX = ".lock-rank-"
"""Lock file name: this prefix and the rank in five or more digits (``.lock-rank-00000``)."""

_RECORD_LIMIT = 64 * 1024  # bytes of a holder record read back; a real one is ~200 bytes

_UNSUPPORTED = frozenset(
    code for code in (
        errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP),
        errno.EINVAL, errno.ENOSYS,
    )
)
"""``flock`` errors that mean the file system cannot lock: the open goes on unprotected."""

_HINT = ("stop the other job, or give this one another checkpoint root; on a network file "
         "system see docs/reliability.md, 'One job per root: the lock'")

# Every lock held by this process, for the fork hook; ``_live_guard`` is held across fork()
# so that a child never sees the set half-updated by another thread.
_live: weakref.WeakSet[RootLock] = weakref.WeakSet()
_live_guard = threading.Lock()
_fork_hook_registered = False


def lock_file_name(rank: int) -> str:
    """The name of ``rank``'s lock file in the root."""
    return f"{LOCK_PREFIX}{rank:05d}"


class RootLock:
    """The lock of one rank on one checkpoint root; ``acquire`` it, ``release`` it at close.

    A lock returned where the file system cannot lock protects nothing (see the module's
    docstring); ``release`` is then a no-op as well.
    """

    __slots__ = ("__weakref__", "_fd", "_guard", "_path", "_rank")

    def __init__(self, path: Path, rank: int, fd: int | None) -> None:
        self._path = path
        self._rank = rank
        self._fd = fd
        self._guard = threading.Lock()

    @classmethod
    def acquire(cls, root: Path, rank: int) -> RootLock:
        """Lock ``rank``'s lock file in ``root`` (which must exist), or raise RootInUseError.

        Raises UnsafeRootError when the lock path is a symlink or not a regular file of its
        own, and StorageError when the file cannot be opened or written.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        path = Path(root) / lock_file_name(rank)
        if not _HAVE_FLOCK:  # pragma: no cover - not POSIX
            _warn_unprotected(path, rank, "fcntl.flock is not available on this platform")
            return cls(path, rank, None)
        _register_fork_hook()
        # Opened, locked and registered for the fork hook with no fork() in between: a child
        # forked by another thread meanwhile would otherwise inherit an unregistered lock.
        refused: str | None = None
        with _live_guard:
            fd = _open_lock_file(path, rank)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    error = _in_use(fd, path, rank)
                finally:
                    os.close(fd)
                raise error from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _UNSUPPORTED:
                    raise StorageError(
                        f"locking the checkpoint root failed: {exc.strerror or exc}",
                        rank=rank, path=path, errno=exc.errno) from exc
                name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
                refused = f"the file system refused flock ({name}: {exc.strerror})"
            else:
                lock = cls(path, rank, fd)
                _live.add(lock)
        if refused is not None:
            _warn_unprotected(path, rank, refused)
            return cls(path, rank, None)
        try:
            previous = _read_record(fd)
            _write_record(fd, path, rank, Path(root))
        except BaseException:
            lock.release()
            raise
        if previous is not None and (previous.get("pid"), previous.get("host")) != (
                os.getpid(), socket.gethostname()):
            # The record is emptied by release(): one left means its holder died holding it.
            log.info("ckpt.lock.taken_over", rank=rank, path=str(path),
                     previous_holder=_describe(previous),
                     hint="the previous holder did not release the lock (it died); this "
                          "process took it over")
        return lock

    def release(self) -> None:
        """Unlock and close the file (it stays, emptied). Idempotent."""
        with _live_guard, self._guard:
            fd, self._fd = self._fd, None
            _live.discard(self)
        if fd is None:
            return
        # A child forked from here on inherits the descriptor unregistered; the explicit
        # unlock below releases the lock for its copy too (one open file description).
        try:
            with contextlib.suppress(OSError):  # empty: released, not left by a dead holder
                os.ftruncate(fd, 0)
            if _HAVE_FLOCK:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptor; the parent's lock stays held."""
        fd, self._fd = self._fd, None
        self._guard = threading.Lock()  # the parent's may have been held at fork
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        # Dropped without release(): nothing else can release it, so do it now. Only the
        # descriptor is touched (no lock is taken: a collection may run anywhere); the
        # WeakSet forgets this object by itself.
        fd = getattr(self, "_fd", None)
        if fd is None:
            return
        self._fd = None
        with contextlib.suppress(OSError):
            if _HAVE_FLOCK:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __repr__(self) -> str:
        held = "unprotected" if self._fd is None else "held"
        return f"RootLock({str(self._path)!r}, rank={self._rank}, {held})"


# ---------------------------------------------------------------------- helpers


def _open_lock_file(path: Path, rank: int) -> int:
    """Open (create, 0600) the lock file without following a symlink; refuse anything odd."""
    flags = (os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
             | getattr(os, "O_NONBLOCK", 0))  # O_NONBLOCK: a FIFO planted there cannot hang us
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:  # checked before opening, so that a device or FIFO is never even opened
        _check_entry(st, path, rank, opened=False)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) or os.path.islink(path):
            raise UnsafeRootError("the checkpoint root's lock file is a symlink", rank=rank,
                                  path=path, hint="remove the symlink; the pipeline creates "
                                                  "its lock file itself") from exc
        if exc.errno == errno.EISDIR:
            raise UnsafeRootError("the checkpoint root's lock file is not a regular file",
                                  rank=rank, path=path,
                                  hint="remove what stands there") from exc
        raise StorageError(f"opening the lock file failed: {exc.strerror or exc}", rank=rank,
                           path=path, errno=exc.errno,
                           hint="check the permissions of the checkpoint root") from exc
    try:
        _check_entry(os.fstat(fd), path, rank, opened=True)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_entry(st: os.stat_result, path: Path, rank: int, *, opened: bool) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeRootError("the checkpoint root's lock file is a symlink", rank=rank,
                              path=path, hint="remove the symlink; the pipeline creates its "
                                              "lock file itself")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeRootError("the checkpoint root's lock file is not a regular file",
                              rank=rank, path=path, hint="remove what stands there")
    if opened and st.st_nlink != 1:
        # Truncating it would truncate the other names' file too.
        raise UnsafeRootError(f"the checkpoint root's lock file has {st.st_nlink} links, "
                              "not 1", rank=rank, path=path,
                              hint="remove it; the pipeline creates its lock file itself")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise UnsafeRootError(f"the checkpoint root's lock file is owned by uid {st.st_uid}, "
                              "not by this user", rank=rank, path=path,
                              hint="remove it, or use a checkpoint root of your own")


def _write_record(fd: int, path: Path, rank: int, root: Path) -> None:
    now = time.time()
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_unix": now,
        "started_utc": datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "rank": rank,
        "root": str(root),
    }
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        os.ftruncate(fd, 0)
        done = 0
        while done < len(data):
            n = os.pwrite(fd, data[done:], done)
            if n <= 0:
                raise OSError(errno.EIO, "write made no progress")
            done += n
        os.fsync(fd)
    except OSError as exc:
        raise StorageError(f"writing the lock file failed: {exc.strerror or exc}", rank=rank,
                           path=path, errno=exc.errno) from exc


def _read_record(fd: int) -> dict[str, Any] | None:
    """The holder record in the file, or None when it is empty, unreadable or malformed."""
    try:
        data = os.pread(fd, _RECORD_LIMIT, 0)
        record = json.loads(data.decode("utf-8")) if data.strip() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _describe(record: dict[str, Any]) -> str:
    """``pid 123 on host node7 since 2025-01-02T03:04:05Z``, from a holder record."""
    pid, host, since = record.get("pid"), record.get("host"), record.get("started_utc")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(host, str):
        return "holder unknown (its record could not be read)"
    text = f"pid {pid} on host {host!r}"
    if isinstance(since, str):
        text += f" since {since}"
    return text


def _in_use(fd: int, path: Path, rank: int) -> RootInUseError:
    record = _read_record(fd)
    if record is None:
        holder = "holder unknown (its record could not be read, or is being written)"
    else:
        holder = _describe(record)
        if (record.get("pid"), record.get("host")) == (os.getpid(), socket.gethostname()):
            holder += " (this process: a pipeline on this root and rank is still open)"
    return RootInUseError(f"the checkpoint root is in use: rank {rank}'s lock is held by "
                          f"{holder}", rank=rank, path=path, hint=_HINT)


def _warn_unprotected(path: Path, rank: int, why: str) -> None:
    log.warning("ckpt.lock.unprotected", rank=rank, path=str(path), reason=why,
                hint="the root is opened without a lock: a second job on it would not be "
                     "stopped; prefer a node-local root, or one root per job")


def _before_fork() -> None:
    _live_guard.acquire()


def _after_fork_in_parent() -> None:
    _live_guard.release()


def _after_fork_in_child() -> None:
    try:
        for lock in list(_live):
            lock._forget_in_child()
        _live.clear()
    finally:
        _live_guard.release()


def _register_fork_hook() -> None:
    """Register the fork hooks once per process (the registration is inherited by children)."""
    global _fork_hook_registered
    with _live_guard:
        if _fork_hook_registered or not hasattr(os, "register_at_fork"):
            return
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                            after_in_child=_after_fork_in_child)
        _fork_hook_registered = True
