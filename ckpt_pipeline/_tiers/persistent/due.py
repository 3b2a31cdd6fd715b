"""Which committed steps are promoted and which are skipped, decided from what every rank
reports in the commit votes (the same on every rank): the agreement side of the promoter."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..._format.timeline import Lineage
from ..._logging import log
from ...coordination._agree import Ballot, read_piece
from ...coordination._runs import Runs
from ...errors import CheckpointError
from ...events import PersistFailed, PersistSkipped
from ..base import Recorded, Vote, VotePart, no_part
from .commit_object import Committing
from .reports import PersistReport
from .rewinding import Rewinding
from .state import Assigned
from .upload import Uploading
from .workers import DaemonPool

__all__ = ("Assigning",)

_QUEUED_MAX = 2
"""Unfinished promotions a rank may have (one uploading, one waiting) before one is skipped."""


class Assigning(Committing, Rewinding, Uploading):
    """Assigning due steps, reporting uploads and settling what every rank reported."""

    key = "persist"
    any_step = True
    """A rank's report counts whatever save it votes on: it is about earlier steps."""

    def report(self) -> PersistReport:
        """What this rank tells the others in the commit vote (each outcome once)."""
        with self._lock:
            done = dict(self._finished)
            failed = dict(self._failures)
            self._finished.clear()
            self._failures.clear()
            unfinished = len(self._unfinished)
            # rank 0 promotes only once it holds the URL
            reachable = self.remote is not None and (self.rank != 0 or self._owner is not None)
        lost = self._refused if self._owner is None else self._owner.lost
        return PersistReport(unfinished, tuple(sorted(done)), failed, reachable, lost,
                             uploads=done)

    def on_reports(self, reports: Sequence[PersistReport | None],
                   uploads: Mapping[int, bytes] | None = None) -> None:
        """Every rank's ``report()`` of one exchange: count finished uploads, commit the
        steps every rank finished, give up the steps a rank failed. Same on every rank.
        Ranks with equal reports are read once (``Runs``); only a report that failed an
        upload is read for each of its ranks. ``uploads``: on rank 0, every rank's piece
        of this exchange (its ``root_msg``: the checksums the commit objects list) by rank,
        read in rank 0's commit-object thread before any commit object it then writes."""
        lost = reports[0].lost if reports and reports[0] is not None else None
        if lost is not None and self._lost_url is None:
            self._stop_promoting(lost)
        if self._lost_url is not None:
            return
        busiest = (0, 0)
        failed: dict[int, dict[int, str]] = {}
        unreachable: list[int] = []
        runs = reports if isinstance(reports, Runs) else Runs.of(reports)
        for start, stop, report in runs.runs():
            if report is None:  # a rank without the tier: nothing completes
                busiest = max(busiest, (_QUEUED_MAX, start), key=lambda b: b[0])
                continue
            if not report.reachable:
                unreachable.extend(range(start, min(stop, start + 9)))
            busiest = max(busiest, (report.unfinished, start), key=lambda b: b[0])
            for step in report.done:
                if step in self._assigned:
                    self._assigned[step].finished += stop - start
            for rank in range(start, stop) if report.failed else ():
                for step, error in report.failed.items():
                    if step in self._assigned:
                        failed.setdefault(step, {})[rank] = error
        if uploads:
            self._submit(self._meta, self._read_uploads, dict(uploads), dict(self._assigned))
        self._busy = busiest
        self._unreachable = "" if not unreachable else (
            f"rank{'s' if len(unreachable) > 1 else ''} "
            f"{', '.join(map(str, unreachable[:8]))}{', ...' if len(unreachable) > 8 else ''}")
        for step, errors in sorted(failed.items()):
            assigned = self._assigned.pop(step)
            error = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=assigned.save_id,
                                     url=self.url, error=error))
            if self.rank == 0:
                self._submit(self._meta, self._remove_step, step)
        for step in sorted(self._assigned):
            assigned = self._assigned[step]
            if assigned.finished >= self.world_size:
                del self._assigned[step]
                if self.rank == 0:
                    self._committing[step] = assigned.save_id
                    self._submit(self._meta, self._commit_step, step, assigned)

    def _read_uploads(self, uploads: Mapping[int, bytes], assigned: Mapping[int, Assigned]
                      ) -> None:
        """Rank 0, in its commit-object thread (off the event loop: at 16,000 ranks this is
        tens of microseconds a rank): the checksums of each rank's finished uploads, kept
        with the steps ``assigned`` when they arrived. One it cannot read is logged and left
        out: that step's commit object then fails (a rank's checksums are missing) and is
        reported (``PersistFailed``)."""
        for rank, piece in sorted(uploads.items()):
            try:
                finished = PersistReport.uploads_from_msg(
                    read_piece(piece, f"rank {rank}'s finished uploads"))
            except (ValueError, CheckpointError) as exc:
                log.error("ckpt.persist.report_malformed", rank=self.rank, from_rank=rank,
                          url=self.url, error=exc.message if isinstance(exc, CheckpointError)
                          else str(exc))
                continue
            for step, upload in finished.items():
                if step in assigned:
                    assigned[step].reports[rank] = upload

    # The commit participant (``_tiers.base.CommitParticipant``): the report rides the first
    # vote of every save, and every rank's is settled whatever the vote's outcome; the
    # checksums of its finished uploads go to rank 0 alone (``rooted``).

    rooted = True

    def ballot(self) -> Ballot[PersistReport]:
        """This rank's report, for an exchange outside a save's vote (at close)."""
        return Ballot(self.report(), PersistReport.from_msg, self.any_step, self.rooted)

    def decode_vote(self, message: Any) -> PersistReport:
        return PersistReport.from_msg(message)

    def decode_confirm(self, message: Any) -> VotePart:
        return no_part(message)

    async def contribute(self, failed: bool) -> PersistReport:
        return self.report()

    async def voted(self, vote: Vote[PersistReport]) -> None:
        self.on_reports(vote.parts, vote.roots)

    async def confirm(self, recorded: Recorded) -> None:
        return None

    async def confirmed(self, vote: Vote[VotePart]) -> None:
        return None

    def _stop_promoting(self, reason: str) -> None:
        """The URL is another job's (rank 0 said so): give up every step in flight and
        promote nothing more. Same on every rank."""
        self._lost_url = reason
        log.error("ckpt.persist.stopped", rank=self.rank, url=self.url, reason=reason,
                  hint="another job promotes to this URL; give each job its own persistent "
                       "URL. The local tier keeps every committed step")
        for step, assigned in sorted(self._assigned.items()):
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=assigned.save_id,
                                     url=self.url, error=f"not committed: {reason}"))
        self._assigned.clear()

    def committed(self, step: int, save_id: str, lineage: Lineage | None = None) -> None:
        """A step committed on every rank: assign it when it is due (same on every rank).
        ``lineage``: its commit records' (the commit object names it too)."""
        self._commits += 1
        self._newest = (step, save_id, lineage)
        if self._commits % self.config.every == 0:
            self._assign(step, save_id, lineage, closing=False)

    def closing(self) -> None:
        """At a clean close: promote the newest step committed since open too
        (``persist_on_close``)."""
        if self._newest is not None and self.config.on_close:
            self._assign(*self._newest, closing=True)

    def protected(self) -> set[int]:
        """Steps this rank is still uploading: the local retention keeps them until then."""
        with self._lock:
            return set(self._unfinished)

    def _assign(self, step: int, save_id: str, lineage: Lineage | None, *,
                closing: bool) -> None:
        if step <= self._last_assigned:
            return
        if self._lost_url is not None:  # never silent: each step due fails, naming why
            self._last_assigned = step
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=save_id,
                                     url=self.url, error=f"not promoted: {self._lost_url}"))
            return
        if self._unreachable:
            self._last_assigned = step  # reported once, not again at close
            self._emit(PersistSkipped(
                step=step, rank=self.rank,
                reason=f"the persistent tier {self.url} is unreachable from "
                       f"{self._unreachable} (retried in the background)"))
            return
        most, rank = self._busy
        if most >= _QUEUED_MAX and not closing:
            self._emit(PersistSkipped(
                step=step, rank=self.rank,
                reason=f"rank {rank} still has {most} earlier promotion(s) unfinished"))
            return
        self._last_assigned = step
        self._assigned[step] = Assigned(save_id, time.monotonic(), {}, lineage)
        with self._lock:
            self._unfinished[step] = save_id
        self._submit(self._uploads, self._upload, step, save_id)

    def _submit(self, pool: DaemonPool, fn: Callable[..., None], *args: Any) -> None:
        try:
            future = pool.submit(fn, *args)
        except RuntimeError:  # closed
            return
        with self._lock:
            self._futures.append((pool is self._uploads, future))
