"""The persistent tier in a directory (a shared file system), written with the local rules:
temporary name, parts copied in parallel, fsync, rename, fsync of the directory; files 0600,
directories 0700, opened with ``O_NOFOLLOW``. The rename replaces an object of the same key:
in this tier a key is only written again by a retried promotion of the same committed file,
so the content is the same.

A killed upload leaves its temporary (``.NAME.tmp-HEX``) behind: ``leftovers`` names them, so
that the promoter removes them with the step's other objects. A versioned write (the owner
object) is exclusive by ``link`` when the object must not exist yet, and compares the inode,
modification time and size of the current file under an ``flock`` of ``.NAME.lock`` before
replacing it otherwise.

The files of this tier are not a checkpoint root, and do not go through a ``Storage``: the
directory is the tier's store, and these calls are its client, as obstore's requests are S3's
(they fail, are explained and retried as a store's requests: ``_transient``, ``Remote``). The
local side of a transfer does go through the local root's ``Storage``: an upload reads the
committed file by ``LocalFile`` (kernel copies by ``Storage.copy_out``, the bytes hashed by
``pread_into``), a download writes through the storage it is given (``Remote.download``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from .objects import KEY_PART, LocalFile, ObjectSum, check_key, part_ranges
from .remote import Remote
from .retries import Conflict, OnRetry, RemoteError

__all__ = ("DirRemote",)

_TEMPORARY = re.compile(r"^\.[A-Za-z0-9._-]+\.tmp-[0-9a-f]{12}$")
"""The name of a temporary that ``_write`` makes (``.NAME.tmp-`` and 6 random bytes)."""


class DirRemote(Remote):
    """A directory, written with the local rules (see the module docstring)."""

    def __init__(self, path: str, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.root = os.path.abspath(path)
        self._dirs_lock = threading.Lock()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _make_dirs(self, path: str) -> None:
        """Create ``path`` and its missing parents (0700), each made durable in its parent."""
        with self._dirs_lock:
            missing = []
            at = path
            while not os.path.isdir(at):
                missing.append(at)
                at = os.path.dirname(at)
            for d in reversed(missing):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d, 0o700)
                _fsync_dir(os.path.dirname(d))

    def _write(self, key: str, size: int, fill: Callable[[int], ObjectSum | None],
               publish: Callable[[str, str, os.stat_result], None] | None = None
               ) -> ObjectSum | None:
        """Write ``key`` through a temporary; ``publish(temp, final, stat of temp)`` puts
        it in place (default: ``os.replace``)."""
        final = self._path(key)
        directory = os.path.dirname(final)
        self._make_dirs(directory)
        temp = os.path.join(directory, f".{os.path.basename(final)}.tmp-{secrets.token_hex(6)}")
        out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600)
        try:
            try:
                result = fill(out)
                os.fsync(out)
            finally:
                os.close(out)
            info = os.stat(temp, follow_symlinks=False)
            if info.st_size != size:
                raise RemoteError(f"{self._where(key)} was written with {info.st_size} bytes, "
                                  f"not {size}", path=self._where(key), key=key, op="upload")
            if publish is None:
                os.replace(temp, final)
            else:
                publish(temp, final, info)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        _fsync_dir(directory)
        return result

    def _upload(self, source: LocalFile, key: str, on_retry: OnRetry | None) -> ObjectSum:
        size = source.size
        ranges = part_ranges(size, self.part_bytes)

        def fill(out: int) -> ObjectSum:
            def part(index: int, start: int, end: int) -> int:
                # A chunk at a time, waiting between chunks while a save writes (the pool
                # already waited before the part): when a save starts, at most a chunk per
                # thread is still being copied, not a whole part.
                digest = xxhash.xxh3_64()
                for at in range(start, end, _HASH_CHUNK):
                    stop = min(end, at + _HASH_CHUNK)
                    if at != start and self.gate is not None:
                        self.gate()
                    copied = source.copy_to(out, at, stop)
                    _hash_range(source, at, stop, None if copied else out, digest)
                _flush_range(out)
                return int(digest.intdigest())

            return ObjectSum(size, self.part_bytes, tuple(self._run_parts(part, ranges)))

        result = self._retry("upload", key, lambda: self._write(key, size, fill), on_retry)
        assert isinstance(result, ObjectSum)
        return result

    def _put_small(self, key: str, data: bytes) -> None:
        self._retry("upload", key, lambda: self._write(
            key, len(data), lambda out: _pwrite_all(out, data, 0)))

    def _get_versioned(self, key: str, limit: int) -> tuple[bytes, str | None] | None:
        def read() -> tuple[bytes, str | None] | None:
            try:
                fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            try:
                info = os.fstat(fd)
                if info.st_size > limit:
                    raise self._too_large(key, info.st_size, limit)
                data = _pread_exact(fd, 0, info.st_size) if info.st_size else b""
                return data, _stamp(info)
            finally:
                os.close(fd)

        result: tuple[bytes, str | None] | None = self._retry("download", key, read)
        return result

    def _put_versioned(self, key: str, data: bytes, expected: str | None) -> str | None:
        stamps: list[str] = []

        def publish(temp: str, final: str, info: os.stat_result) -> None:
            lock = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.lock")
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if expected is None:
                    try:
                        os.link(temp, final)
                    except FileExistsError:
                        raise Conflict(f"{self._where(key)} exists", path=self._where(key),
                                       key=key, op="upload") from None
                    os.unlink(temp)
                else:
                    try:
                        current: str | None = _stamp(os.stat(final, follow_symlinks=False))
                    except FileNotFoundError:
                        current = None
                    if current != expected:
                        raise Conflict(f"{self._where(key)} changed since it was read",
                                       path=self._where(key), key=key, op="upload")
                    os.replace(temp, final)
            finally:
                os.close(fd)  # releases the lock
            stamps.append(_stamp(info))

        self._retry("upload", key, lambda: self._write(
            key, len(data), lambda out: _pwrite_all(out, data, 0), publish))
        return stamps[-1]

    def _stamp(self, key: str) -> str | None:
        try:
            info = os.stat(self._path(key), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return _stamp(info) if stat.S_ISREG(info.st_mode) else None

    def _stamps(self, prefix: str) -> dict[str, str | None]:
        return {name: _stamp(info) for name, info in self._files(prefix).items()}

    def leftovers(self, prefix: str) -> list[str]:
        check_key(prefix)
        try:
            return sorted(n for n in os.listdir(self._path(prefix)) if _TEMPORARY.match(n))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise RemoteError(f"listing {self._where(prefix)} failed: {exc.strerror}",
                              path=self._where(prefix), key=prefix, op="list") from exc

    def _get_small(self, key: str, limit: int) -> bytes | None:
        def read() -> bytes | None:
            try:
                fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            try:
                size = os.fstat(fd).st_size
                if size > limit:
                    raise self._too_large(key, size, limit)
                return _pread_exact(fd, 0, size) if size else b""
            finally:
                os.close(fd)

        result: bytes | None = self._retry("download", key, read)
        return result

    def _size(self, key: str) -> int | None:
        def size() -> int | None:
            try:
                info = os.stat(self._path(key), follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            return info.st_size if stat.S_ISREG(info.st_mode) else None

        result: int | None = self._retry("stat", key, size)
        return result

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return _pread_exact(fd, start, end)
        finally:
            os.close(fd)

    def list_steps(self) -> list[str]:
        try:
            with os.scandir(self.root) as it:
                entries = list(it)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise RemoteError(f"listing {self.url} failed: {exc.strerror}", path=self.url,
                              op="list", transient=_transient(exc)) from exc
        return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False)
                      and KEY_PART.match(e.name) and not e.name.startswith("."))

    def list_dir(self, prefix: str) -> dict[str, int]:
        check_key(prefix)
        return {name: info.st_size for name, info in self._files(prefix).items()}

    def _files(self, prefix: str) -> dict[str, os.stat_result]:
        """The regular files directly under ``prefix`` that are objects (not temporaries or
        lock files, whose names start with a dot), with their stat; {} when none."""
        try:
            with os.scandir(self._path(prefix)) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as exc:
            raise RemoteError(f"listing {self._where(prefix)} failed: {exc.strerror}",
                              path=self._where(prefix), key=prefix, op="list",
                              transient=_transient(exc)) from exc
        out = {}
        for e in entries:
            if e.is_file(follow_symlinks=False) and not e.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    out[e.name] = e.stat(follow_symlinks=False)
        return out

    def delete(self, keys: Sequence[str]) -> None:
        dirs = set()
        for key in keys:
            check_key(key)
            path = self._path(key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise RemoteError(f"removing {self._where(key)} failed: {exc.strerror}",
                                  path=self._where(key), key=key, op="delete") from exc
            dirs.add(os.path.dirname(path))
        for directory in dirs:
            with contextlib.suppress(OSError):
                _fsync_dir(directory)
            with contextlib.suppress(OSError):  # an empty step prefix goes too
                if directory != self.root and not os.listdir(directory):
                    os.rmdir(directory)
                    _fsync_dir(os.path.dirname(directory))


_HASH_CHUNK = 4 * 1024 * 1024
_chunk = threading.local()


def _hash_range(source: LocalFile, start: int, end: int, out: int | None, digest: Any
                ) -> None:
    """Feed bytes [start, end) of ``source`` to ``digest`` (an xxh3-64 of the part: what
    ``ObjectSum`` records), read through a small buffer of this thread's: an upload of a
    4.8 GB file in parts of 64 MiB from 8 threads holds 32 MiB, not 512 MiB that the allocator
    would keep. With ``out``, the bytes are written there too (where the kernel would not copy
    them: ``LocalFile.copy_to``, whose copy on the development VM made writes 3x faster than
    ``shutil.copyfile``, a server-side copy on NFS; the committed local file does not change,
    so the bytes copied are the bytes hashed)."""
    buf = getattr(_chunk, "buf", None)
    if buf is None:
        buf = _chunk.buf = bytearray(_HASH_CHUNK)
    at = start
    with memoryview(buf) as whole:
        while at < end:
            view = whole[:min(len(buf), end - at)]
            source.read_into(view, at)
            digest.update(view)
            if out is not None:
                _pwrite_all(out, view, at)
            at += len(view)


def _pread_exact(fd: int, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file of this tier."""
    chunks = []
    at = start
    while at < end:
        data = os.pread(fd, end - at, at)
        if not data:
            raise OSError(errno.EIO, f"unexpected end of file at byte {at}")
        chunks.append(data)
        at += len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of a file of this tier."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _flush_range(fd: int) -> None:
    """Write the file's dirty pages out now, a part at a time, so that they never pile up
    into one long fsync at the end that a save would have to share the disk with (uploads
    wait for saves between parts, see ``Remote.gate``); the final fsync still follows."""
    os.fdatasync(fd)


def _stamp(info: os.stat_result) -> str:
    """A file's identity: a rename keeps it, a replacing rename or rewrite changes it."""
    return f"{info.st_ino}.{info.st_mtime_ns}.{info.st_size}"


_REFUSED = frozenset((errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG,
                      errno.EROFS))


def _transient(exc: OSError) -> bool:
    """An error of the shared file system that may pass (EIO, ESTALE, a timeout of a network
    mount), not one of its configuration or permissions."""
    return exc.errno not in _REFUSED


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
