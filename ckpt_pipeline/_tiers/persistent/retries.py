"""How a request to the persistent tier fails: its deadlines, what a failure means, its error.

Requests that fail with a connection error, a timeout, a 5xx or a throttling answer are
transient: ``Remote`` retries them with exponential backoff and jitter (capped at
``BACKOFF_CAP_S``). Any other failure (a refused request, a missing bucket, a request the
client cannot even build) is a configuration or permission error: never retried,
``RemoteError.transient`` False. Each backend explains its client's exceptions as a
``Failure``; ``explain_generic`` covers the OS's and unknown clients'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ...errors import StorageError

__all__ = ("BACKOFF_CAP_S", "SLOWEST_RATE", "SMALL_TIMEOUT_S", "TRANSIENT_CODES",
           "UNAVAILABLE_HINT", "Conflict", "Failure", "OnRetry", "RemoteError",
           "explain_generic", "request_timeout")

BACKOFF_CAP_S = 10.0
SMALL_TIMEOUT_S = 30.0
"""Deadline of a request that carries no part: a listing, a head, a delete, a commit object."""
SLOWEST_RATE = 1024 * 1024
"""Bytes per second: a request that carries data slower than this times out."""

OnRetry = Callable[[str, int, str], None]
"""``on_retry(key, attempt, reason)``: called before each retry of a request."""


def request_timeout(nbytes: int) -> float:
    """The total deadline of a request that carries ``nbytes`` of data."""
    return SMALL_TIMEOUT_S + nbytes / SLOWEST_RATE


class RemoteError(StorageError):
    """A request to the persistent tier failed (after its retries).

    ``key``, ``op`` and ``attempts`` say which request; ``missing``: the object does not exist;
    ``transient``: the store was unreachable or answered with a temporary error (an outage,
    which may end), not a configuration or permission error (which will not).
    """

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None,
                 missing: bool = False, key: str | None = None, op: str | None = None,
                 attempts: int = 1, transient: bool = False) -> None:
        super().__init__(message, path=path, hint=hint)
        self.missing = missing
        self.key = key
        self.op = op
        self.attempts = attempts
        self.transient = transient


class Conflict(RemoteError):
    """A conditional write found another version of the object than it expected (or one
    where it expected none)."""


# The exceptions are re-raised ``from None``: a client library's exception (and its chained
# ones) may quote request parameters, and tracebacks end up in logs. ``reason`` keeps what
# the store said.


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed request: what the store said, whether another attempt may succeed (a
    connection error, a timeout, a 5xx, throttling), whether the object does not exist, and
    for a failure that is not transient, what setting to fix (``hint``)."""

    reason: str
    transient: bool
    missing: bool = False
    hint: str | None = None


UNAVAILABLE_HINT = ("the store did not answer in time or answered with a temporary error "
                    "(an outage, throttling); the local tier keeps every step")


TRANSIENT_CODES = frozenset((
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"))
_TRANSIENT_NAMES = ("Connect", "Timeout", "HTTPClientError", "IncompleteRead",
                    "ServerDisconnected", "ClientPayload", "ClientOSError", "ReadError",
                    "ResponseParserError", "ProtocolError")


def explain_generic(exc: BaseException) -> Failure:
    """An exception of the OS or of an unknown client: connection errors and timeouts (by
    type, or by the type names of the usual HTTP clients) are transient."""
    reason = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PermissionError):
        return Failure(reason, False, hint="the persistent tier refused access: check its "
                       "permissions and the credentials in PersistentConfig(options=)")
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError)):
        return Failure(reason, False, isinstance(exc, FileNotFoundError))
    transient = isinstance(exc, (ConnectionError, TimeoutError)) or any(
        word in type(e).__name__ for e in _chain(exc) for word in _TRANSIENT_NAMES)
    return Failure(reason, transient)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    for _ in range(8):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__
