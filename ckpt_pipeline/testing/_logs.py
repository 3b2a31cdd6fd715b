"""Seeing the library's log lines in a test: ``capture_logs``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from .._logging import LOGGER_NAME

__all__ = ("capture_logs",)


@contextlib.contextmanager
def capture_logs(level: int = logging.DEBUG) -> Iterator[list[dict[str, Any]]]:
    """Collect the library's log lines as dicts (``event``, ``log_level`` and the fields).

    Like ``structlog.testing.capture_logs``, for the ``ckpt_pipeline`` logger: it lowers the
    logger's level to ``level`` for the duration and restores it afterwards.
    """
    logger = logging.getLogger(LOGGER_NAME)
    entries: list[dict[str, Any]] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record, "ckpt_fields", None)
            entries.append({"event": getattr(record, "ckpt_event", record.getMessage()),
                            "log_level": record.levelname.lower(),
                            **(fields if isinstance(fields, dict) else {})})

    handler = _Collect(level)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield entries
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
