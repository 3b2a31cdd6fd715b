"""One persistent root: a directory on a shared file system, S3, or another fsspec URL.

Every object is moved in parts of ``part_bytes``, at most ``threads`` at once (so a bounded
number of parts in memory), and every part is hashed (xxh3-64) from the bytes actually sent or
received: the ``ObjectSum`` that the step commit object records. A download checks each part
against it before writing it.

The backends (each in a module of its own, imported when a URL needs it):

- ``tier_dir``: a directory, written as a local root is (temporary name, parts copied in the
  kernel and written out as they go, fsync, rename, fsync of the directory).
- ``tier_s3``: ``s3://`` through obstore (its Rust client): multipart uploads whose ETag is
  compared with the MD5s of what was sent, ranged parallel downloads.
- ``tier_fsspec``: any other fsspec protocol: streamed uploads, size checked after.

Requests that fail with a connection error, a timeout, a 5xx or a throttling answer are
retried with exponential backoff and jitter (``retries`` times, each logged as
``ckpt.persist.retry``); the client libraries' own retries are off, except for the parts of an
S3 multipart upload, which obstore sends and retries itself with the same settings. Any other
failure (a refused request, a missing bucket, a request the client cannot even build) is a
configuration or permission error: never retried, ``RemoteError.transient`` False. Every
request of S3 has a connect and a total deadline (``tier_s3``); the threads that wait on the
store are daemons (``workers``), so that a store that never answers cannot keep the process
alive. No message, log line or ``url`` carries the credentials of ``options``.
"""

from __future__ import annotations

import concurrent.futures
import errno as errno_mod
import math
import os
import random
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ..._logging import log, report_once
from ...errors import CheckpointIntegrityError, ConfigError, StorageError
from .workers import DaemonPool

__all__ = ("PART_BYTES_DEFAULT", "Conflict", "ObjectSum", "Remote", "RemoteError", "is_url",
           "open_remote")

PART_BYTES_DEFAULT = 64 * 1024 * 1024
BACKOFF_CAP_S = 10.0
SMALL_TIMEOUT_S = 30.0
"""Deadline of a request that carries no part: a listing, a head, a delete, a commit object."""
SLOWEST_RATE = 1024 * 1024
"""Bytes per second: a request that carries data slower than this times out."""
KEY_PART = re.compile(r"^[A-Za-z0-9._-]+$")
_SENSITIVE = re.compile(r"key|secret|token|password|passwd|credential|session|auth", re.I)

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
                   tuple(xxh(data[s:e]) for s, e in part_ranges(len(data), part_bytes)))

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

    ``key``, ``op`` and ``attempts`` say which request; ``missing``: the object does not exist;
    ``transient``: the store was unreachable or answered with a temporary error (an outage,
    which may end), not a configuration or permission error (which will not).
    """

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None,
                 missing: bool = False, key: str | None = None, op: str | None = None,
                 attempts: int = 1, transient: bool = False) -> None:
        super().__init__(message, path=path, hint=hint)
        self.missing = missing
        self.key = key
        self.op = op
        self.attempts = attempts
        self.transient = transient


class Conflict(RemoteError):
    """A conditional write found another version of the object than it expected (or one
    where it expected none)."""


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or any(not KEY_PART.match(p) or p in (".", "..") for p in parts):
        raise ValueError(f"{key!r} is not a key of the persistent tier: relative, "
                         "'/'-separated names of [A-Za-z0-9._-]")
    return key


def part_ranges(size: int, part_bytes: int) -> list[tuple[int, int]]:
    return [(start, min(size, start + part_bytes)) for start in range(0, size, part_bytes)]


def request_timeout(nbytes: int) -> float:
    """The total deadline of a request that carries ``nbytes`` of data."""
    return SMALL_TIMEOUT_S + nbytes / SLOWEST_RATE


def pread_exact(fd: int, start: int, end: int) -> bytes:
    chunks = []
    at = start
    while at < end:
        data = os.pread(fd, end - at, at)
        if not data:
            raise OSError(errno_mod.EIO, f"unexpected end of file at byte {at}")
        chunks.append(data)
        at += len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def xxh(data: bytes | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


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
        self._pool = DaemonPool(threads, "ckpt-persist-io")
        self._closed = False
        self.gate: Callable[[], None] | None = None

    # -- the interface -------------------------------------------------------------------

    def upload(self, local_path: str, key: str, *, on_retry: OnRetry | None = None
               ) -> ObjectSum:
        """Upload a local regular file as ``key``; return the checksum of what was sent."""
        check_key(key)
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
        check_key(key)
        self._put_small(key, bytes(data))

    def get_small(self, key: str, limit: int) -> bytes | None:
        """The bytes of ``key`` (at most ``limit`` of them); None when it does not exist."""
        check_key(key)
        return self._get_small(key, limit)

    def download(self, key: str, fd: int, expected: ObjectSum, *,
                 on_retry: OnRetry | None = None, first: Sequence[int] = (),
                 on_part: Callable[[int], None] | None = None) -> None:
        """Read ``key`` into ``fd`` at the same offsets, each part checked against
        ``expected`` before it is written. The parts numbered in ``first`` are fetched before
        the others (which go in order); ``on_part(index)`` is called once a part is written
        (an exception from it stops the download)."""
        check_key(key)
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
            if len(data) != end - start or xxh(data) != expected.parts[index]:
                raise CheckpointIntegrityError(
                    f"{where}: part {index} (bytes [{start}, {end})) does not match the "
                    "checksum recorded when it was uploaded", path=where,
                    hint="the object changed after it was uploaded; restore another step")
            pwrite_all(fd, data, start)
            if on_part is not None:
                on_part(index)

        ranges = part_ranges(size, expected.part_bytes)
        early = [i for i in dict.fromkeys(first) if 0 <= i < len(ranges)]
        order = early + sorted(set(range(len(ranges))) - set(early))
        self._run_parts(one, ranges, gated=False, order=order)

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
        check_key(key)
        return self._size(key) is not None

    def get_versioned(self, key: str, limit: int) -> tuple[bytes, str | None] | None:
        """The bytes of ``key`` (at most ``limit``) and its version (what ``put_versioned``
        expects); None when it does not exist."""
        check_key(key)
        return self._get_versioned(key, limit)

    def put_versioned(self, key: str, data: bytes, expected: str | None) -> str | None:
        """Write ``key`` only if it is still at version ``expected`` (None: only if it does
        not exist); return the new version. ``Conflict`` when it is not. Atomic where the
        store has conditional writes (S3's If-None-Match and If-Match; a directory's
        ``link`` and a lock); a compare-then-write elsewhere (fsspec)."""
        check_key(key)
        return self._put_versioned(key, bytes(data), expected)

    def stamp(self, key: str) -> str | None:
        """What identifies the stored version of ``key`` (an S3 ETag; a file's inode,
        modification time and size); None when it does not exist or the store has none."""
        check_key(key)
        return self._stamp(key)

    def stamps(self, prefix: str) -> dict[str, str | None]:
        """``{name: stamp}`` of the objects directly under ``prefix``, as ``stamp``."""
        check_key(prefix)
        return self._stamps(prefix)

    def leftovers(self, prefix: str) -> list[str]:
        """Names of what killed uploads left under ``prefix`` that ``list_dir`` does not show
        (a directory's temporaries); [] where the store keeps none visible."""
        check_key(prefix)
        return []

    def close(self) -> None:
        """Stop: parts not started are dropped, and a request that fails from now on is not
        retried (one in flight ends by its deadline, in its daemon thread)."""
        self._closed = True
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

    def _read_range(self, key: str, start: int, end: int) -> bytes | memoryview:
        raise NotImplementedError

    def _get_versioned(self, key: str, limit: int) -> tuple[bytes, str | None] | None:
        data = self._get_small(key, limit)
        return None if data is None else (data, f"xxh3:{xxh(data):016x}")

    def _put_versioned(self, key: str, data: bytes, expected: str | None) -> str | None:
        """Compare, then write: a store without conditional writes (see ``put_versioned``)."""
        current = self._get_versioned(key, len(data) + (1 << 20))
        if (None if current is None else current[1]) != expected:
            raise Conflict(f"{self._where(key)} changed since it was read",
                           path=self._where(key), key=key, op="upload")
        self._put_small(key, data)
        return f"xxh3:{xxh(data):016x}"

    def _stamp(self, key: str) -> str | None:
        prefix, _, name = key.rpartition("/")
        return self._stamps(prefix).get(name)

    def _stamps(self, prefix: str) -> dict[str, str | None]:
        return dict.fromkeys(self.list_dir(prefix))

    def _explain(self, exc: BaseException) -> Failure:
        """What the exception of a failed request means (a backend knows its client's)."""
        return explain_generic(exc)

    # -- shared helpers ------------------------------------------------------------------

    def _where(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def _too_large(self, key: str, size: int, limit: int) -> RemoteError:
        return RemoteError(f"{self._where(key)} is {size} bytes, more than the {limit} "
                           "expected", path=self._where(key), key=key, op="download")

    def _run_parts(self, fn: Callable[[int, int, int], Any],
                   ranges: list[tuple[int, int]], *, gated: bool = True,
                   order: Sequence[int] | None = None) -> list[Any]:
        """``fn(index, start, end)`` for every part, ``threads`` at once, started in ``order``
        (default: by index); returns the results by index. The first error cancels the parts
        not started, waits for those running, and is raised."""
        gate = self.gate if gated else None
        if gate is not None:
            inner = fn

            def fn(index: int, start: int, end: int) -> Any:
                gate()
                return inner(index, start, end)

        if len(ranges) <= 1:
            return [fn(i, s, e) for i, (s, e) in enumerate(ranges)]
        indices = list(range(len(ranges))) if order is None else list(order)
        futures = {i: self._pool.submit(fn, i, *ranges[i]) for i in indices}
        try:
            concurrent.futures.wait(futures.values(),
                                    return_when=concurrent.futures.FIRST_EXCEPTION)
            for f in futures.values():
                error = f.exception() if f.done() and not f.cancelled() else None
                if error is not None:
                    raise error
            return [futures[i].result() for i in range(len(ranges))]
        finally:
            for f in futures.values():
                f.cancel()
            concurrent.futures.wait(futures.values())

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
                failure = self._explain(exc)
                reason = self._redact(failure.reason)
                if not failure.transient:
                    raise RemoteError(
                        f"{op} of {where} failed after {attempt + 1} attempt(s): {reason}",
                        path=where, missing=failure.missing, key=key, op=op,
                        attempts=attempt + 1, hint=failure.hint) from None
                if attempt >= self.retries or self._closed:
                    raise RemoteError(
                        f"{op} of {where} failed after {attempt + 1} attempts: {reason}",
                        path=where, key=key, op=op, attempts=attempt + 1, transient=True,
                        hint=UNAVAILABLE_HINT) from None
                attempt += 1
                log.warning("ckpt.persist.retry", url=self.url, key=key, op=op,
                            attempt=attempt, reason=reason)
                if on_retry is not None:
                    try:
                        on_retry(key, attempt, reason)
                    except Exception as exc:  # a subscriber's failure never fails the upload
                        report_once("persist on_retry callback", exc)
                delay = min(BACKOFF_CAP_S, self.backoff_s * 2 ** (attempt - 1))
                time.sleep(delay * (0.5 + random.random() / 2))


# The exceptions are re-raised ``from None``: a client library's exception (and its chained
# ones) may quote request parameters, and tracebacks end up in logs. ``reason`` keeps what
# the store said.


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed request: what the store said, whether another attempt may succeed (a
    connection error, a timeout, a 5xx, throttling), whether the object does not exist, and
    for a failure that is not transient, what setting to fix (``hint``)."""

    reason: str
    transient: bool
    missing: bool = False
    hint: str | None = None


UNAVAILABLE_HINT = ("the store did not answer in time or answered with a temporary error "
                    "(an outage, throttling); the local tier keeps every step")


TRANSIENT_CODES = frozenset((
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"))
_TRANSIENT_NAMES = ("Connect", "Timeout", "HTTPClientError", "IncompleteRead",
                    "ServerDisconnected", "ClientPayload", "ClientOSError", "ReadError",
                    "ResponseParserError", "ProtocolError")


def explain_generic(exc: BaseException) -> Failure:
    """An exception of the OS or of an unknown client: connection errors and timeouts (by
    type, or by the type names of the usual HTTP clients) are transient."""
    reason = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PermissionError):
        return Failure(reason, False, hint="the persistent tier refused access: check its "
                       "permissions and the credentials in persistent_options")
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError)):
        return Failure(reason, False, isinstance(exc, FileNotFoundError))
    transient = isinstance(exc, (ConnectionError, TimeoutError)) or any(
        word in type(e).__name__ for e in _chain(exc) for word in _TRANSIENT_NAMES)
    return Failure(reason, transient)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    for _ in range(8):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__


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
    """The persistent root at ``url``: a directory (a path, or ``file://PATH``), ``s3://``
    (``options``: obstore's S3 settings), or another fsspec protocol (``options``: its file
    system's)."""
    shown = _display(url)
    if type(threads) is not int or threads < 1:
        raise ConfigError(f"threads={threads!r} for {shown}: give a count of at least 1")
    if type(part_bytes) is not int or part_bytes < 1:
        raise ConfigError(f"part_bytes={part_bytes!r} for {shown}: give a positive size")
    if type(retries) is not int or retries < 0:
        raise ConfigError(f"retries={retries!r} for {shown}: give a count of at least 0")
    if not backoff_s >= 0:
        raise ConfigError(f"backoff_s={backoff_s!r} for {shown}: give seconds, at least 0")
    settings = dict(options or {})
    kw: dict[str, Any] = {"threads": threads, "part_bytes": part_bytes, "retries": retries,
                          "backoff_s": backoff_s, "hidden": _secret_values(settings, url)}
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", url)
    if match is None or match.group(1).lower() == "file":
        path = url if match is None else match.group(2)
        if not path:
            raise ConfigError(f"persistent={shown!r} names no directory")
        from .tier_dir import DirRemote

        return DirRemote(path, **kw)
    protocol = match.group(1).lower()
    if protocol in ("s3", "s3a"):
        if shown != url:
            raise ConfigError(f"persistent={shown!r}: credentials in an s3:// URL are not "
                              "used", hint="pass them in the options (access_key_id, "
                              "secret_access_key), or in the AWS_* environment variables")
        bucket, _, prefix = match.group(2).strip("/").partition("/")
        if not bucket:
            raise ConfigError(f"persistent={shown!r} names no bucket")
        from .tier_s3 import S3Remote

        return S3Remote(shown, bucket, prefix, settings, **kw)
    from .tier_fsspec import open_fsspec

    return open_fsspec(url, shown, protocol, settings, **kw)
