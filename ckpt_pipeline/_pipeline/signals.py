"""Signals around the blocking face: SIGTERM in the ``with`` block, and signals held while a
save is handed over.

SIGTERM is what schedulers and torchrun send to stop a job; its default disposition kills the
process at once, losing the saves in flight. ``SigtermGuard`` (installed by
``CheckpointPipeline.__enter__`` over the default disposition only, on the main thread) turns
it into the end of the block (``"finish"``) or a flag the loop reads (``"flag"``), and ends the
process by SIGTERM once the saves are done. ``signals_held`` keeps SIGINT and SIGTERM from
interrupting the few statements that hand a save to the pipeline.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, Literal

from .._logging import log

__all__ = ("SigtermGuard", "SigtermPolicy", "signals_held")

SigtermPolicy = Literal["finish", "flag", "off"]
_log = log


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for a short critical section of the main thread.

    Only signals whose handler is a Python callable (SIGINT's default raises
    KeyboardInterrupt; an application's or our SIGTERM handler) can interrupt Python code;
    each such signal that arrives is delivered to its handler once the section is left. Off
    the main thread, signals are not delivered to this thread anyway.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Callable[[int, FrameType | None], Any]] = {}
    held: list[tuple[int, FrameType | None]] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append((signum, frame))

    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if callable(handler):
            previous[signum] = handler
            signal.signal(signum, hold)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        delivered: set[int] = set()
        for number, frame in held:
            if number not in delivered:
                delivered.add(number)
                previous[number](number, frame)


class SigtermGuard:
    """Our SIGTERM handler for the ``with`` block (see ``CheckpointPipeline``'s ``sigterm``)."""

    def __init__(self, policy: SigtermPolicy, rank: int) -> None:
        self.policy = policy
        self.rank = rank
        self.count = 0
        self.closing = False

    @classmethod
    def install(cls, policy: SigtermPolicy, rank: int) -> SigtermGuard | None:
        """Install on the main thread over the default disposition only; else None."""
        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return None  # the application handles SIGTERM (or ignores it): its choice
        guard = cls(policy, rank)
        signal.signal(signal.SIGTERM, guard._handle)
        return guard

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1 and (self.closing or self.policy == "flag"):
            _log.warning("ckpt.sigterm.received", rank=self.rank, policy=self.policy,
                         hint="the saves in flight finish, then the process ends by SIGTERM"
                              if self.closing else "save and leave the with block "
                              "(pipe.preempted is True); a second SIGTERM ends it at once")
            return
        _log.warning("ckpt.sigterm.received", rank=self.rank, policy=self.policy,
                     hint="leaving the with block: the saves in flight finish, then the "
                          "process ends by SIGTERM" if self.count == 1
                     else "a second SIGTERM: the saves in flight are abandoned")
        raise SystemExit(128 + signum)

    def uninstall(self) -> None:
        """Give SIGTERM its default back; end by it if one arrived (as it asked)."""
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.count:
            _log.warning("ckpt.sigterm.exit", rank=self.rank,
                         hint="ending the process by the SIGTERM it received")
            signal.raise_signal(signal.SIGTERM)
