"""The storage layer: every file-system call of the pipeline on a checkpoint root goes through it.

One small synchronous interface, called from worker threads, so that a test can replace it
with one that injects faults (short writes, ENOSPC, EIO on fsync, a crash at a given call).
The persistent tier's transfers are included (an upload reads through ``open_read``,
``pread_into`` and ``copy_out``, a download writes through ``truncate`` and ``pwrite``); its
requests to the store, a shared directory's included (``tier_dir``), are the tier's own.

Call order for publishing a file (the pipeline follows it; implementations need not check it):
``create_temp`` -> ``pwrite``... -> ``fsync`` -> ``close`` -> ``publish`` -> ``fsync_dir``.
``publish`` never replaces an existing file: committed files are never overwritten.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from .errors import StorageError, UnsafeRootError

__all__ = ("FileInfo", "LocalStorage", "RangeSource", "Storage")


@dataclass(frozen=True, slots=True)
class FileInfo:
    """What ``lstat`` says of an entry under the root."""

    name: str
    size: int
    is_file: bool
    is_dir: bool
    is_symlink: bool


@runtime_checkable
class Storage(Protocol):
    """File-system operations relative to one checkpoint root.

    Paths are relative to the root and made of names that the caller already matched against
    its strict patterns. File descriptors are plain ints owned by the caller until ``close``.
    """

    root: Path

    def ensure_root(self) -> None:
        """Create the root (0700) if missing; refuse a symlink or another user's directory."""

    def make_dir(self, rel: str) -> None:
        """Create a directory (0700) if missing, and fsync its parent when it was created."""

    def list_dir(self, rel: str) -> list[FileInfo]:
        """Entries of a directory, without following symlinks."""

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        """Create a new temporary file (0600) beside ``final_name``; return (fd, its name)."""

    def open_direct(self, rel_dir: str, temp_name: str) -> int | None:
        """Open a temporary file again for direct I/O (``O_DIRECT``, bypassing the page cache).

        Returns None when the platform or file system does not offer it. Writes through the
        descriptor must use aligned addresses, offsets and lengths; ``fsync`` of the file's
        other descriptor makes them durable.
        """

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (short writes are continued)."""

    def truncate(self, fd: int, size: int) -> None:
        """Set the size of a file being written (a download sizes its file up front, so that
        reads may start at any offset); bytes added read as zeros until written."""

    def fsync(self, fd: int) -> None:
        """Flush a file to stable storage."""

    def close(self, fd: int) -> None:
        """Close a descriptor."""

    def publish(self, rel_dir: str, temp_name: str, final_name: str) -> None:
        """Give a fully written, fsynced temp file its final name; fail if that name exists."""

    def fsync_dir(self, rel: str) -> None:
        """Flush a directory's entries."""

    def open_read(self, rel: str, expected_size: int | None = None) -> tuple[int, int]:
        """Open a regular file for reading without following symlinks; return (fd, size)."""

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` from ``offset``; a short file is an error."""

    def copy_out(self, fd: int, out: int, start: int, end: int) -> bool:
        """Copy bytes [start, end) of a file opened by ``open_read`` to the same offsets of
        ``out`` (outside the root) in the kernel. False where that is refused before any byte
        is copied: the caller then writes the bytes it reads itself."""

    def unlink(self, rel: str) -> None:
        """Remove a file (missing is not an error)."""

    def rmdir(self, rel: str) -> None:
        """Remove an empty directory (missing is not an error)."""

    def move(self, rel_src: str, rel_dst: str) -> None:
        """Rename a file or directory to a new name that must not exist."""

    def free_bytes(self) -> int:
        """Bytes available to this user on the root's file system."""


class RangeSource(Protocol):
    """What reading a saved shard's header and byte ranges needs (``read_shard_header``, a
    reshard's ``ShardRanges``): every ``Storage``, and a shard read in ranges straight from the
    persistent tier (``_tiers/persistent/ranged.py``) or from another live rank's copy server
    (``_tiers/replica/ranged.py``). ``root`` names where, in messages."""

    @property
    def root(self) -> str | os.PathLike[str]: ...

    def open_read(self, rel: str, expected_size: int | None = None) -> tuple[int, int]: ...

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> None: ...

    def close(self, fd: int) -> None: ...


class LocalStorage:
    """POSIX files under a local directory (node-local disk)."""

    SMALL_READS = True
    """A read of a few KiB costs a system call, not a request: a reshard reads each range
    straight into its destination and the bytes around it separately
    (``_reshard/ranges.py``), where a remote source is read in whole checksum blocks."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.abspath(os.fspath(root)))
        self._fd_names: dict[int, str] = {}  # open descriptor -> its path, for error messages
        self._fd_lock = threading.Lock()

    def _opened(self, fd: int, rel: str) -> int:
        with self._fd_lock:
            self._fd_names[fd] = rel
        return fd

    def _fd_rel(self, fd: int) -> str:
        """The path an open descriptor was opened for (relative to the root)."""
        with self._fd_lock:
            return self._fd_names.get(fd, f"<fd {fd}>")

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else str(self.root)

    def _fail(self, what: str, rel: str, exc: OSError) -> StorageError:
        hint = None
        if exc.errno == errno.ENOSPC:
            hint = "the disk is full: free space or point the pipeline at a larger disk"
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            hint = "check the permissions of the checkpoint root"
        return StorageError(f"{what} failed: {exc.strerror or exc}", path=self._path(rel),
                            hint=hint, errno=exc.errno)

    def ensure_root(self) -> None:
        path = str(self.root)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            try:
                _make_dirs_durably(path, self._fsync_directory)
            except FileExistsError:
                pass
            except OSError as exc:
                raise UnsafeRootError(f"cannot create the checkpoint root: {exc.strerror}",
                                      path=path,
                                      hint="choose a writable directory") from exc
            st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeRootError("the checkpoint root is a symlink", path=path,
                                  hint="pass the real directory it points to")
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeRootError("the checkpoint root is not a directory", path=path,
                                  hint="choose a directory")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise UnsafeRootError(
                f"the checkpoint root is owned by uid {st.st_uid}, not by this user",
                path=path, hint="use a directory that this user owns")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UnsafeRootError("the checkpoint root is not writable", path=path,
                                  hint="fix its permissions or choose another directory")

    def make_dir(self, rel: str) -> None:
        path = self._path(rel)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise StorageError("a non-directory stands where a step directory belongs",
                                   path=path, hint="remove it") from None
            return
        except OSError as exc:
            raise self._fail("mkdir", rel, exc) from exc
        self.fsync_dir(os.path.dirname(rel))

    def list_dir(self, rel: str) -> list[FileInfo]:
        out: list[FileInfo] = []
        try:
            with os.scandir(self._path(rel)) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    out.append(FileInfo(entry.name, st.st_size, stat.S_ISREG(st.st_mode),
                                        stat.S_ISDIR(st.st_mode), stat.S_ISLNK(st.st_mode)))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._fail("listdir", rel, exc) from exc
        return out

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        name = f".{final_name}.tmp-{secrets.token_hex(6)}"
        rel = os.path.join(rel_dir, name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        flags |= getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self._path(rel), flags, 0o600)
        except OSError as exc:
            raise self._fail("create", rel, exc) from exc
        return self._opened(fd, rel), name

    def open_direct(self, rel_dir: str, temp_name: str) -> int | None:
        direct = getattr(os, "O_DIRECT", 0)
        if not direct:
            return None
        rel = os.path.join(rel_dir, temp_name)
        flags = os.O_WRONLY | direct | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            return self._opened(os.open(self._path(rel), flags), rel)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                return None  # this file system has no direct I/O: buffered writes then
            raise self._fail("open for direct I/O", rel, exc) from exc

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        done = 0
        total = len(view)
        while done < total:
            try:
                n = os.pwrite(fd, view[done:], offset + done)
            except OSError as exc:
                raise self._fail("write", self._fd_rel(fd), exc) from exc
            if n <= 0:
                raise StorageError("write made no progress", path=self._path(self._fd_rel(fd)))
            done += n

    def truncate(self, fd: int, size: int) -> None:
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            raise self._fail("truncate", self._fd_rel(fd), exc) from exc

    def fsync(self, fd: int) -> None:
        try:
            os.fsync(fd)
        except OSError as exc:
            raise self._fail("fsync", self._fd_rel(fd), exc) from exc

    def close(self, fd: int) -> None:
        with self._fd_lock:
            rel = self._fd_names.pop(fd, f"<fd {fd}>")
        try:
            os.close(fd)
        except OSError as exc:
            raise self._fail("close", rel, exc) from exc

    def publish(self, rel_dir: str, temp_name: str, final_name: str) -> None:
        src = os.path.join(rel_dir, temp_name)
        dst = os.path.join(rel_dir, final_name)
        try:
            # link() fails when the target exists: a committed file is never replaced.
            os.link(self._path(src), self._path(dst), follow_symlinks=False)
        except OSError as exc:
            raise self._fail("publish", dst, exc) from exc
        try:
            os.unlink(self._path(src))
        except OSError as exc:
            raise self._fail("unlink", src, exc) from exc

    def fsync_dir(self, rel: str) -> None:
        try:
            self._fsync_directory(self._path(rel))
        except OSError as exc:
            raise self._fail("fsync dir", rel, exc) from exc

    def _fsync_directory(self, path: str) -> None:
        """fsync a directory by its absolute path: every directory sync goes through here
        (``fsync_dir`` and ``ensure_root``'s creation of the root), so a subclass can see them."""
        _fsync_dir_path(path)

    def open_read(self, rel: str, expected_size: int | None = None) -> tuple[int, int]:
        path = self._path(rel)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        flags |= getattr(os, "O_NONBLOCK", 0)  # a FIFO must not block the open
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise self._fail("open", rel, exc) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StorageError("not a regular file", path=path,
                                   hint="something other than a checkpoint file is here")
            if expected_size is not None and st.st_size != expected_size:
                raise StorageError(
                    f"size is {st.st_size} bytes, expected {expected_size}", path=path,
                    hint="the file is truncated or was replaced")
        except BaseException:
            os.close(fd)
            raise
        return self._opened(fd, rel), st.st_size

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> None:
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        done = 0
        total = len(view)
        while done < total:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                raise self._fail("read", self._fd_rel(fd), exc) from exc
            if n == 0:
                raise StorageError(f"unexpected end of file at byte {offset + done}",
                                   path=self._path(self._fd_rel(fd)),
                                   hint="the file is truncated")
            done += n

    def copy_out(self, fd: int, out: int, start: int, end: int) -> bool:
        copy = getattr(os, "copy_file_range", None)
        if copy is None:
            return False
        at = start
        try:
            while at < end:
                n = copy(fd, out, end - at, at, at)
                if n <= 0:
                    return at == end
                at += n
        except OSError as exc:
            if at == start:
                return False
            # No hint: the error may be the target's (a full share), not this root's.
            raise StorageError(f"copy failed: {exc.strerror or exc}", errno=exc.errno,
                               path=self._path(self._fd_rel(fd))) from exc
        return True

    def unlink(self, rel: str) -> None:
        try:
            os.unlink(self._path(rel))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._fail("unlink", rel, exc) from exc

    def rmdir(self, rel: str) -> None:
        try:
            os.rmdir(self._path(rel))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._fail("rmdir", rel, exc) from exc

    def move(self, rel_src: str, rel_dst: str) -> None:
        dst = self._path(rel_dst)
        if os.path.lexists(dst):
            raise StorageError("target exists", path=dst)
        try:
            os.rename(self._path(rel_src), dst)
        except OSError as exc:
            raise self._fail("rename", rel_src, exc) from exc

    def free_bytes(self) -> int:
        try:
            st = os.statvfs(self.root)
        except OSError as exc:
            raise self._fail("statvfs", "", exc) from exc
        return st.f_bavail * st.f_frsize


def _make_dirs_durably(path: str, fsync_dir: Callable[[str], None]) -> None:
    """``mkdir -p`` (0700) where each new directory's entry is fsynced into its parent
    (by ``fsync_dir``, given the parent's path)."""
    missing: list[str] = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    for directory in reversed(missing):  # top-down: a parent is durable before its child
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            if directory == path:
                raise
        fsync_dir(os.path.dirname(directory))


def _fsync_dir_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
