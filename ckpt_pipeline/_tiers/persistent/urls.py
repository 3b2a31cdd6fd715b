"""Opening a persistent root by its URL: the backend it needs, its settings checked, and the
credentials that no message, log line or ``url`` may show.

A path or ``file://PATH`` is a directory (``tier_dir``), ``s3://`` S3 (``tier_s3``), any
other protocol fsspec's (``tier_fsspec``); each backend is imported only when a URL needs it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError
from .remote import Remote

__all__ = ("PART_BYTES_DEFAULT", "display_url", "is_url", "open_remote")

PART_BYTES_DEFAULT = 64 * 1024 * 1024
_SENSITIVE = re.compile(r"key|secret|token|password|passwd|credential|session|auth", re.I)


def is_url(value: str) -> bool:
    """``value`` names a location by URL (``s3://...``), not a local path."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) is not None


def display_url(url: str) -> str:
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
    shown = display_url(url)
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
