"""The flat option spellings of earlier releases, mapped into their groups.

Before the config was grouped, ``replicas=1, persist_every=10`` were fields of their own. Each
old spelling a user could pass still works, warns (``DeprecationWarning`` naming the new
spelling) and lands in its group; mixing one with its group is a ConfigError, as is giving
``keep_last`` and ``retention`` together. ``rank=`` and ``world_size=`` were always replaced by
the coordinator's: they warn that they are ignored.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Collection, Mapping
from typing import Any, TypedDict

from ._config_groups import PersistentConfig, ReplicationConfig, Retention, retention_of
from .errors import ConfigError

__all__ = ("PERSISTENT_ALIASES", "REPLICATION_ALIASES", "DeprecatedOptions", "resolve_options")

REPLICATION_ALIASES: Mapping[str, str] = {
    "replicas": "copies", "node_name": "node_name", "replication_timeout_s": "timeout_s",
    "replication_host": "host",
}
"""Old flat option -> its field of ``ReplicationConfig``."""

PERSISTENT_ALIASES: Mapping[str, str] = {
    "persist_every": "every", "persist_on_close": "on_close", "persist_timeout_s": "timeout_s",
    "persistent_keep": "keep", "persistent_options": "options", "persist_retries": "retries",
    "persistent_lease_s": "lease_s", "persistent_takeover": "takeover",
}
"""Old flat option -> its field of ``PersistentConfig``."""



class DeprecatedOptions(TypedDict, total=False):
    """The old flat keywords ``PipelineConfig`` still takes (typed, so that a misspelling
    stays a type error there too)."""

    replicas: int
    node_name: str | None
    replication_timeout_s: float
    replication_host: str | None
    persist_every: int
    persist_on_close: bool
    persist_timeout_s: float
    persistent_keep: int | None
    persistent_options: Mapping[str, Any] | None
    persist_retries: int
    persistent_lease_s: float
    persistent_takeover: bool
    rank: int
    world_size: int


_IGNORED = ("rank", "world_size")
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def resolve_options(given: Mapping[str, Any], deprecated: Mapping[str, Any],
                    replication: ReplicationConfig, persistent: PersistentConfig | None, *,
                    valid: Collection[str], keep: Retention | None = None) -> dict[str, Any]:
    """The ``retention``, ``replication`` and ``persistent`` a config holds.

    ``given``: what was passed of ``keep_last``, ``retention``, ``replication`` and
    ``persistent`` (None: not given, except ``persistent=None``, no tier); ``deprecated``: the
    other keywords, old spellings (anything else fails, naming the valid options);
    ``replication``, ``persistent``, ``keep``: what an old spelling updates (the defaults, or
    the config being merged into); ``valid``: the options there are (``PipelineOptions``),
    named when one is misspelled.
    """
    unknown = set(deprecated).difference(REPLICATION_ALIASES, PERSISTENT_ALIASES, _IGNORED)
    if unknown:
        raise ConfigError(f"unknown option(s) {sorted(unknown)}",
                          hint=f"valid options: {sorted(valid)}")
    for name in _IGNORED:
        if name in deprecated:
            _warn(f"{name}= is ignored (it always was): a rank's place in the job comes from "
                  "the coordinator; drop it")
    return {"retention": _retention(given, keep),
            "replication": _replication(given.get("replication"), deprecated, replication),
            "persistent": _persistent(given, deprecated, persistent)}


def _retention(given: Mapping[str, Any], keep: Retention | None) -> Retention:
    keep_last, retention = given.get("keep_last"), given.get("retention")
    if keep_last is not None and retention is not None:
        raise ConfigError(f"keep_last={keep_last!r} and retention={retention!r} both given",
                          hint="give one: keep_last=N is shorthand for retention=KeepLast(N)")
    if keep_last is None and retention is None and keep is not None:
        return keep
    return retention_of(keep_last, retention)


def _replication(group: ReplicationConfig | None, deprecated: Mapping[str, Any],
                 base: ReplicationConfig) -> ReplicationConfig:
    old = {name: value for name, value in deprecated.items() if name in REPLICATION_ALIASES}
    if old and group is not None:
        raise ConfigError(f"{_names(old)} and replication= both given",
                          hint=f"put them into the group: {_spelling(old, REPLICATION_ALIASES)}")
    for name in old:
        _warn(f"{name}= is deprecated: use replication=ReplicationConfig("
              f"{REPLICATION_ALIASES[name]}=...)")
    if group is not None:
        return group
    return dataclasses.replace(base, **_renamed(old, REPLICATION_ALIASES)) if old else base


def _persistent(given: Mapping[str, Any], deprecated: Mapping[str, Any],
                base: PersistentConfig | None) -> PersistentConfig | None:
    group = given.get("persistent", base)
    old = {name: value for name, value in deprecated.items() if name in PERSISTENT_ALIASES}
    if old and isinstance(group, PersistentConfig) and group is not base:
        raise ConfigError(f"{_names(old)} and persistent=PersistentConfig(...) both given",
                          hint=f"put them into the group: {_spelling(old, PERSISTENT_ALIASES)}")
    for name in old:
        _warn(f"{name}= is deprecated: use persistent=PersistentConfig(url, "
              f"{PERSISTENT_ALIASES[name]}=...)")
    fields = _renamed(old, PERSISTENT_ALIASES)
    if isinstance(group, str):  # the URL alone: shorthand for PersistentConfig(url)
        return (PersistentConfig(group, **fields) if base is None
                else dataclasses.replace(base, url=group, **fields))
    if group is None:
        if old:
            raise ConfigError(f"{_names(old)} given without a persistent tier",
                              hint=f"persistent=PersistentConfig('s3://bucket/run', "
                                   f"{', '.join(f'{k}=...' for k in fields)})")
        return None
    if not isinstance(group, PersistentConfig):
        raise ConfigError(f"persistent={group!r} must be a directory or a URL",
                          hint="for example persistent='s3://bucket/run' or a path on a "
                               "shared file system")
    return dataclasses.replace(group, **fields) if fields else group


def _renamed(old: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    return {aliases[name]: value for name, value in old.items()}


def _names(old: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}=" for name in old)


def _spelling(old: Mapping[str, Any], aliases: Mapping[str, str]) -> str:
    return ", ".join(f"{aliases[name]}={value!r}" for name, value in old.items()
                     if name != "persistent_options")  # secrets never in a message


def _warn(message: str) -> None:
    """A DeprecationWarning pointing at the caller's line, outside this package."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    warnings.warn(message, DeprecationWarning, stacklevel=level)
