"""The persistent tier on any other fsspec file system (``gs://``, ``az://``, ``memory://``,
...): uploads streamed through the file system's writer, sizes checked after an upload,
downloads as parallel ranged reads.

File systems have the deadlines their own options give, or none; so every call to one also
runs in a daemon thread that is waited for at most the tier's own deadline
(``SMALL_TIMEOUT_S``, or ``request_timeout`` of the bytes it carries): past it, the call
counts as a timeout (transient: retried) and is left to end alone. Only bytes cross into such
a thread, never a file descriptor, so a call that ends late cannot read another file.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ...errors import ConfigError
from .objects import KEY_PART, LocalFile, ObjectSum, check_key, part_ranges, xxh
from .remote import Remote
from .retries import SMALL_TIMEOUT_S, OnRetry, RemoteError, request_timeout
from .workers import bounded

__all__ = ("FsspecRemote", "open_fsspec")

_T = TypeVar("_T")


def open_fsspec(url: str, shown: str, protocol: str, options: Mapping[str, Any],
                **kw: Any) -> FsspecRemote:
    """The fsspec file system of ``protocol`` for ``url``, opened with ``options``."""
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"the persistent tier {shown} needs fsspec",
                          hint="pip install 'ckpt_pipeline[fsspec]'") from None
    try:
        cls = fsspec.get_filesystem_class(protocol)
        fs = cls(**{**cls._get_kwargs_from_urls(url), **options})
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"the persistent tier {shown}: unknown or unavailable protocol "
                          f"{protocol!r} ({type(exc).__name__})",
                          hint="use a directory, s3://..., or another fsspec URL") from None
    except Exception as exc:  # the message may quote options: do not repeat it
        raise ConfigError(f"the persistent tier {shown} could not be opened "
                          f"({type(exc).__name__})", hint="check its options") from None
    return FsspecRemote(shown, fs, cls._strip_protocol(url), **kw)


class FsspecRemote(Remote):
    """Any fsspec file system: streamed uploads, ranged parallel reads, sizes checked."""

    def __init__(self, url: str, fs: Any, root: str, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.fs = fs
        self.root = root.rstrip("/")

    def _full(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _call(self, fn: Callable[[], _T], timeout: float | None = None) -> _T:
        """``fn()`` (a call to the file system) within ``timeout`` seconds (None:
        ``SMALL_TIMEOUT_S``; see the module docstring)."""
        return bounded(fn, SMALL_TIMEOUT_S if timeout is None else timeout,
                       "ckpt-persist-fsspec")

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
            self._call(lambda: self.fs.rm_file(self._full(key)))

    def _upload(self, source: LocalFile, key: str, on_retry: OnRetry | None) -> ObjectSum:
        size = source.size

        def send() -> ObjectSum:
            parts = []
            out = self._call(lambda: self.fs.open(self._full(key), "wb"))
            try:
                for start, end in part_ranges(size, self.part_bytes):
                    if self.gate is not None:
                        self.gate()
                    data = source.read(start, end)
                    parts.append(xxh(data))
                    self._call(functools.partial(out.write, data), request_timeout(len(data)))
            except BaseException:
                # A buffered file would commit what it has when closed: throw it away.
                with contextlib.suppress(Exception):
                    out.discard() if hasattr(out, "discard") else out.close()
                with contextlib.suppress(Exception):
                    self._remove(key)
                raise
            self._call(out.close, request_timeout(min(size, self.part_bytes)))
            return ObjectSum(size, self.part_bytes, tuple(parts))

        result = self._retry("upload", key, send, on_retry)
        self._check_size(key, size)
        assert isinstance(result, ObjectSum)
        return result

    def _put_small(self, key: str, data: bytes) -> None:
        self._retry("upload", key, lambda: self._call(
            lambda: self.fs.pipe_file(self._full(key), data), request_timeout(len(data))))
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
                found = self._call(lambda: self.fs.info(self._full(key)))
            except FileNotFoundError:
                return None
            if found.get("type") == "directory":
                return None
            return int(found["size"])

        result: int | None = self._retry("stat", key, info)
        return result

    def _stamp(self, key: str) -> str | None:
        """None: fsspec gives no version that every file system fills in; the promoter
        compares each rank's commit record by content instead."""
        return None

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        if start == end:
            return b""
        data: bytes = self._call(lambda: self.fs.cat_file(self._full(key), start=start, end=end),
                                 request_timeout(end - start))
        return data

    def _listing(self, path: str, label: str) -> list[dict[str, Any]]:
        def ls() -> list[dict[str, Any]]:
            try:
                self.fs.invalidate_cache(path)
                entries: list[dict[str, Any]] = self._call(lambda: self.fs.ls(path, detail=True))
                return entries
            except FileNotFoundError:
                return []

        result: list[dict[str, Any]] = self._retry("list", label, ls)
        return result

    def list_steps(self) -> list[str]:
        out = []
        for entry in self._listing(self.root, ""):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") == "directory" and KEY_PART.match(name) and (
                not name.startswith(".")
            ):
                out.append(name)
        return sorted(out)

    def list_dir(self, prefix: str) -> dict[str, int]:
        check_key(prefix)
        out = {}
        for entry in self._listing(self._full(prefix), prefix):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") != "directory" and not name.startswith("."):
                out[name] = int(entry.get("size") or 0)
        return out

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            check_key(key)
            self._retry("delete", key, functools.partial(self._remove, key))
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.root)
