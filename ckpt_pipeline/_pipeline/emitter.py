"""Events to the log and to the user's subscribers: best-effort, never raising into a save."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .._logging import log
from ..events import Event

__all__ = ("Emitter", "Subscriber")

Subscriber = Callable[[Event], None]


class Emitter:
    """Logs every event and hands it to every subscriber, from the thread that emits it.

    A subscriber that raises stays subscribed; its first failure is logged
    (``ckpt.subscriber.failed``), later ones are only counted.
    """

    def __init__(self) -> None:
        self._subscribers: tuple[Subscriber, ...] = ()
        self._failures: dict[int, int] = {}
        self._lock = threading.Lock()

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(event)`` for every event; returns a function that unsubscribes."""
        with self._lock:
            self._subscribers = (*self._subscribers, callback)

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = tuple(s for s in self._subscribers if s is not callback)

        return unsubscribe

    def emit(self, event: Event) -> None:
        """Log the event and hand it to every subscriber; never raises."""
        if log.enabled(event.log_level):  # fields() copies the event: only when it is logged
            log.at(event.log_level, event.log_name, **event.fields())
        for callback in self._subscribers:
            try:
                callback(event)
            except Exception as exc:
                self._failed(callback, event, exc)

    def _failed(self, callback: Subscriber, event: Event, exc: Exception) -> None:
        key = id(callback)
        with self._lock:
            count = self._failures.get(key, 0) + 1
            self._failures[key] = count
        if count == 1:
            log.error("ckpt.subscriber.failed", step=event.step, rank=event.rank,
                      on=event.log_name,
                      subscriber=getattr(callback, "__qualname__", repr(callback)),
                      error=f"{type(exc).__name__}: {exc}",
                      hint="the subscriber stays subscribed; its further failures are not "
                           "logged")
