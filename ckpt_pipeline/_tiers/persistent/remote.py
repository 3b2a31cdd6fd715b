"""One persistent root: a directory on a shared file system, S3, or another fsspec URL.

Every object is moved in parts of ``part_bytes``, at most ``threads`` at once (so a bounded
number of parts in memory), and every part is hashed (xxh3-64) from the bytes actually sent or
received: the ``ObjectSum`` that the step commit object records. A download checks each part
against it before writing it.

The backends (each in a module of its own, which ``urls.open_remote`` imports when a URL needs
it):

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

The local side of every transfer goes through the local root's ``Storage``: an upload reads
the committed file (``LocalFile``), a download writes into the file it is given, so that the
fault and power-loss storages see both. Keys, parts and checksums are in ``objects``; the
deadlines, failures and errors of requests in ``retries``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..._logging import log, report_once
from ...errors import CheckpointIntegrityError, StorageError
from ...storage import Storage
from .objects import LocalFile, ObjectSum, check_key, part_ranges, xxh
from .retries import (
    BACKOFF_CAP_S,
    UNAVAILABLE_HINT,
    Conflict,
    Failure,
    OnRetry,
    RemoteError,
    explain_generic,
)
from .workers import DaemonPool

__all__ = ("ObjectSum", "Remote")  # ObjectSum (objects.py): what upload returns, download checks


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

    def upload(self, storage: Storage, rel: str, key: str, *,
               on_retry: OnRetry | None = None) -> ObjectSum:
        """Upload the regular file ``rel`` of ``storage``'s root as ``key`` (read through
        ``storage``); return the checksum of what was sent."""
        check_key(key)
        path = os.path.join(str(storage.root), rel)
        try:
            fd, size = storage.open_read(rel)
        except StorageError as exc:
            raise StorageError(f"cannot open {path} for upload: {exc.message}", path=path,
                               hint=exc.hint, errno=exc.errno) from exc
        try:
            return self._upload(LocalFile(storage, fd, size, path), key, on_retry)
        finally:
            storage.close(fd)

    def put_small(self, key: str, data: bytes) -> None:
        """Write ``data`` as ``key`` in one request; its size is checked after."""
        check_key(key)
        self._put_small(key, bytes(data))

    def get_small(self, key: str, limit: int) -> bytes | None:
        """The bytes of ``key`` (at most ``limit`` of them); None when it does not exist."""
        check_key(key)
        return self._get_small(key, limit)

    def download(self, key: str, storage: Storage, fd: int, expected: ObjectSum, *,
                 on_retry: OnRetry | None = None, first: Sequence[int] = (),
                 on_part: Callable[[int], None] | None = None) -> None:
        """Read ``key`` into ``fd`` (a file being written through ``storage``) at the same
        offsets, each part checked against ``expected`` before it is written. The parts
        numbered in ``first`` are fetched before the others (which go in order);
        ``on_part(index)`` is called once a part is written (an exception from it stops the
        download)."""
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
            storage.pwrite(fd, memoryview(data), start)
            if on_part is not None:
                on_part(index)

        ranges = part_ranges(size, expected.part_bytes)
        early = [i for i in dict.fromkeys(first) if 0 <= i < len(ranges)]
        order = early + sorted(set(range(len(ranges))) - set(early))
        self._run_parts(one, ranges, gated=False, order=order)

    def read_into(self, key: str, offset: int, into: memoryview) -> None:
        """Fill ``into`` with the bytes [offset, offset + len(into)) of ``key``, in requests
        of at most ``part_bytes``, each retried as a download's part is. The bytes are not
        checked here (a range does not line up with the parts the commit object sums): the
        caller verifies them, as a reshard does a shard's header by its checksum and its
        data by checksum block."""
        check_key(key)
        view = into.cast("B") if into.format != "B" or into.ndim != 1 else into
        where = self._where(key)
        done = 0
        while done < len(view):
            start, end = offset + done, offset + min(len(view), done + self.part_bytes)
            data = self._retry("download", key,
                               functools.partial(self._read_range, key, start, end))
            if len(data) != end - start:
                raise CheckpointIntegrityError(
                    f"{where}: bytes [{start}, {end}) came back as {len(data)} bytes",
                    path=where, hint="the object is shorter than its commit object says; "
                                     "restore another step")
            view[done:done + end - start] = data
            done += end - start

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

    def _upload(self, source: LocalFile, key: str, on_retry: OnRetry | None) -> ObjectSum:
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
