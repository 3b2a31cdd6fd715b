"""The persistent tier on S3 and S3-compatible stores (MinIO, Ceph, moto), through obstore.

- **Uploads.** A file of at most one part goes up in one PUT. A larger one is a multipart
  upload in parts of ``part_bytes``: the pipeline's threads read and hash the parts (xxh3 for
  the commit object, MD5 for the ETag), at most ``AHEAD`` ahead of obstore, which sends up to
  ``threads`` of them at once (``s3_upload``). Memory stays bounded: ``threads + AHEAD + 1``
  parts.
- **Checks.** Every request carries the SHA-256 of its body in its signature (SigV4), which
  the server checks. After an upload, the object's size and ETag are compared with the MD5s of
  what was sent (where the store gives an MD5 ETag; SSE-KMS and some stores do not); an object
  that does not match is deleted. obstore aborts a multipart upload that fails, so no half
  object ever appears and no hidden parts stay billed.
- **Retries.** The parts of a multipart upload are sent and retried by obstore itself, with
  the pipeline's retry count and backoff (a multipart upload is one call to it, and one failed
  part must not restart the object). Every other request is sent once by obstore and retried
  here, each retry logged (``Remote._retry``).
- **Conditional writes.** The owner object is written with ``If-None-Match: *`` (create) or
  ``If-Match: ETag`` (update), through obstore's ``mode``: the store decides between two jobs.
- **Leftovers.** A process killed during a multipart upload leaves the upload open, invisible
  to listings (obstore cannot list or abort it afterwards): give the bucket a lifecycle rule
  ``AbortIncompleteMultipartUpload`` (docs/distributed.md). What a killed promotion completed
  is listed and removed by the promoter with the step.
  here, each retry logged (``Remote._retry``). Only transient failures are retried (a
  connection error, a timeout, a 5xx, throttling); a refused request (403), a missing bucket
  or a request the HTTP client cannot build fails at once, naming the setting to fix
  (``s3_errors``).
- **Deadlines.** Every request has a connect deadline (``CONNECT_TIMEOUT``, 5 s) and a total
  one: ``SMALL_TIMEOUT_S`` (30 s) for listings, heads, deletes and commit objects, and for a
  request that carries a part ``SMALL_TIMEOUT_S`` plus a second per MiB of the part (94 s for
  64 MiB parts: a part must move at 1 MiB/s at least). ``client_options`` ``connect_timeout``
  and ``timeout`` replace them (then for every request).
- **Settings.** ``options`` are obstore's S3 settings (``endpoint``, ``region``,
  ``access_key_id``, ``secret_access_key``, ``session_token``, ...; the ``AWS_*`` environment
  variables are read too, ``AWS_ENDPOINT_URL`` among them) and ``client_options`` (obstore's
  HTTP client settings). An ``http://`` endpoint, given either way, is allowed without saying
  so again (MinIO, a local test server); one that ``allow_http`` forbids is a ConfigError.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from ...errors import ConfigError
from .objects import KEY_PART, LocalFile, ObjectSum, check_key, part_ranges, xxh
from .remote import Remote
from .retries import (
    BACKOFF_CAP_S,
    SMALL_TIMEOUT_S,
    UNAVAILABLE_HINT,
    Conflict,
    Failure,
    OnRetry,
    RemoteError,
    request_timeout,
)
from .s3_errors import S3Place, explain_s3, first_line
from .s3_upload import (
    S3_MAX_PUT,
    S3_MIN_PART,
    PartSum,
    etag_matches,
    multipart_etag,
    read_ahead,
    single_etag,
)

__all__ = ("S3Remote",)

CONNECT_TIMEOUT = timedelta(seconds=5)
_RETRY_WINDOW = timedelta(minutes=5)  # signed requests expire after 15
_ENDPOINT_OPTIONS = ("endpoint", "endpoint_url", "aws_endpoint", "aws_endpoint_url")
_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT")


class S3Remote(Remote):
    """An S3 bucket and prefix (see the module docstring)."""

    def __init__(self, url: str, bucket: str, prefix: str, options: Mapping[str, Any],
                 **kw: Any) -> None:
        super().__init__(url, **kw)
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError:
            raise ConfigError(f"the persistent tier {url} needs obstore",
                              hint="pip install 'ckpt_pipeline[s3]'") from None
        self._ob = obstore
        settings = dict(options)
        if "retry_config" in settings:
            raise ConfigError(f"the persistent tier {url}: retry_config is the pipeline's",
                              hint="set PersistentConfig(retries=) instead")
        given = settings.pop("client_options", None) or {}
        if not isinstance(given, Mapping):
            raise ConfigError(f"the persistent tier {url}: client_options must be a mapping of "
                              f"settings, not {type(given).__name__}",
                              hint="for example options={'client_options': {'timeout': '60s'}}")
        client = dict(given)
        self._endpoint, self._endpoint_from = _endpoint(settings)
        self._check_endpoint(client)
        client.setdefault("connect_timeout", CONNECT_TIMEOUT)
        part_timeout = timedelta(seconds=request_timeout(self.part_bytes))

        def store(retries: int, timeout: timedelta) -> Any:
            backoff = {"init_backoff": timedelta(seconds=self.backoff_s),
                       "max_backoff": timedelta(seconds=BACKOFF_CAP_S), "base": 2.0}
            retry = {"max_retries": retries, "backoff": backoff,
                     "retry_timeout": _RETRY_WINDOW}
            kwargs: dict[str, Any] = {"prefix": prefix or None,
                                      "client_options": {"timeout": timeout, **client},
                                      "retry_config": retry, **settings}
            return S3Store(bucket, **kwargs)

        try:
            # One attempt per call: retried (and logged) here. Listings, heads, deletes and
            # commit objects have the short deadline, requests that carry a part the long one.
            self._small = store(0, timedelta(seconds=SMALL_TIMEOUT_S))
            self._store = store(0, part_timeout)
            self._parts_store = store(self.retries, part_timeout)  # multipart: obstore retries
        except Exception as exc:  # the message names a bad key or value; never echo secrets
            raise ConfigError(f"the persistent tier {url} could not be opened: "
                              f"{self._redact(first_line(exc))}",
                              hint="check its options: obstore's S3 settings (endpoint, "
                                   "region, access_key_id, ...) and client_options") from None

    def _check_endpoint(self, client: dict[str, Any]) -> None:
        """The endpoint (an option or ``AWS_ENDPOINT_URL``) must be an http(s) URL (obstore
        fails without one at the first request, or panics); a plain ``http://`` one is
        allowed unless ``allow_http`` says otherwise: ConfigErrors here, not a "builder
        error" at the first request."""
        scheme = self._endpoint.partition("://")[0].lower() if "://" in self._endpoint else ""
        if self._endpoint and scheme not in ("http", "https"):
            raise ConfigError(
                f"the persistent tier {self.url}: the endpoint {self._endpoint!r} (from "
                f"{self._endpoint_from}) is not an http:// or https:// URL",
                hint="give the full URL, for example endpoint='https://s3.example.com' or "
                     "'http://127.0.0.1:9000'")
        if scheme != "http":
            return
        if "allow_http" in client:
            forbidden, where = not client["allow_http"], "client_options allow_http"
        elif "AWS_ALLOW_HTTP" in os.environ:
            value = os.environ["AWS_ALLOW_HTTP"].strip().lower()
            forbidden, where = value in ("false", "0", "no", "off"), "AWS_ALLOW_HTTP"
        else:
            client["allow_http"] = True
            return
        if forbidden:
            raise ConfigError(
                f"the persistent tier {self.url}: the endpoint {self._endpoint} (from "
                f"{self._endpoint_from}) is plain http://, and {where} forbids it",
                hint="use an https:// endpoint, or allow http: client_options="
                     "{'allow_http': True} in PersistentConfig(options=) (or AWS_ALLOW_HTTP=true)")

    # -- uploads -------------------------------------------------------------------------

    def _upload(self, source: LocalFile, key: str, on_retry: OnRetry | None) -> ObjectSum:
        size = source.size
        ranges = part_ranges(size, self.part_bytes)
        if len(ranges) > 1 and self.part_bytes >= S3_MIN_PART:
            return self._multipart(source, key, ranges)
        if size > S3_MAX_PUT:
            raise ConfigError(
                f"{self._where(key)}: {size} bytes need a multipart upload, and parts of "
                f"{self.part_bytes} bytes are smaller than S3's minimum of 5 MiB",
                hint="set the part size to at least 5 MiB")
        if self.gate is not None:
            self.gate()
        data = source.read(0, size)
        self._put_one(key, data, on_retry)
        return ObjectSum(size, self.part_bytes, tuple(xxh(data[s:e]) for s, e in ranges))

    def _put_one(self, key: str, data: bytes | bytearray, on_retry: OnRetry | None,
                 store: Any = None) -> None:
        md5 = hashlib.md5(data, usedforsecurity=False).digest()
        into = self._store if store is None else store
        self._retry("upload", key, lambda: self._ob.put(into, key, data, use_multipart=False),
                    on_retry)
        self._verify(key, len(data), single_etag(md5))

    def _multipart(self, source: LocalFile, key: str, ranges: list[tuple[int, int]]
                   ) -> ObjectSum:
        sums: list[PartSum] = []
        parts = read_ahead(source, ranges, self._pool, self.gate, sums)
        try:
            self._ob.put(self._parts_store, key, parts, chunk_size=self.part_bytes,
                         max_concurrency=self.threads)
        except Exception as exc:
            failure = self._explain(exc)
            attempts = self.retries + 1 if failure.transient else 1
            where = self._where(key)
            raise RemoteError(
                f"upload of {where} failed after {attempts} attempt"
                f"{'s' if attempts > 1 else ''} of one of its requests: "
                f"{self._redact(failure.reason)}", path=where, key=key, op="upload",
                attempts=attempts, missing=failure.missing, transient=failure.transient,
                hint=UNAVAILABLE_HINT if failure.transient else failure.hint) from None
        finally:
            parts.close()  # no read of the file may still run once it is closed
        self._verify(key, source.size, multipart_etag([md5 for _, md5 in sums]))
        return ObjectSum(source.size, self.part_bytes, tuple(x for x, _ in sums))

    def _verify(self, key: str, size: int, etag: str) -> None:
        """After an upload: the object's size, and its ETag where it has an MD5 form; an
        object that does not match is deleted."""
        head = self._retry("check", key, lambda: self._ob.head(self._small, key))
        got_size, got_etag = head.get("size"), head.get("e_tag")
        if got_size == size and etag_matches(got_etag, etag):
            return
        with contextlib.suppress(Exception):
            self._ob.delete(self._small, key)
        raise RemoteError(
            f"{self._where(key)} holds other bytes than were sent ({got_size} bytes, ETag "
            f"{got_etag}; sent {size} bytes, ETag {etag}); it was deleted",
            path=self._where(key), key=key, op="upload")

    def _put_small(self, key: str, data: bytes) -> None:
        self._put_one(key, data, None, self._small)

    # -- reads ---------------------------------------------------------------------------

    def _get_small(self, key: str, limit: int) -> bytes | None:
        def get() -> bytes | None:
            try:
                result = self._ob.get(self._small, key)
            except FileNotFoundError:
                return None
            size = int(result.meta["size"])
            if size > limit:
                raise self._too_large(key, size, limit)
            return bytes(result.bytes())

        data: bytes | None = self._retry("download", key, get)
        return data

    def _get_versioned(self, key: str, limit: int) -> tuple[bytes, str | None] | None:
        def get() -> tuple[bytes, str | None] | None:
            try:
                result = self._ob.get(self._store, key)
            except FileNotFoundError:
                return None
            size = int(result.meta["size"])
            if size > limit:
                raise self._too_large(key, size, limit)
            tag = result.meta.get("e_tag")
            return bytes(result.bytes()), None if tag is None else str(tag)

        found: tuple[bytes, str | None] | None = self._retry("download", key, get)
        return found

    def _put_versioned(self, key: str, data: bytes, expected: str | None) -> str | None:
        errors = self._ob.exceptions
        mode: Any = "create" if expected is None else {"e_tag": expected}

        def put() -> Any:
            try:
                return self._ob.put(self._store, key, data, mode=mode, use_multipart=False)
            except (errors.AlreadyExistsError, errors.PreconditionError):
                raise Conflict(f"{self._where(key)} "
                               f"{'exists' if expected is None else 'changed since it was read'}",
                               path=self._where(key), key=key, op="upload") from None

        result = self._retry("upload", key, put)
        tag = result.get("e_tag") if isinstance(result, Mapping) else None
        return None if tag is None else str(tag)

    def _stamp(self, key: str) -> str | None:
        def head() -> str | None:
            try:
                tag = self._ob.head(self._store, key).get("e_tag")
            except FileNotFoundError:
                return None
            return None if tag is None else str(tag)

        found: str | None = self._retry("stat", key, head)
        return found

    def _stamps(self, prefix: str) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for entry in self._listing(prefix or None)["objects"]:
            name = str(entry["path"]).rsplit("/", 1)[-1]
            if not name.startswith("."):
                tag = entry.get("e_tag")
                out[name] = None if tag is None else str(tag)
        return out

    def _size(self, key: str) -> int | None:
        def head() -> int | None:
            try:
                return int(self._ob.head(self._small, key)["size"])
            except FileNotFoundError:
                return None

        size: int | None = self._retry("stat", key, head)
        return size

    def _read_range(self, key: str, start: int, end: int) -> bytes | memoryview:
        if start == end:
            return b""
        return memoryview(self._ob.get_range(self._store, key, start=start, end=end))

    def _listing(self, prefix: str | None) -> dict[str, Any]:
        answer: dict[str, Any] = self._retry(
            "list", prefix or "", lambda: self._ob.list_with_delimiter(self._small, prefix))
        return answer

    def list_steps(self) -> list[str]:
        names = (p.rstrip("/").rsplit("/", 1)[-1]
                 for p in self._listing(None)["common_prefixes"])
        return sorted(n for n in names if KEY_PART.match(n) and not n.startswith("."))

    def list_dir(self, prefix: str) -> dict[str, int]:
        check_key(prefix)
        out = {}
        for entry in self._listing(prefix)["objects"]:
            name = str(entry["path"]).rsplit("/", 1)[-1]
            if not name.startswith("."):
                out[name] = int(entry["size"])
        return out

    def delete(self, keys: Sequence[str]) -> None:
        checked = [check_key(k) for k in keys]
        for start in range(0, len(checked), 1000):  # S3's most keys per request
            chunk = checked[start:start + 1000]

            def send(chunk: list[str] = chunk) -> None:
                self._ob.delete(self._small, chunk)

            self._retry("delete", chunk[0], send)

    # -- errors --------------------------------------------------------------------------

    def _explain(self, exc: BaseException) -> Failure:
        return explain_s3(exc, self._ob.exceptions.BaseError,
                          S3Place(self.url, self._endpoint, self._endpoint_from))

def _endpoint(settings: Mapping[str, Any]) -> tuple[str, str]:
    """(the endpoint obstore will use, the setting it comes from); ("", "") for AWS's."""
    for key in _ENDPOINT_OPTIONS:
        if settings.get(key):
            return str(settings[key]), f"PersistentConfig(options=) {key!r}"
    for name in _ENDPOINT_VARIABLES:
        if os.environ.get(name):
            return os.environ[name], name
    return "", ""
