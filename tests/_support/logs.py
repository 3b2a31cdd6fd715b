"""Waiting for one of the library's log lines from a background thread, without sleeping."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ckpt_pipeline._logging import LOGGER_NAME

__all__ = ("LineWatch", "watching")


class LineWatch(logging.Handler):
    """Keeps the fields of every line named ``event``; ``seen`` is set at the first."""

    def __init__(self, event: str) -> None:
        super().__init__(logging.DEBUG)
        self.event = event
        self.fields: list[dict[str, object]] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "ckpt_event", None) == self.event:
            self.fields.append(dict(getattr(record, "ckpt_fields", {})))
            self.seen.set()

    def clear(self) -> None:
        self.fields.clear()
        self.seen.clear()


@contextmanager
def watching(event: str, level: int = logging.INFO) -> Iterator[LineWatch]:
    """A ``LineWatch`` on the library's logger, enabled at ``level`` meanwhile."""
    watch = LineWatch(event)
    logger = logging.getLogger(LOGGER_NAME)
    before = logger.level
    logger.addHandler(watch)
    logger.setLevel(level)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(before)
