"""One persistent root: a directory on a shared file system, or an fsspec URL.

Every object is moved in parts of ``part_bytes``, at most ``threads`` at once (so at most that
many parts in memory), and every part is hashed (xxh3-64) from the bytes actually sent or
received: the ``ObjectSum`` that the step commit object records.

- A directory is written as a local root is: temporary name, parts written in parallel, fsync,
  rename, fsync of the directory (files 0600, directories 0700, opened with ``O_NOFOLLOW``).
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

from .._logging import log
from ..errors import CheckpointIntegrityError, ConfigError, StorageError

__all__ = ("PART_BYTES_DEFAULT", "ObjectSum", "Remote", "RemoteError", "is_url", "open_remote")

PART_BYTES_DEFAULT = 64 * 1024 * 1024
_S3_MIN_PART = 5 * 1024 * 1024
_S3_MAX_PUT = 5 * 1024**3
_BACKOFF_CAP_S = 10.0
_KEY_PART = re.compile(r"^[A-Za-z0-9._-]+$")

OnRetry = Callable[[str, int, str], None]


@dataclass(frozen=True, slots=True)
class ObjectSum:
    """What an uploaded object must hold: its size and the xxh3-64 of each part."""

    size: int
    part_bytes: int
    parts: tuple[int, ...]

    def to_msg(self) -> list[Any]:
        return [self.size, self.part_bytes, list(self.parts)]

    @classmethod
    def from_msg(cls, value: Any) -> ObjectSum:
        if not (isinstance(value, list) and len(value) == 3 and _uint(value[0])
                and _uint(value[1]) and value[1] > 0 and isinstance(value[2], list)
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
    """A request to the persistent tier failed (after its retries); ``missing``: the object
    does not exist."""

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None,
                 missing: bool = False) -> None:
        super().__init__(message, path=path, hint=hint)
        self.missing = missing


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or any(not _KEY_PART.match(p) or p in (".", "..") for p in parts):
        raise ValueError(f"{key!r} is not a key of the persistent tier")
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


class Remote:
    """One persistent root (see the module docstring). Thread-safe."""

    url: str

    def __init__(self, url: str, *, threads: int, part_bytes: int, retries: int,
                 backoff_s: float) -> None:
        self.url = url
        self.threads = threads
        self.part_bytes = part_bytes
        self.retries = retries
        self.backoff_s = backoff_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="ckpt-persist-io")
        self.gate: Callable[[], None] | None = None
        """Called before each part of an upload is read: the pipeline makes it wait while a
        save writes, so that uploads use the disk only between saves."""

    # -- the interface -------------------------------------------------------------------

    def upload(self, local_path: str, key: str, *, on_retry: OnRetry | None = None
               ) -> ObjectSum:
        """Upload a local regular file as ``key``; return the checksum of what was sent."""
        _check_key(key)
        fd = os.open(local_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise RemoteError(f"{local_path} is not a regular file", path=local_path)
            return self._upload_fd(fd, info.st_size, key, on_retry)
        finally:
            os.close(fd)

    def put_small(self, key: str, data: bytes) -> None:
        """Write ``data`` as ``key`` in one request."""
        _check_key(key)
        self._put_small(key, data)

    def get_small(self, key: str, limit: int) -> bytes | None:
        """The bytes of ``key``; None when it does not exist."""
        _check_key(key)
        return self._get_small(key, limit)

    def download(self, key: str, fd: int, expected: ObjectSum, *,
                 on_retry: OnRetry | None = None) -> None:
        """Read ``key`` into ``fd`` (at the same offsets), each part checked against
        ``expected`` before it is written."""
        _check_key(key)
        size = self._size(key)
        if size is None:
            raise RemoteError(f"{self.url}/{key} does not exist", path=f"{self.url}/{key}",
                              missing=True)
        if size != expected.size:
            raise CheckpointIntegrityError(
                f"{self.url}/{key} is {size} bytes, {expected.size} were uploaded",
                path=f"{self.url}/{key}")

        def one(index: int, start: int, end: int) -> None:
            data = self._retry("download", key, lambda: self._read_range(key, start, end),
                               on_retry)
            if len(data) != end - start or xxhash.xxh3_64_intdigest(data) != (
                expected.parts[index]
            ):
                raise CheckpointIntegrityError(
                    f"{self.url}/{key}: part {index} (bytes [{start}, {end})) does not match "
                    "the checksum recorded when it was uploaded", path=f"{self.url}/{key}")
            _pwrite(fd, data, start)

        self._run_parts(one, _ranges(size, expected.part_bytes))

    def list_steps(self) -> list[str]:
        raise NotImplementedError

    def list_dir(self, prefix: str) -> dict[str, int]:
        raise NotImplementedError

    def delete(self, keys: Sequence[str]) -> None:
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

    def _run_parts(self, fn: Callable[[int, int, int], Any],
                   ranges: list[tuple[int, int]]) -> list[Any]:
        """``fn(index, start, end)`` for every part, ``threads`` at once; the first error
        stops the rest and is raised."""
        gate = self.gate
        if gate is not None:
            inner = fn

            def fn(index: int, start: int, end: int) -> Any:
                gate()
                return inner(index, start, end)

        if len(ranges) <= 1:
            return [fn(i, s, e) for i, (s, e) in enumerate(ranges)]
        futures = [self._pool.submit(fn, i, s, e) for i, (s, e) in enumerate(ranges)]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)

    def _retry(self, op: str, key: str, fn: Callable[[], Any],
               on_retry: OnRetry | None = None) -> Any:
        """``fn()``, retried on transient failures with exponential backoff and jitter."""
        attempt = 0
        while True:
            try:
                return fn()
            except (CheckpointIntegrityError, RemoteError):
                raise
            except Exception as exc:
                reason = _describe(exc)
                if not _transient(exc):
                    raise RemoteError(f"{op} of {self.url}/{key} failed: {reason}",
                                      path=f"{self.url}/{key}",
                                      missing=_is_missing(exc)) from exc
                if attempt >= self.retries:
                    raise RemoteError(
                        f"{op} of {self.url}/{key} failed after {attempt + 1} attempts: "
                        f"{reason}", path=f"{self.url}/{key}",
                        hint="check the store (credentials, quota, throttling); the local "
                             "tier keeps the step") from exc
                attempt += 1
                log.warning("ckpt.persist.retry", url=self.url, key=key, op=op,
                            attempt=attempt, reason=reason)
                if on_retry is not None:
                    on_retry(key, attempt, reason)
                delay = min(_BACKOFF_CAP_S, self.backoff_s * 2 ** (attempt - 1))
                time.sleep(delay * (0.5 + random.random() / 2))


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
        if hasattr(exc, "response") and isinstance(getattr(exc, "response", None), dict):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _transient(exc: BaseException) -> bool:
    cause = _client_error(exc)
    if cause is not None:
        response = getattr(cause, "response", {}) or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = response.get("Error", {}).get("Code", "")
        return status >= 500 or status == 429 or code in (
            "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
            "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable")
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError, ValueError)):
        return False
    name = type(exc).__name__
    return isinstance(exc, (ConnectionError, TimeoutError)) or any(
        word in name for word in ("Connection", "Timeout", "HTTPClientError", "IncompleteRead",
                                  "ServerDisconnected", "ClientPayload", "ReadError"))


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
            if os.stat(temp).st_size != size:
                raise RemoteError(f"{self.url}/{key}: the written file is not {size} bytes")
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
                _flush_range(out, start, end)
                return int(xxhash.xxh3_64_intdigest(data))

            return ObjectSum(size, self.part_bytes, tuple(self._run_parts(part, ranges)))

        result = self._retry("upload", key, lambda: self._write(key, size, fill), on_retry)
        assert isinstance(result, ObjectSum)
        return result

    def _put_small(self, key: str, data: bytes) -> None:
        self._retry("upload", key, lambda: self._write(
            key, len(data), lambda out: _pwrite(out, data, 0)))

    def _get_small(self, key: str, limit: int) -> bytes | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RemoteError(f"reading {self.url}/{key} failed: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise RemoteError(f"{self.url}/{key} is {size} bytes, more than the {limit} "
                                  "expected")
            return _pread(fd, 0, size) if size else b""
        finally:
            os.close(fd)

    def _size(self, key: str) -> int | None:
        try:
            info = os.stat(self._path(key), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return _pread(fd, start, end)
        finally:
            os.close(fd)

    def list_steps(self) -> list[str]:
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False)
                      and _KEY_PART.match(e.name) and not e.name.startswith("."))

    def list_dir(self, prefix: str) -> dict[str, int]:
        _check_key(prefix)
        try:
            entries = list(os.scandir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {e.name: e.stat(follow_symlinks=False).st_size for e in entries
                if e.is_file(follow_symlinks=False) and not e.name.startswith(".")}

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
                raise RemoteError(f"removing {self.url}/{key} failed: {exc}") from exc
            dirs.add(os.path.dirname(path))
        for directory in dirs:
            with contextlib.suppress(OSError):
                _fsync_dir(directory)
            with contextlib.suppress(OSError):  # an empty step prefix goes too
                if not os.listdir(directory) and directory != self.root:
                    os.rmdir(directory)
                    _fsync_dir(os.path.dirname(directory))


def _copy_range(src: int, dst: int, start: int, end: int) -> bool:
    """Copy bytes [start, end) from ``src`` to ``dst`` in the kernel (``copy_file_range``:
    no copy through user memory, which on the VMs measured made writes 3x slower than
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


def _flush_range(fd: int, start: int, end: int) -> None:
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

    def _upload_fd(self, fd: int, size: int, key: str, on_retry: OnRetry | None
                   ) -> ObjectSum:
        def send() -> ObjectSum:
            parts = []
            with self.fs.open(self._full(key), "wb") as out:
                for start, end in _ranges(size, self.part_bytes):
                    if self.gate is not None:
                        self.gate()
                    data = _pread(fd, start, end)
                    parts.append(int(xxhash.xxh3_64_intdigest(data)))
                    out.write(data)
            got = self._size(key)
            if got != size:
                raise RemoteError(f"{self.url}/{key} is {got} bytes after the upload, {size} "
                                  "were sent")
            return ObjectSum(size, self.part_bytes, tuple(parts))

        result = self._retry("upload", key, send, on_retry)
        assert isinstance(result, ObjectSum)
        return result

    def _put_small(self, key: str, data: bytes) -> None:
        def put() -> None:
            self.fs.pipe_file(self._full(key), data)
            got = self._size(key)
            if got != len(data):
                raise RemoteError(f"{self.url}/{key} is {got} bytes after the upload, "
                                  f"{len(data)} were sent")

        self._retry("upload", key, put)

    def _get_small(self, key: str, limit: int) -> bytes | None:
        size = self._size(key)
        if size is None:
            return None
        if size > limit:
            raise RemoteError(f"{self.url}/{key} is {size} bytes, more than the {limit} "
                              "expected")
        try:
            data: bytes = self._retry("download", key, lambda: self.fs.cat_file(self._full(key)))
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
        data: bytes = self.fs.cat_file(self._full(key), start=start, end=end)
        return data

    def _listing(self, path: str, label: str) -> list[dict[str, Any]]:
        def ls() -> list[dict[str, Any]]:
            try:
                self.fs.invalidate_cache(path)
                entries: list[dict[str, Any]] = self.fs.ls(path, detail=True)
                return entries
            except FileNotFoundError:
                return []

        result: list[dict[str, Any]] = self._retry("list", label, ls)
        return result

    def list_steps(self) -> list[str]:
        out = []
        for entry in self._listing(self.root, "(root)"):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") == "directory" and _KEY_PART.match(name):
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
        paths = [self._full(_check_key(k)) for k in keys]
        if not paths:
            return

        def rm() -> None:
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)

        self._retry("delete", keys[0], rm)
        self.fs.invalidate_cache(self.root)


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
        s3key = self._s3key(key)
        ranges = _ranges(size, self.part_bytes)
        if len(ranges) <= 1 or self.part_bytes < _S3_MIN_PART:
            if size > _S3_MAX_PUT:
                raise ConfigError(f"parts of {self.part_bytes} bytes are too small for S3 "
                                  "multipart uploads (at least 5 MiB)")
            data = _pread(fd, 0, size) if size else b""
            digest = hashlib.md5(data, usedforsecurity=False)

            def put() -> None:
                answer = self._call("put_object", Key=s3key, Body=data,
                                    ContentMD5=base64.b64encode(digest.digest()).decode())
                self._check_etag(key, answer.get("ETag"), f'"{digest.hexdigest()}"')

            self._retry("upload", key, put, on_retry)
            sums = tuple(xxhash.xxh3_64_intdigest(data[s:e]) for s, e in
                         _ranges(size, self.part_bytes))
            self._verify_uploaded(key, size, f'"{digest.hexdigest()}"')
            return ObjectSum(size, self.part_bytes, sums)
        upload = self._retry("upload", key, lambda: self._call(
            "create_multipart_upload", Key=s3key), on_retry)["UploadId"]
        try:
            def part(index: int, start: int, end: int) -> tuple[int, bytes]:
                data = _pread(fd, start, end)
                md5 = hashlib.md5(data, usedforsecurity=False)

                def send() -> None:
                    answer = self._call("upload_part", Key=s3key, UploadId=upload,
                                        PartNumber=index + 1, Body=data,
                                        ContentMD5=base64.b64encode(md5.digest()).decode())
                    self._check_etag(key, answer.get("ETag"), f'"{md5.hexdigest()}"')

                self._retry("upload", key, send, on_retry)
                return int(xxhash.xxh3_64_intdigest(data)), md5.digest()

            done = self._run_parts(part, ranges)
            self._retry("upload", key, lambda: self._call(
                "complete_multipart_upload", Key=s3key, UploadId=upload,
                MultipartUpload={"Parts": [
                    {"PartNumber": i + 1, "ETag": f'"{md5.hex()}"'}
                    for i, (_, md5) in enumerate(done)]}), on_retry)
        except BaseException:
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", Key=s3key, UploadId=upload)
            raise
        whole = hashlib.md5(b"".join(md5 for _, md5 in done), usedforsecurity=False)
        self._verify_uploaded(key, size, f'"{whole.hexdigest()}-{len(done)}"')
        return ObjectSum(size, self.part_bytes, tuple(x for x, _ in done))

    def _check_etag(self, key: str, got: Any, expected: str) -> None:
        """A store that answers with an MD5 ETag must answer with ours."""
        if isinstance(got, str) and re.fullmatch(r'"[0-9a-f]{32}(-[0-9]+)?"', got) and (
            got != expected
        ):
            raise CheckpointIntegrityError(
                f"{self.url}/{key}: the store holds other bytes than were sent (ETag {got}, "
                f"expected {expected})", path=f"{self.url}/{key}")

    def _verify_uploaded(self, key: str, size: int, etag: str) -> None:
        """After an upload: the object's size, and its ETag where it is an MD5 form."""
        try:
            head = self._retry("check", key, lambda: self._call("head_object",
                                                                 Key=self._s3key(key)))
            if head.get("ContentLength") != size:
                raise CheckpointIntegrityError(
                    f"{self.url}/{key} is {head.get('ContentLength')} bytes after the upload, "
                    f"{size} were sent", path=f"{self.url}/{key}")
            self._check_etag(key, head.get("ETag"), etag)
        except CheckpointIntegrityError:
            with contextlib.suppress(Exception):
                self._call("delete_object", Key=self._s3key(key))
            raise
        finally:
            self.fs.invalidate_cache(self.root)

    def _size(self, key: str) -> int | None:
        def head() -> int | None:
            try:
                answer = self._call("head_object", Key=self._s3key(key))
            except FileNotFoundError:
                return None
            return int(answer["ContentLength"])

        result: int | None = self._retry("stat", key, head)
        return result

    def _put_small(self, key: str, data: bytes) -> None:
        digest = hashlib.md5(data, usedforsecurity=False)

        def put() -> None:
            answer = self._call("put_object", Key=self._s3key(key), Body=data,
                                ContentMD5=base64.b64encode(digest.digest()).decode())
            self._check_etag(key, answer.get("ETag"), f'"{digest.hexdigest()}"')

        self._retry("upload", key, put)
        self._verify_uploaded(key, len(data), f'"{digest.hexdigest()}"')

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        answer = self._call("get_object", Key=self._s3key(key),
                            Range=f"bytes={start}-{end - 1}")
        body = answer["Body"]
        data: bytes = self._read_body(body)
        return data

    def _read_body(self, body: Any) -> bytes:
        from fsspec.asyn import sync

        async def read() -> bytes:
            async with body:
                data: bytes = await body.read()
                return data

        result: bytes = sync(self.fs.loop, read)
        return result

    def delete(self, keys: Sequence[str]) -> None:
        for chunk in _chunks([self._s3key(_check_key(k)) for k in keys], 1000):
            objects = [{"Key": k} for k in chunk]

            def delete(objects: list[dict[str, str]] = objects) -> Any:
                return self._call("delete_objects",
                                  Delete={"Objects": objects, "Quiet": True})

            self._retry("delete", keys[0], delete)
        self.fs.invalidate_cache(self.root)


def _chunks(items: list[str], n: int) -> Iterator[list[str]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


# ---------------------------------------------------------------------------- opening


def is_url(value: str) -> bool:
    """``value`` names a location by URL (``s3://...``), not a local path."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) is not None


def _display(url: str) -> str:
    """The URL without any user:password@ part."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@", r"\1", url)


def open_remote(url: str, *, threads: int = 8, part_bytes: int = PART_BYTES_DEFAULT,
                retries: int = 5, backoff_s: float = 0.5,
                options: Mapping[str, Any] | None = None) -> Remote:
    """The persistent root at ``url``: a directory (a path, or ``file://PATH``), ``s3://``,
    or another fsspec protocol with ``options`` for its file system."""
    kw: dict[str, Any] = {"threads": threads, "part_bytes": part_bytes, "retries": retries,
                          "backoff_s": backoff_s}
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", url)
    if match is None or match.group(1) == "file":
        path = url if match is None else match.group(2)
        if not path:
            raise ConfigError(f"persistent={url!r} names no directory")
        return _DirRemote(path, **kw)
    protocol, rest = match.group(1).lower(), match.group(2)
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"the persistent tier {protocol}://... needs fsspec",
                          hint="pip install 'ckpt_pipeline[s3]'") from None
    fs_options = dict(options or {})
    shown = _display(url)
    if protocol in ("s3", "s3a"):
        try:
            import s3fs  # noqa: F401
        except ImportError:
            raise ConfigError("the persistent tier s3://... needs s3fs",
                              hint="pip install 'ckpt_pipeline[s3]'") from None
        # Our retries, not the client's: one attempt per request at both s3fs and botocore.
        config = dict(fs_options.pop("config_kwargs", None) or {})
        config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        config.setdefault("max_pool_connections", max(10, 2 * threads))
        fs_options["config_kwargs"] = config
        fs_options.setdefault("skip_instance_cache", True)
        # Listings change under us (other ranks upload): never answer from a cached one.
        fs_options.setdefault("use_listings_cache", False)
        try:
            fs = fsspec.filesystem("s3", **fs_options)
        except Exception as exc:  # the message may quote options: do not repeat it
            raise ConfigError(f"the persistent tier {shown} could not be opened "
                              f"({type(exc).__name__})",
                              hint="check persistent_options") from None
        fs.retries = 1
        root = rest.strip("/")
        if not root:
            raise ConfigError(f"persistent={shown!r} names no bucket")
        return _S3Remote(shown, fs, root, **kw)
    try:
        fs = fsspec.filesystem(protocol, **fs_options)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"the persistent tier {shown}: unknown or unavailable protocol "
                          f"{protocol!r} ({type(exc).__name__})",
                          hint="use a directory or an fsspec URL (s3://...)") from None
    return _FsspecRemote(shown, fs, fs._strip_protocol(url), **kw)
