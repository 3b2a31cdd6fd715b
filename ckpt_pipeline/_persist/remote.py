"""One persistent root: a directory on a shared file system, or an fsspec URL.

Every object is moved in parts of ``part_bytes``, at most ``threads`` at once (so at most that
many parts in memory), and every part is hashed (xxh3-64) from the bytes actually sent or
received: the ``ObjectSum`` that the step commit object records.

- A directory is written as a local root is: temporary name, parts written in parallel, fsync,
  rename, fsync of the directory (files 0600, directories 0700, opened with ``O_NOFOLLOW``).
  The rename replaces an object of the same key: in this tier a key is only written again by a
  retried promotion of the same committed file, so the content is the same.
- ``s3://`` goes through s3fs's client with our own multipart upload: each part is sent with its
  MD5 (the server refuses a part that does not match), the whole object's ETag is compared with
  the MD5 of what was sent after the upload, and an upload that fails is aborted on the server,
  so no half object ever appears.
- Any other fsspec protocol: streamed uploads through the file system, size checked after.

Requests that fail with a connection error, a 5xx or a throttling answer are retried with
exponential backoff and jitter (``retries`` times, each logged as ``ckpt.persist.retry``); the
client libraries' own retries are turned off, so that a failing store is seen and counted here.
No message, log line or ``url`` carries the credentials of ``options``.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import errno as errno_mod
import functools
import hashlib
import math
import os
import random
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from .._logging import log, report_once
from ..errors import CheckpointIntegrityError, ConfigError, StorageError

__all__ = ("PART_BYTES_DEFAULT", "ObjectSum", "Remote", "RemoteError", "is_url", "open_remote")

PART_BYTES_DEFAULT = 64 * 1024 * 1024
_S3_MIN_PART = 5 * 1024 * 1024
_S3_MAX_PUT = 5 * 1024**3
_BACKOFF_CAP_S = 10.0
_KEY_PART = re.compile(r"^[A-Za-z0-9._-]+$")
_MD5_ETAG = re.compile(r'"[0-9a-f]{32}(-[0-9]+)?"')
_SENSITIVE = re.compile(r"key|secret|token|password|passwd|credential|session|auth", re.I)
_HINT_S3 = "pip install 'ckpt_pipeline[s3]'"

OnRetry = Callable[[str, int, str], None]


@dataclass(frozen=True, slots=True)
class ObjectSum:
    """What an uploaded object must hold: its size and the xxh3-64 of each part."""

    size: int
    part_bytes: int
    parts: tuple[int, ...]

    @classmethod
    def of(cls, data: bytes, part_bytes: int) -> ObjectSum:
        """The checksum of ``data`` in parts of ``part_bytes``, as uploads compute it."""
        return cls(len(data), part_bytes,
                   tuple(_xxh(data[s:e]) for s, e in _ranges(len(data), part_bytes)))

    def to_msg(self) -> list[Any]:
        """``[size, part_bytes, [parts...]]``, for the step commit object (msgpack)."""
        return [self.size, self.part_bytes, list(self.parts)]

    @classmethod
    def from_msg(cls, value: Any) -> ObjectSum:
        """The inverse of ``to_msg``; anything else is a CheckpointIntegrityError."""
        if not (isinstance(value, (list, tuple)) and len(value) == 3 and _uint(value[0])
                and _uint(value[1]) and value[1] > 0 and isinstance(value[2], (list, tuple))
                and all(_uint(p) for p in value[2])):
            raise CheckpointIntegrityError("an object checksum is malformed")
        size, part_bytes, parts = value
        if len(parts) != math.ceil(size / part_bytes):
            raise CheckpointIntegrityError(
                f"an object checksum lists {len(parts)} parts for {size} bytes in parts of "
                f"{part_bytes}")
        return cls(size, part_bytes, tuple(parts))


def _uint(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**64


class RemoteError(StorageError):
    """A request to the persistent tier failed (after its retries).

    ``key``, ``op`` and ``attempts`` say which request; ``missing``: the object does not exist.
    """

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None,
                 missing: bool = False, key: str | None = None, op: str | None = None,
                 attempts: int = 1) -> None:
        super().__init__(message, path=path, hint=hint)
        self.missing = missing
        self.key = key
        self.op = op
        self.attempts = attempts


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or any(not _KEY_PART.match(p) or p in (".", "..") for p in parts):
        raise ValueError(f"{key!r} is not a key of the persistent tier: relative, "
                         "'/'-separated names of [A-Za-z0-9._-]")
    return key


def _ranges(size: int, part_bytes: int) -> list[tuple[int, int]]:
    return [(start, min(size, start + part_bytes)) for start in range(0, size, part_bytes)]


def _pread(fd: int, start: int, end: int) -> bytes:
    chunks = []
    at = start
    while at < end:
        data = os.pread(fd, end - at, at)
        if not data:
            raise OSError(errno_mod.EIO, f"unexpected end of file at byte {at}")
        chunks.append(data)
        at += len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _pwrite(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _xxh(data: bytes) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


def _single_etag(md5: bytes) -> str:
    """The ETag S3 gives an object stored by one PUT."""
    return f'"{md5.hex()}"'


def _multipart_etag(part_md5s: Sequence[bytes]) -> str:
    """The ETag S3 gives an object stored by a multipart upload."""
    whole = hashlib.md5(b"".join(part_md5s), usedforsecurity=False)
    return f'"{whole.hexdigest()}-{len(part_md5s)}"'


class Remote:
    """One persistent root (see the module docstring). Thread-safe; ``close`` when done.

    ``gate``, when set, is called before each part of an upload is read: the pipeline makes it
    wait while a save writes, so that uploads use the disk only between saves.
    """

    url: str

    def __init__(self, url: str, *, threads: int, part_bytes: int, retries: int,
                 backoff_s: float, hidden: Sequence[str] = ()) -> None:
        self.url = url
        self.threads = threads
        self.part_bytes = part_bytes
        self.retries = retries
        self.backoff_s = backoff_s
        self._hidden = tuple(sorted(set(hidden), key=len, reverse=True))  # credentials
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="ckpt-persist-io")
        self.gate: Callable[[], None] | None = None

    # -- the interface -------------------------------------------------------------------

    def upload(self, local_path: str, key: str, *, on_retry: OnRetry | None = None
               ) -> ObjectSum:
        """Upload a local regular file as ``key``; return the checksum of what was sent."""
        _check_key(key)
        try:
            fd = os.open(local_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise StorageError(f"cannot open {local_path} for upload: {exc.strerror}",
                               path=local_path, errno=exc.errno) from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise StorageError("only a regular file can be uploaded", path=local_path)
            return self._upload_fd(fd, info.st_size, key, on_retry)
        finally:
            os.close(fd)

    def put_small(self, key: str, data: bytes) -> None:
        """Write ``data`` as ``key`` in one request; its size is checked after."""
        _check_key(key)
        self._put_small(key, bytes(data))

    def get_small(self, key: str, limit: int) -> bytes | None:
        """The bytes of ``key`` (at most ``limit`` of them); None when it does not exist."""
        _check_key(key)
        return self._get_small(key, limit)

    def download(self, key: str, fd: int, expected: ObjectSum, *,
                 on_retry: OnRetry | None = None) -> None:
        """Read ``key`` into ``fd`` at the same offsets, each part checked against
        ``expected`` before it is written."""
        _check_key(key)
        size = self._size(key)
        where = self._where(key)
        if size is None:
            raise RemoteError(f"{where} does not exist", path=where, missing=True, key=key,
                              op="download")
        if size != expected.size:
            raise CheckpointIntegrityError(
                f"{where} is {size} bytes, {expected.size} were uploaded", path=where)

        def one(index: int, start: int, end: int) -> None:
            data = self._retry("download", key, lambda: self._read_range(key, start, end),
                               on_retry)
            if len(data) != end - start or _xxh(data) != expected.parts[index]:
                raise CheckpointIntegrityError(
                    f"{where}: part {index} (bytes [{start}, {end})) does not match the "
                    "checksum recorded when it was uploaded", path=where,
                    hint="the object changed after it was uploaded; restore another step")
            _pwrite(fd, data, start)

        self._run_parts(one, _ranges(size, expected.part_bytes), gated=False)

    def list_steps(self) -> list[str]:
        """Names of the directories (prefixes) directly under the root; [] before any."""
        raise NotImplementedError

    def list_dir(self, prefix: str) -> dict[str, int]:
        """``{name: size}`` of the objects directly under ``prefix``; {} when none."""
        raise NotImplementedError

    def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` (missing ones are fine); RemoteError when the store refuses."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        _check_key(key)
        return self._size(key) is not None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- what each backend provides ------------------------------------------------------

    def _upload_fd(self, fd: int, size: int, key: str, on_retry: OnRetry | None
                   ) -> ObjectSum:
        raise NotImplementedError

    def _put_small(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def _get_small(self, key: str, limit: int) -> bytes | None:
        raise NotImplementedError

    def _size(self, key: str) -> int | None:
        raise NotImplementedError

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        raise NotImplementedError

    # -- shared helpers ------------------------------------------------------------------

    def _where(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def _too_large(self, key: str, size: int, limit: int) -> RemoteError:
        return RemoteError(f"{self._where(key)} is {size} bytes, more than the {limit} "
                           "expected", path=self._where(key), key=key, op="download")

    def _run_parts(self, fn: Callable[[int, int, int], Any],
                   ranges: list[tuple[int, int]], *, gated: bool = True) -> list[Any]:
        """``fn(index, start, end)`` for every part, ``threads`` at once; the first error
        cancels the parts not started, waits for those running, and is raised."""
        gate = self.gate if gated else None
        if gate is not None:
            inner = fn

            def fn(index: int, start: int, end: int) -> Any:
                gate()
                return inner(index, start, end)

        if len(ranges) <= 1:
            return [fn(i, s, e) for i, (s, e) in enumerate(ranges)]
        futures = [self._pool.submit(fn, i, s, e) for i, (s, e) in enumerate(ranges)]
        try:
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            for f in futures:
                error = f.exception() if f.done() and not f.cancelled() else None
                if error is not None:
                    raise error
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)

    def _redact(self, text: str) -> str:
        for value in self._hidden:
            text = text.replace(value, "***")
        return text

    def _retry(self, op: str, key: str, fn: Callable[[], Any],
               on_retry: OnRetry | None = None) -> Any:
        """``fn()``, retried on transient failures with exponential backoff and jitter."""
        attempt = 0
        where = self._where(key)
        while True:
            try:
                return fn()
            except (CheckpointIntegrityError, RemoteError):
                raise
            except Exception as exc:
                reason = self._redact(_describe(exc))
                if not _transient(exc):
                    raise RemoteError(
                        f"{op} of {where} failed after {attempt + 1} attempt(s): {reason}",
                        path=where, missing=_is_missing(exc), key=key, op=op,
                        attempts=attempt + 1) from None
                if attempt >= self.retries:
                    raise RemoteError(
                        f"{op} of {where} failed after {attempt + 1} attempts: {reason}",
                        path=where, key=key, op=op, attempts=attempt + 1,
                        hint="check the store (credentials, quota, throttling); the local "
                             "tier keeps the step") from None
                attempt += 1
                log.warning("ckpt.persist.retry", url=self.url, key=key, op=op,
                            attempt=attempt, reason=reason)
                if on_retry is not None:
                    try:
                        on_retry(key, attempt, reason)
                    except Exception as exc:  # a subscriber's failure never fails the upload
                        report_once("persist on_retry callback", exc)
                delay = min(_BACKOFF_CAP_S, self.backoff_s * 2 ** (attempt - 1))
                time.sleep(delay * (0.5 + random.random() / 2))


# The exceptions are re-raised ``from None``: a client library's exception (and its chained
# ones) may quote request parameters, and tracebacks end up in logs. ``reason`` keeps what
# the store said.


def _describe(exc: BaseException) -> str:
    cause = _client_error(exc)
    if cause is not None:
        response = getattr(cause, "response", {}) or {}
        error = response.get("Error", {})
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"HTTP {status} {error.get('Code', '')}: {error.get('Message', '')}".strip()
    return f"{type(exc).__name__}: {exc}"


def _client_error(exc: BaseException | None) -> BaseException | None:
    """The botocore ClientError behind ``exc`` (s3fs translates them into OSErrors)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(getattr(exc, "response", None), dict):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


_TRANSIENT_CODES = frozenset((
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"))
_TRANSIENT_NAMES = ("Connect", "Timeout", "HTTPClientError", "IncompleteRead",
                    "ServerDisconnected", "ClientPayload", "ClientOSError", "ReadError",
                    "ResponseParserError", "ProtocolError")


def _transient(exc: BaseException) -> bool:
    """A connection error, a 5xx or a throttling answer: worth another attempt."""
    cause = _client_error(exc)
    if cause is not None:
        response = getattr(cause, "response", {}) or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = response.get("Error", {}).get("Code", "")
        return status >= 500 or status == 429 or code in _TRANSIENT_CODES
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError, ValueError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return any(word in type(e).__name__ for e in _chain(exc) for word in _TRANSIENT_NAMES)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    for _ in range(8):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_missing(exc: BaseException) -> bool:
    cause = _client_error(exc)
    if cause is not None:
        response = getattr(cause, "response", {}) or {}
        return response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound")
    return isinstance(exc, FileNotFoundError)


# ---------------------------------------------------------------------------- directory


class _DirRemote(Remote):
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

    def _write(self, key: str, size: int,
               fill: Callable[[int], ObjectSum | None]) -> ObjectSum | None:
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
            written = os.stat(temp, follow_symlinks=False).st_size
            if written != size:
                raise RemoteError(f"{self._where(key)} was written with {written} bytes, not "
                                  f"{size}", path=self._where(key), key=key, op="upload")
            os.replace(temp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        _fsync_dir(directory)
        return result

    def _upload_fd(self, fd: int, size: int, key: str, on_retry: OnRetry | None
                   ) -> ObjectSum:
        ranges = _ranges(size, self.part_bytes)

        def fill(out: int) -> ObjectSum:
            def part(index: int, start: int, end: int) -> int:
                data = _pread(fd, start, end)
                if not _copy_range(fd, out, start, end):
                    _pwrite(out, data, start)
                _flush_range(out)
                return _xxh(data)

            return ObjectSum(size, self.part_bytes, tuple(self._run_parts(part, ranges)))

        result = self._retry("upload", key, lambda: self._write(key, size, fill), on_retry)
        assert isinstance(result, ObjectSum)
        return result

    def _put_small(self, key: str, data: bytes) -> None:
        self._retry("upload", key, lambda: self._write(
            key, len(data), lambda out: _pwrite(out, data, 0)))

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
                return _pread(fd, 0, size) if size else b""
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
            return _pread(fd, start, end)
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
                              op="list") from exc
        return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False)
                      and _KEY_PART.match(e.name) and not e.name.startswith("."))

    def list_dir(self, prefix: str) -> dict[str, int]:
        _check_key(prefix)
        try:
            with os.scandir(self._path(prefix)) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as exc:
            raise RemoteError(f"listing {self._where(prefix)} failed: {exc.strerror}",
                              path=self._where(prefix), key=prefix, op="list") from exc
        out = {}
        for e in entries:
            if e.is_file(follow_symlinks=False) and not e.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    out[e.name] = e.stat(follow_symlinks=False).st_size
        return out

    def delete(self, keys: Sequence[str]) -> None:
        dirs = set()
        for key in keys:
            _check_key(key)
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


def _copy_range(src: int, dst: int, start: int, end: int) -> bool:
    """Copy bytes [start, end) from ``src`` to ``dst`` in the kernel (``copy_file_range``:
    no copy through user memory, which on the development VM made writes 3x slower than
    ``shutil.copyfile``; a server-side copy on NFS). False where the kernel or the file
    systems refuse it: the caller writes the bytes it read instead. The committed local file
    does not change, so the bytes copied are the bytes hashed."""
    copy = getattr(os, "copy_file_range", None)
    if copy is None:
        return False
    at = start
    try:
        while at < end:
            n = copy(src, dst, end - at, at, at)
            if n <= 0:
                return at == end
            at += n
    except OSError:
        if at == start:
            return False
        raise
    return True


def _flush_range(fd: int) -> None:
    """Write the file's dirty pages out now, a part at a time, so that they never pile up
    into one long fsync at the end that a save would have to share the disk with (uploads
    wait for saves between parts, see ``Remote.gate``); the final fsync still follows."""
    os.fdatasync(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- fsspec


class _FsspecRemote(Remote):
    """Any fsspec file system: streamed uploads, ranged parallel reads, sizes checked."""

    def __init__(self, url: str, fs: Any, root: str, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.fs = fs
        self.root = root.rstrip("/")

    def _full(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _check_size(self, key: str, size: int) -> None:
        """After an upload: the store must report the size that was sent."""
        got = self._size(key)
        if got != size:
            with contextlib.suppress(Exception):
                self._remove(key)
            raise RemoteError(f"{self._where(key)} is {got} bytes after the upload, {size} "
                              "were sent; it was deleted", path=self._where(key), key=key,
                              op="upload")

    def _remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._full(key))

    def _upload_fd(self, fd: int, size: int, key: str, on_retry: OnRetry | None
                   ) -> ObjectSum:
        def send() -> ObjectSum:
            parts = []
            out = self.fs.open(self._full(key), "wb")
            try:
                for start, end in _ranges(size, self.part_bytes):
                    if self.gate is not None:
                        self.gate()
                    data = _pread(fd, start, end)
                    parts.append(_xxh(data))
                    out.write(data)
            except BaseException:
                # A buffered file would commit what it has when closed: throw it away.
                with contextlib.suppress(Exception):
                    out.discard() if hasattr(out, "discard") else out.close()
                with contextlib.suppress(Exception):
                    self._remove(key)
                raise
            out.close()
            return ObjectSum(size, self.part_bytes, tuple(parts))

        result = self._retry("upload", key, send, on_retry)
        self._check_size(key, size)
        assert isinstance(result, ObjectSum)
        return result

    def _put_small(self, key: str, data: bytes) -> None:
        self._retry("upload", key, lambda: self.fs.pipe_file(self._full(key), data))
        self._check_size(key, len(data))

    def _get_small(self, key: str, limit: int) -> bytes | None:
        size = self._size(key)
        if size is None:
            return None
        if size > limit:
            raise self._too_large(key, size, limit)
        try:
            data: bytes = self._retry("download", key, lambda: self._read_range(key, 0, size))
        except RemoteError as exc:
            if exc.missing:
                return None
            raise
        return data

    def _size(self, key: str) -> int | None:
        def info() -> int | None:
            try:
                self.fs.invalidate_cache(self._full(key))
                found = self.fs.info(self._full(key))
            except FileNotFoundError:
                return None
            if found.get("type") == "directory":
                return None
            return int(found["size"])

        result: int | None = self._retry("stat", key, info)
        return result

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        if start == end:
            return b""
        data: bytes = self.fs.cat_file(self._full(key), start=start, end=end)
        return data

    def _listing(self, path: str, label: str) -> list[dict[str, Any]]:
        def ls() -> list[dict[str, Any]]:
            try:
                self.fs.invalidate_cache(path)
                entries: list[dict[str, Any]] = self.fs.ls(path, detail=True)
                return entries
            except FileNotFoundError as exc:
                if _client_error(exc) is not None and _code(exc) == "NoSuchBucket":
                    raise
                return []

        result: list[dict[str, Any]] = self._retry("list", label, ls)
        return result

    def list_steps(self) -> list[str]:
        out = []
        for entry in self._listing(self.root, ""):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") == "directory" and _KEY_PART.match(name) and (
                not name.startswith(".")
            ):
                out.append(name)
        return sorted(out)

    def list_dir(self, prefix: str) -> dict[str, int]:
        _check_key(prefix)
        out = {}
        for entry in self._listing(self._full(prefix), prefix):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") != "directory" and not name.startswith("."):
                out[name] = int(entry.get("size") or 0)
        return out

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            _check_key(key)
            self._retry("delete", key, functools.partial(self._remove, key))
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.root)


def _code(exc: BaseException) -> str:
    cause = _client_error(exc)
    response = getattr(cause, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


class _S3Remote(_FsspecRemote):
    """S3 through s3fs's client: our own multipart upload with per-part MD5 and ETag checks."""

    def __init__(self, url: str, fs: Any, root: str, **kw: Any) -> None:
        super().__init__(url, fs, root, **kw)
        self.bucket, _, self.prefix = root.partition("/")

    def _s3key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self.fs.call_s3(method, Bucket=self.bucket, **kwargs)

    def _upload_fd(self, fd: int, size: int, key: str, on_retry: OnRetry | None
                   ) -> ObjectSum:
        ranges = _ranges(size, self.part_bytes)
        if len(ranges) <= 1 or self.part_bytes < _S3_MIN_PART:
            if size > _S3_MAX_PUT:
                raise ConfigError(
                    f"{self._where(key)}: {size} bytes need a multipart upload, and parts of "
                    f"{self.part_bytes} bytes are smaller than S3's minimum of 5 MiB",
                    hint="set the part size to at least 5 MiB")
            if self.gate is not None:
                self.gate()
            data = _pread(fd, 0, size) if size else b""
            self._put_object(key, data, on_retry)
            return ObjectSum(size, self.part_bytes,
                             tuple(_xxh(data[s:e]) for s, e in ranges))
        return self._multipart(fd, size, key, ranges, on_retry)

    def _multipart(self, fd: int, size: int, key: str, ranges: list[tuple[int, int]],
                   on_retry: OnRetry | None) -> ObjectSum:
        s3key = self._s3key(key)
        upload = self._retry("upload", key, lambda: self._call(
            "create_multipart_upload", Key=s3key), on_retry)["UploadId"]
        try:
            def part(index: int, start: int, end: int) -> tuple[int, bytes]:
                data = _pread(fd, start, end)
                md5 = hashlib.md5(data, usedforsecurity=False).digest()

                def send() -> None:
                    answer = self._call("upload_part", Key=s3key, UploadId=upload,
                                        PartNumber=index + 1, Body=data,
                                        ContentMD5=base64.b64encode(md5).decode())
                    if not _etag_matches(answer.get("ETag"), _single_etag(md5)):
                        raise RemoteError(
                            f"{self._where(key)}: the store answered part {index + 1} with "
                            f"ETag {answer.get('ETag')}, not the MD5 of what was sent",
                            path=self._where(key), key=key, op="upload")

                self._retry("upload", key, send, on_retry)
                return _xxh(data), md5

            done = self._run_parts(part, ranges)
            self._retry("upload", key, lambda: self._call(
                "complete_multipart_upload", Key=s3key, UploadId=upload,
                MultipartUpload={"Parts": [
                    {"PartNumber": i + 1, "ETag": _single_etag(md5)}
                    for i, (_, md5) in enumerate(done)]}), on_retry)
        except BaseException:
            # Nothing of a failed upload may stay on the store (parts are billed, and hidden).
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", Key=s3key, UploadId=upload)
            raise
        self._verify(key, size, _multipart_etag([md5 for _, md5 in done]))
        return ObjectSum(size, self.part_bytes, tuple(x for x, _ in done))

    def _put_object(self, key: str, data: bytes, on_retry: OnRetry | None) -> None:
        md5 = hashlib.md5(data, usedforsecurity=False).digest()
        self._retry("upload", key, lambda: self._call(
            "put_object", Key=self._s3key(key), Body=data,
            ContentMD5=base64.b64encode(md5).decode()), on_retry)
        self._verify(key, len(data), _single_etag(md5))

    def _verify(self, key: str, size: int, etag: str) -> None:
        """After an upload: the object's size, and its ETag where it has an MD5 form; an
        object that does not match is deleted."""
        try:
            head = self._retry("check", key, lambda: self._call("head_object",
                                                                 Key=self._s3key(key)))
        finally:
            self.fs.invalidate_cache(self.root)
        got_size, got_etag = head.get("ContentLength"), head.get("ETag")
        if got_size == size and _etag_matches(got_etag, etag):
            return
        with contextlib.suppress(Exception):
            self._call("delete_object", Key=self._s3key(key))
        raise RemoteError(
            f"{self._where(key)} holds other bytes than were sent ({got_size} bytes, ETag "
            f"{got_etag}; sent {size} bytes, ETag {etag}); it was deleted",
            path=self._where(key), key=key, op="upload")

    def _put_small(self, key: str, data: bytes) -> None:
        self._put_object(key, data, None)

    def _size(self, key: str) -> int | None:
        def head() -> int | None:
            try:
                answer = self._call("head_object", Key=self._s3key(key))
            except FileNotFoundError:
                return None
            return int(answer["ContentLength"])

        result: int | None = self._retry("stat", key, head)
        return result

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        if start == end:
            return b""
        from fsspec.asyn import sync

        answer = self._call("get_object", Key=self._s3key(key),
                            Range=f"bytes={start}-{end - 1}")
        body = answer["Body"]

        async def read() -> bytes:
            async with body:
                data: bytes = await body.read()
                return data

        result: bytes = sync(self.fs.loop, read)
        return result

    def _remove(self, key: str) -> None:
        self._call("delete_object", Key=self._s3key(key))

    def delete(self, keys: Sequence[str]) -> None:
        checked = [_check_key(k) for k in keys]
        for start in range(0, len(checked), 1000):  # S3's most keys per request
            chunk = checked[start:start + 1000]
            objects = [{"Key": self._s3key(k)} for k in chunk]

            def send(objects: list[dict[str, str]] = objects) -> Any:
                return self._call("delete_objects", Delete={"Objects": objects, "Quiet": True})

            answer = self._retry("delete", chunk[0], send)
            errors = [e for e in answer.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise RemoteError(
                    f"the store refused to delete {len(errors)} object(s) under {self.url}, "
                    f"e.g. {first.get('Key')}: {first.get('Code')} {first.get('Message')}",
                    path=self.url, key=chunk[0], op="delete")
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.root)


def _etag_matches(got: Any, expected: str) -> bool:
    """Whether an ETag agrees with ``expected``; one that is no MD5 form (an encrypted
    object's, another store's) cannot be checked and passes."""
    if not isinstance(got, str) or _MD5_ETAG.fullmatch(got) is None:
        return True
    return got == expected


# ---------------------------------------------------------------------------- opening


def is_url(value: str) -> bool:
    """``value`` names a location by URL (``s3://...``), not a local path."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) is not None


def _display(url: str) -> str:
    """The URL without any user:password@ part."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@", r"\1", url)


def _secret_values(options: Mapping[str, Any], url: str) -> list[str]:
    """The values in ``options`` (and the URL's user:password) that no text may show."""
    out: list[str] = []

    def walk(value: Any, sensitive: bool) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, sensitive or bool(_SENSITIVE.search(str(k))))
        elif isinstance(value, str) and sensitive and len(value) >= 4:
            out.append(value)

    walk(options, False)
    userinfo = re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://([^/@]*)@", url)
    if userinfo:
        out.extend(p for p in userinfo.group(1).split(":") if len(p) >= 4)
    return out


def open_remote(url: str, *, threads: int = 8, part_bytes: int = PART_BYTES_DEFAULT,
                retries: int = 5, backoff_s: float = 0.5,
                options: Mapping[str, Any] | None = None) -> Remote:
    """The persistent root at ``url``: a directory (a path, or ``file://PATH``), ``s3://``,
    or another fsspec protocol, with ``options`` for its file system."""
    shown = _display(url)
    if type(threads) is not int or threads < 1:
        raise ConfigError(f"threads={threads!r} for {shown}: give a count of at least 1")
    if type(part_bytes) is not int or part_bytes < 1:
        raise ConfigError(f"part_bytes={part_bytes!r} for {shown}: give a positive size")
    if type(retries) is not int or retries < 0:
        raise ConfigError(f"retries={retries!r} for {shown}: give a count of at least 0")
    if not backoff_s >= 0:
        raise ConfigError(f"backoff_s={backoff_s!r} for {shown}: give seconds, at least 0")
    fs_options = dict(options or {})
    kw: dict[str, Any] = {"threads": threads, "part_bytes": part_bytes, "retries": retries,
                          "backoff_s": backoff_s, "hidden": _secret_values(fs_options, url)}
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", url)
    if match is None or match.group(1).lower() == "file":
        path = url if match is None else match.group(2)
        if not path:
            raise ConfigError(f"persistent={shown!r} names no directory")
        return _DirRemote(path, **kw)
    protocol = match.group(1).lower()
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"the persistent tier {shown} needs fsspec", hint=_HINT_S3) from None
    if protocol in ("s3", "s3a"):
        try:
            import s3fs  # noqa: F401
        except ImportError:
            raise ConfigError(f"the persistent tier {shown} needs s3fs",
                              hint=_HINT_S3) from None
        if shown != url:
            raise ConfigError(f"persistent={shown!r}: credentials in an s3:// URL are not "
                              "used", hint="pass them in the options (key, secret)")
        root = match.group(2).strip("/")
        if not root:
            raise ConfigError(f"persistent={shown!r} names no bucket")
        return _S3Remote(shown, _s3_filesystem(fsspec, fs_options, threads, shown), root,
                         **kw)
    try:
        cls = fsspec.get_filesystem_class(protocol)
        fs = cls(**{**cls._get_kwargs_from_urls(url), **fs_options})
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"the persistent tier {shown}: unknown or unavailable protocol "
                          f"{protocol!r} ({type(exc).__name__})",
                          hint="use a directory or an fsspec URL (s3://...)") from None
    except Exception as exc:  # the message may quote options: do not repeat it
        raise ConfigError(f"the persistent tier {shown} could not be opened "
                          f"({type(exc).__name__})", hint="check its options") from None
    return _FsspecRemote(shown, fs, cls._strip_protocol(url), **kw)


def _s3_filesystem(fsspec: Any, fs_options: dict[str, Any], threads: int, shown: str) -> Any:
    """An s3fs file system of our own (no instance cache, no listings cache), whose client
    makes one attempt per request."""
    # The retries are ours (``Remote._retry``): counted, logged, reported through on_retry,
    # with our backoff. botocore's ``total_max_attempts: 1`` (its ``max_attempts`` counts
    # retries, not attempts) and s3fs's ``retries = 1`` (attempts of its _error_wrapper) make
    # every failure reach us at once instead of after up to 5 x 5 hidden attempts.
    config = dict(fs_options.pop("config_kwargs", None) or {})
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    config.setdefault("max_pool_connections", max(10, 2 * threads))
    fs_options["config_kwargs"] = config
    client = dict(fs_options.pop("client_kwargs", None) or {})
    if "endpoint_url" in client and "endpoint_url" not in fs_options:
        fs_options["endpoint_url"] = client.pop("endpoint_url")
    fs_options["client_kwargs"] = client
    fs_options.setdefault("skip_instance_cache", True)
    # Listings change under us (other ranks upload): never answer from a cached one.
    fs_options.setdefault("use_listings_cache", False)
    try:
        fs = fsspec.filesystem("s3", **fs_options)
    except Exception as exc:  # the message may quote options: do not repeat it
        raise ConfigError(f"the persistent tier {shown} could not be opened "
                          f"({type(exc).__name__})", hint="check its options") from None
    fs.retries = 1
    return fs
