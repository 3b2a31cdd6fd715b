"""Reaching the persistent tier: a bounded first attempt at open, then attempts in the
background until one succeeds.

A store that is down, hung or black-holed must not keep a job from opening from its local
tier, and a configuration error must not pass for an outage. So ``start`` runs the steps of
opening (the promoter's ``attempt``) in a daemon thread and waits at most ``wait_s`` for it:

- it succeeded: the tier is reachable;
- it failed with a configuration or permission error (``ConfigError``, or a request the store
  refused for good: a missing bucket, denied access, a request the HTTP client cannot build):
  ``start`` raises a ConfigError that names the setting, and nothing is retried;
- it failed otherwise (connection refused, a timeout, a 5xx), or is still waiting for the
  store after ``wait_s``: a WARNING and ``PersistentUnavailable``, and ``start`` returns. The
  same thread goes on: the attempt in flight ends by its request deadlines, and the next ones
  follow with exponential backoff (``RETRY_FIRST_S`` doubling up to ``RETRY_MAX_S``), until
  one succeeds (``PersistentAvailable``) or the pipeline closes.

Whether promotions are made while a rank cannot reach the tier is not decided here: each rank
reports ``reachable`` in the commit vote, and every rank skips the same steps (``promote``).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from ..._logging import log
from ...errors import CheckpointError, ConfigError
from ...events import Event, PersistentAvailable, PersistentUnavailable
from .retries import RemoteError

__all__ = ("RETRY_FIRST_S", "RETRY_MAX_S", "Connection", "as_config_error")

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0

_R = TypeVar("_R")


def as_config_error(exc: BaseException, url: str) -> ConfigError | None:
    """``exc`` as the ConfigError that opening the tier raises, or None for an outage."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, RemoteError) and not exc.transient:
        return ConfigError(f"the persistent tier {url} cannot be used: {exc.message}",
                           path=exc.path, hint=exc.hint or (
                               "the store refused the request for good: check the URL and "
                               "PersistentConfig(options=) (credentials, region, endpoint)"))
    return None


def _reason(exc: BaseException) -> str:
    return exc.message if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


class Connection(Generic[_R]):
    """See the module docstring. ``connected(result)`` is called (in the attempt's thread)
    with what the first successful ``attempt()`` returned; ``discard(result)`` with what one
    returned after ``close``."""

    def __init__(self, url: str, rank: int, attempt: Callable[[], _R],
                 connected: Callable[[_R], None], discard: Callable[[_R], None],
                 emit: Callable[[Event], None]) -> None:
        self.url = url
        self.rank = rank
        self._attempt = attempt
        self._connected = connected
        self._discard = discard
        self._emit = emit
        self._cond = threading.Condition()
        self._announce = threading.Lock()  # orders PersistentUnavailable before Available
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._settled = False  # the first attempt ended
        self._attempts = 0
        self._reachable = False
        self._config_error: ConfigError | None = None
        self._error = ""
        self._announced = False
        self._stopped = False

    @property
    def reachable(self) -> bool:
        return self._reachable

    @property
    def error(self) -> str:
        """Why the tier is not reachable ("" while it is, or before the first attempt)."""
        with self._cond:
            return "" if self._reachable else self._error

    def start(self, wait_s: float) -> None:
        """The first attempt, waited for at most ``wait_s`` seconds (see the module
        docstring): returns reachable or not; raises a configuration error."""
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ckpt-persist-connect-r{self.rank}")
        self._thread.start()
        with self._announce:
            with self._cond:
                self._cond.wait_for(lambda: self._settled, wait_s)
                if self._config_error is not None:
                    raise self._config_error
                if self._reachable:
                    return
                if not self._settled:
                    self._error = (f"no answer within {wait_s:g} s (the attempt goes on in "
                                   "the background)")
                self._announced = True
                error = self._error
            # The event's log line is the WARNING: the pipeline opens from the local tier.
            self._emit(PersistentUnavailable(step=-1, rank=self.rank, url=self.url,
                                             error=error, retrying=True))

    def reach(self, timeout: float) -> bool:
        """Reachable now, or after one more attempt (started at once, or the one in flight)
        that ends within ``timeout`` seconds. For a restore, which must not pass over a store
        that is only slow, nor wait long for one that is down."""
        with self._cond:
            if self._reachable or self._config_error is not None or self._stopped:
                return self._reachable
            seen = self._attempts
            self._wake.set()
            self._cond.wait_for(lambda: self._reachable or self._attempts > seen
                                or self._config_error is not None, timeout)
            return self._reachable

    def close(self) -> None:
        """Stop trying; an attempt in flight ends alone and what it opened is discarded."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._wake.set()

    # -- the attempts' thread ------------------------------------------------------------

    def _run(self) -> None:
        delay = RETRY_FIRST_S
        while True:
            try:
                result = self._attempt()
            except BaseException as exc:
                config = as_config_error(exc, self.url)
                with self._cond:
                    self._attempts += 1
                    self._settled = True
                    self._error = _reason(exc)
                    self._config_error = config
                    announced, stopped = self._announced, self._stopped
                    self._cond.notify_all()
                if stopped:
                    return
                if config is not None:
                    if announced:  # start() returned already: say why the retries stop
                        self._gave_up(config)
                    return
                log.debug("ckpt.persist.reach_failed", rank=self.rank, url=self.url,
                          error=self._error, retry_in_s=round(delay, 3))
                self._wake.wait(delay * (0.5 + random.random() / 2))
                self._wake.clear()
                if self._stopped:
                    return
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            with self._cond:
                stopped = self._stopped
                if not stopped:
                    self._connected(result)
                    self._reachable = True
                self._attempts += 1
                self._settled = True
                self._cond.notify_all()
            if stopped:
                self._discard(result)
                return
            with self._announce:
                if self._announced:
                    seconds = time.monotonic() - self._started
                    self._emit(PersistentAvailable(step=-1, rank=self.rank, url=self.url,
                                                   seconds=seconds))
            return

    def _gave_up(self, error: ConfigError) -> None:
        log.error("ckpt.persist.unusable", rank=self.rank, url=self.url, error=error.message,
                  hint=error.hint, action="no more attempts: the persistent tier stays off "
                  "for this run")
        with self._announce:
            self._emit(PersistentUnavailable(step=-1, rank=self.rank, url=self.url,
                                             error=error.message, retrying=False))
