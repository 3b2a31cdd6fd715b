"""The library's log lines: stdlib ``logging`` under the ``ckpt_pipeline`` logger, best-effort.

A library is silent until asked: the logger has a ``NullHandler`` and no level of its own, so
the application's logging configuration decides what is shown (``logging.basicConfig``, a
handler on ``ckpt_pipeline``, or :func:`ckpt_pipeline.enable_logging`). Each record's message
is the event name followed by ``key=value`` pairs; the record also carries the event name and
the fields as ``record.ckpt_event`` and ``record.ckpt_fields`` for structured handlers.
A failed save must be seen even so: ``warn_unless_shown`` issues it through ``warnings`` where
no handler shows its line.

Emitting never fails and never blocks a save: a handler that raises (a closed pipe, a full
disk under the log file) is reported once, through ``warnings``, and the line is dropped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ("LOGGER_NAME", "EventLog", "log", "render_value", "report_once", "warn_unless_shown")

LOGGER_NAME = "ckpt_pipeline"

_logger = logging.getLogger(LOGGER_NAME)
_logger.addHandler(logging.NullHandler())

_reported: set[str] = set()
_reported_lock = threading.Lock()


def report_once(what: str, exc: BaseException) -> None:
    """Say once per process and kind that a best-effort output failed; never raises."""
    key = f"{what}:{type(exc).__name__}"
    with _reported_lock:
        if key in _reported:
            return
        _reported.add(key)
    # Warnings turned into errors, or stderr gone too: nothing is left to tell it to.
    with contextlib.suppress(Exception):
        warnings.warn(f"ckpt_pipeline: {what} failed ({type(exc).__name__}: {exc}); "
                      "checkpointing goes on, further failures of this kind are not reported",
                      RuntimeWarning, stacklevel=2)


def _shown(level: int) -> bool:
    """Whether a record at ``level`` from the library's logger reaches a handler that is not
    a ``NullHandler`` (the application's, ``enable_logging``'s, or logging's last resort)."""
    if not _logger.isEnabledFor(level):
        return False
    found = False
    logger: logging.Logger | None = _logger
    while logger is not None:
        for handler in logger.handlers:
            found = True
            if not isinstance(handler, logging.NullHandler) and level >= handler.level:
                return True
        logger = logger.parent if logger.propagate else None
    last = logging.lastResort
    return not found and last is not None and level >= last.level


def warn_unless_shown(message: str, category: type[Warning], level: int = logging.ERROR
                      ) -> None:
    """Issue ``message`` through ``warnings`` when no logging handler shows the library's lines
    at ``level``: a problem is then visible without any logging set-up, and not said twice
    where there is one. Never raises: a filter that turns the warning into an exception (``-W
    error``) cannot reach the pipeline's thread, and the warning is dropped."""
    try:
        if not _shown(level):
            warnings.warn(message, category, stacklevel=2)
    except Exception:  # the warning was made an error, or a showwarning failed
        return


def render_value(value: Any) -> str:
    """One value of a log line: floats without noise (``0.000008``, ``1.25``)."""
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) >= 1e15:
            return repr(value)
        text = f"{value:.6f}".rstrip("0").rstrip(".")
        return text if text not in ("", "-0") else "0"
    if isinstance(value, str):
        return value if value and not any(c.isspace() or c in "\"'=" for c in value) \
            else repr(value)
    return str(value)


class _Line:
    """The message of a record, rendered only when a handler formats it."""

    __slots__ = ("event", "fields")

    def __init__(self, event: str, fields: Mapping[str, Any]) -> None:
        self.event = event
        self.fields = fields

    def __str__(self) -> str:
        pairs = " ".join(f"{k}={render_value(v)}" for k, v in self.fields.items())
        return f"{self.event} {pairs}" if pairs else self.event


class EventLog:
    """``log.info("ckpt.commit.done", step=3, rank=0, ...)``: one line per call, best-effort."""

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        try:
            if not _logger.isEnabledFor(level):
                return
            _logger.log(level, "%s", _Line(event, fields),
                        extra={"ckpt_event": event, "ckpt_fields": fields})
        except Exception as exc:  # a handler or filter of the application failed
            report_once("logging", exc)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields)

    def enabled(self, level: str) -> bool:
        """Whether a line at ``level`` would be emitted: skip building its fields if not."""
        try:
            return _logger.isEnabledFor(_LEVELS[level])
        except Exception as exc:  # a broken logging set-up: reported, never raised
            report_once("logging", exc)
            return False

    def at(self, level: str, event: str, **fields: Any) -> None:
        """Log at a level named ``"debug"``, ``"info"``, ``"warning"`` or ``"error"``."""
        self._emit(_LEVELS[level], event, fields)


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}

log = EventLog()
