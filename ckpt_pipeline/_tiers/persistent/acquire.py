"""Rank 0's hold on the persistent URL for one open (``owner.Ownership``): taken at open, or
in the background once the store is reached, released at a clean close, re-checked before each
commit object."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..._logging import log
from ...errors import CheckpointError, PersistentInUseError
from . import state
from .owner import Ownership
from .remote import Remote
from .retries import SMALL_TIMEOUT_S
from .state import PromoterState
from .workers import bounded

__all__ = ("Acquiring",)


class Acquiring(PromoterState):
    """Taking, holding and releasing the URL (rank 0; a no-op elsewhere)."""

    def _acquire_at_open(self) -> None:
        """At open, with the store reachable: take the URL in a daemon thread, waiting for it
        at most ``OPEN_WAIT_S`` (longer only while a holder is watched: up to its lease),
        so that a live holder is refused here (``PersistentInUseError``) while a store that
        hangs or fails does not hold the open up: the acquisition goes on in the background,
        and rank 0 uploads and commits nothing until it succeeds."""
        until = [time.monotonic() + state.OPEN_WAIT_S]
        cond = threading.Condition()
        outcome: list[BaseException | None] = []

        def watching(lease: float) -> None:
            with cond:
                until[0] = max(until[0], time.monotonic() + lease + state.OPEN_WAIT_S)
                cond.notify_all()

        def first(error: BaseException | None) -> None:
            with cond:
                outcome.append(error)
                cond.notify_all()

        threading.Thread(target=self._acquire_in_background, args=(first, watching),
                         daemon=True, name=f"ckpt-persist-acquire-r{self.rank}").start()
        with cond:
            while not outcome and time.monotonic() < until[0]:
                cond.wait(until[0] - time.monotonic())
        if outcome and isinstance(outcome[0], PersistentInUseError):
            raise outcome[0]
        if not outcome or outcome[0] is not None:
            log.warning("ckpt.persist.acquire_pending", rank=self.rank, url=self.url,
                        error="no answer in time" if not outcome else str(outcome[0]),
                        action="taking the URL in the background; nothing is promoted "
                               "until then")

    def _acquire_in_background(
        self, first: Callable[[BaseException | None], None] | None = None,
        watching: Callable[[float], None] | None = None,
    ) -> None:
        """Take the URL, with backoff on store errors, until it is taken, refused (reported,
        so that every rank stops promoting) or the promoter closes. ``first`` hears how the
        first attempt ended (None: taken)."""
        delay = 1.0
        while not self._stopped:
            try:
                self.acquire(watching)
            except PersistentInUseError as exc:
                if first is not None:
                    first(exc)
                else:
                    log.error("ckpt.persist.refused", rank=self.rank, url=self.url,
                              error=exc.message, hint=exc.hint)
                return
            except CheckpointError as exc:
                log.warning("ckpt.persist.acquire_failed", rank=self.rank, url=self.url,
                            error=exc.message, retry_in_s=delay)
                if first is not None:
                    first(exc)
                    first = None
            else:
                if first is not None:
                    first(None)
                return
            with self._quiet:
                self._quiet.wait_for(lambda: self._stopped, timeout=delay)
            delay = min(60.0, delay * 2)

    def acquire(self, watching: Callable[[float], None] | None = None, *,
                remote: Remote | None = None) -> None:
        """Rank 0: take the URL for this open (``Ownership.acquire``: refused with
        ``PersistentInUseError`` while another job's heartbeat advances) and start its
        heartbeat. One step of opening, callable once the store is reachable. Runs in a
        worker thread."""
        with self._acquiring:
            if self.rank != 0 or self._owner is not None or self._refused is not None:
                return
            remote = remote if remote is not None else self.remote
            assert remote is not None
            self._acquire(remote, watching)

    def _acquire(self, remote: Remote, watching: Callable[[float], None] | None) -> None:
        try:
            owner = Ownership.acquire(
                remote, root=str(self.storage.root),
                lease_s=self.config.lease_s,
                takeover=self.config.takeover, emit=self._emit, rank=self.rank,
                watching=watching)
        except PersistentInUseError as exc:
            self._refused = exc.message  # reported, so that every rank stops promoting
            raise
        with self._quiet:  # against close(): a URL taken after it is let go at once
            closed = self._stopped
            if not closed:
                self._owner = owner
                owner.start_heartbeat()
        if closed:
            owner.release()

    def release(self) -> None:
        """Rank 0, at a clean close: release the URL (``Ownership.release``), waiting at
        most ``SMALL_TIMEOUT_S`` for the store (then the next job takes the URL over after
        one lease). Runs in a worker thread."""
        if self._owner is None:
            return
        try:
            bounded(self._owner.release, SMALL_TIMEOUT_S, f"ckpt-persist-release-r{self.rank}")
        except TimeoutError as exc:
            log.warning("ckpt.persist.release_failed", rank=self.rank, url=self.url,
                        error=str(exc))

    def _lost(self) -> str | None:
        """Rank 0: None while the URL is this open's (its owner object re-read), else why
        not."""
        if self._owner is None:
            return f"this open does not hold the persistent URL {self.url}"
        return self._owner.check()
