"""Seeing the library's log lines: one call for a terminal or a file, or your own set-up.

The library only emits (stdlib ``logging``, logger ``ckpt_pipeline``, silent by default).

- ``enable_logging()``: one call that shows the lines, rendered by structlog's renderers
  (``key=value`` for people, or one JSON object per line), on stderr or a stream you give.
- Your own logging set-up: set the level of ``logging.getLogger("ckpt_pipeline")`` and attach
  handlers as for any library. Records carry ``ckpt_event`` and ``ckpt_fields``.
- structlog's ``ProcessorFormatter``: add :func:`add_event_fields` to its ``foreign_pre_chain``
  and the library's lines become event dicts like your own.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import MutableMapping
from typing import Any, Literal, TextIO

import structlog

from ._logging import LOGGER_NAME as LOGGER_NAME
from ._logging import render_value, report_once

__all__ = ("LOGGER_NAME", "add_event_fields", "enable_logging")

LogFormat = Literal["console", "json"]


def add_event_fields(logger: Any, method_name: str,
                     event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor for ``ProcessorFormatter(foreign_pre_chain=[...])``.

    For a record of this library, the event name becomes ``event`` and its fields are added
    (step, rank, bytes, seconds, ...); other records pass unchanged.
    """
    record = event_dict.get("_record")
    name = getattr(record, "ckpt_event", None)
    fields = getattr(record, "ckpt_fields", None)
    if isinstance(name, str) and isinstance(fields, dict):
        event_dict["event"] = name
        for key, value in fields.items():
            event_dict.setdefault(key, value)
    return event_dict


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return float(render_value(value)) if abs(value) < 1e15 else value
    return value


class _Formatter(logging.Formatter):
    """One line per record: ``key=value`` text, or JSON through structlog's renderer (used
    as a plain function: structlog's global configuration is never touched)."""

    def __init__(self, fmt: LogFormat) -> None:
        super().__init__()
        self._json = fmt == "json"
        self._render = structlog.processors.JSONRenderer(default=str)

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, "ckpt_event", None)
        fields = getattr(record, "ckpt_fields", None)
        if not isinstance(event, str) or not isinstance(fields, dict):
            event, fields = record.getMessage(), {}
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        if self._json:
            data = {"timestamp": f"{stamp}.{int(record.msecs):03d}Z",
                    "unix": round(record.created, 6),
                    "level": record.levelname.lower(), "event": event,
                    **{k: _plain(v) for k, v in fields.items()}}
            return str(self._render(None, record.levelname.lower(), data))
        head = f"{stamp}.{int(record.msecs):03d}Z {record.levelname.lower():<7} {event}"
        pairs = " ".join(f"{k}={render_value(v)}" for k, v in fields.items())
        return f"{head} {pairs}" if pairs else head


class _Handler(logging.StreamHandler[TextIO]):
    """A stream handler whose failures (closed pipe, full disk) are reported once."""

    def handleError(self, record: logging.LogRecord) -> None:
        report_once("writing a log line", sys.exc_info()[1] or RuntimeError("unknown"))


def enable_logging(level: int | str = logging.INFO, *, stream: TextIO | None = None,
                   fmt: LogFormat = "console") -> logging.Handler:
    """Show the library's log lines on ``stream`` (default: stderr) from ``level`` up.

    ``fmt="console"`` writes ``2026-11-30T17:02:11.042Z info    ckpt.commit.done step=50
    rank=0 ...``; ``fmt="json"`` one JSON object per line (``timestamp``, ``unix``,
    ``level``, ``event`` and the fields). Only the ``ckpt_pipeline`` logger
    is touched (its level, one handler; records do not also go to the root logger's handlers),
    never the application's other loggers or structlog's global configuration. Calling it
    again replaces the handler. Returns the handler (remove it with ``removeHandler``).
    """
    if fmt not in ("console", "json"):
        raise ValueError(f"fmt={fmt!r}: use 'console' or 'json'")
    logger = logging.getLogger(LOGGER_NAME)
    for old in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(old)
    handler = _Handler(stream if stream is not None else sys.stderr)
    handler.setFormatter(_Formatter(fmt))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return handler
