"""Agreement, the first half of a restore: every rank scans what it holds (its own files, the
copies it holds of other ranks' shards, the persistent tier's complete steps), the ranks agree
on the timeline (``rewind.py``) and on the candidate steps, newest first, that every rank's
shard is held of somewhere (``agree_candidates``). The recovery then tries the candidates in
that order, and falls back to the next when one fails on any rank.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from .._config_groups import RestoreOptions
from .._format.scan import StepStatus, scan, scan_replicas
from .._format.timeline import Rewind
from .._lineage import Timeline, read_rewinds
from .._logging import log
from .._threads import in_thread
from ..coordination import Coordinator
from ..coordination._agree import Candidates, agree_candidates, gather_outcome
from ..coordination._runs import Runs, spans_text
from ..errors import CheckpointError, RestoreError, StateError
from ..handle import RejectedStep
from ..storage import Storage
from .rewind import TimelineView, agree_timeline

if TYPE_CHECKING:
    from .._tiers.persistent.layout import StepRecord
    from .._tiers.persistent.promote import Promoter

__all__ = ("Agreed", "Agreement", "CandidateLoad", "WorldSizeChanged", "listing")


class WorldSizeChanged(RestoreError):
    """The newest step was saved by another number of ranks (``saved_world``): a restore
    reshards it where it can (``reshard.py``)."""

    def __init__(self, message: str, *, saved_world: int, step: int | None = None,
                 rank: int | None = None, path: str | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, step=step, rank=rank, path=path, hint=hint)
        self.saved_world = saved_world

_log = log
_L = TypeVar("_L")

CandidateLoad = Callable[[int, str],
                         Awaitable[tuple["_L | None", "CheckpointError | None", dict[str, Any]]]]
"""``load(step, save_id) -> (loaded or None, its error, extra)``: this rank's load of one
candidate; ``extra`` is what it tells the other ranks with its outcome (every rank's comes
back to the recovery)."""


@dataclass(frozen=True, slots=True)
class Agreed:
    """What the ranks agreed on, for the recovery's candidate loop (the same on every rank
    but for this rank's own statuses and copies)."""

    candidates: Candidates
    steps: tuple[tuple[int, str], ...]
    """(step, save id) of the candidates to try, newest first (only the wanted one, when a
    step was asked for)."""
    valid: dict[int, StepStatus]
    """{step: this rank's own valid files of it} of the current timeline."""
    copies: list[StepStatus]
    """The copies this rank holds of other ranks' shards, of the current timeline."""
    persisted: dict[int, StepRecord]
    """The persistent tier's complete steps of the current timeline."""
    view: TimelineView
    held_dirs: dict[tuple[int, str], bool]
    """{(step, directory): abandoned already} of this rank's valid files (own or copies)."""
    scanned: frozenset[tuple[int, str]]
    """(step, directory) of every step this rank's scan saw."""
    rejected: list[RejectedStep]
    """The steps rejected so far (by the scan; the loop adds the candidates that fail)."""
    memory: dict[int, StepStatus]
    """{step: this rank's valid files of it in the memory tier} of the current timeline."""

    def in_memory(self, step: int, save_id: str) -> StepStatus | None:
        """This rank's memory files of ``step`` when they are of save ``save_id``."""
        status = self.memory.get(step)
        return status if status is not None and status.save_id == save_id else None

    def own(self, step: int, save_id: str) -> StepStatus | None:
        """This rank's own valid files of ``step`` when they are of save ``save_id``."""
        status = self.valid.get(step)
        return status if status is not None and status.save_id == save_id else None


class Agreement:
    """Scans this rank's tiers and agrees with the other ranks on what to restore."""

    def __init__(self, storage: Storage, coordinator: Coordinator, config: RestoreOptions,
                 reject: Callable[[int, str, str], RejectedStep],
                 promoter: Promoter | None, timeline: Timeline) -> None:
        self.storage = storage
        self.coordinator = coordinator
        self.config = config
        self.rank = coordinator.rank
        self.promoter = promoter
        self.timeline = timeline
        self._reject = reject
        self._persisted: dict[int, StepRecord] = {}
        self._tier_listed = False
        """Whether this restore's listing of the persistent tier succeeded."""
        self.memory_storage: Storage | None = None
        """The memory tier's root (``Recovery.use_memory``), None without one."""

    async def agree(self, limiter: anyio.CapacityLimiter, wanted: int | None) -> Agreed:
        """Scan, agree on the timeline and the candidates (with ``wanted``: that step only,
        or RestoreError naming the steps that could be restored)."""
        statuses = await in_thread(limiter, scan, self.storage, self.rank)
        copies = await in_thread(limiter, scan_replicas, self.storage, self.rank)
        in_memory = await self._scan_memory(limiter)
        rejected: list[RejectedStep] = []
        for seen in statuses:
            if seen.complete and not seen.valid:
                rejected.append(self._reject(seen.step, seen.path, seen.reason or "?"))
        for copy in copies:
            if copy.complete and not copy.valid:
                _log.warning("ckpt.recovery.copy_invalid", step=copy.step, rank=self.rank,
                             source=copy.source, path=copy.path, reason=copy.reason)
        self._persisted = await self._list_persisted(limiter)
        view = await self._agree_timeline([*statuses, *in_memory], copies, limiter)
        held_dirs = {(s.step, s.dir_name): view.abandons(s.step, s.lineage)
                     for s in [*statuses, *copies] if s.valid}
        scanned = frozenset((st.step, st.dir_name) for st in statuses)
        statuses, copies = self._current(view, statuses), self._current(view, copies)
        self._persisted = {step: r for step, r in self._persisted.items()
                           if not view.abandons(step, r.lineage)}
        valid = {s.step: s for s in statuses if s.valid}
        memory = {s.step: s for s in self._current(view, in_memory) if s.valid}
        voted = {step: (s.save_id or "", s.world_size or 0)
                 for step, s in {**valid, **memory}.items()}
        held = [(c.step, c.files.source, c.save_id or "", c.world_size or 0)
                for c in copies if c.valid and c.files is not None]
        persisted = [(r.step, r.save_id, r.world_size) for r in self._persisted.values()]
        agreed = await agree_candidates(
            self.coordinator, voted,
            held_any=(any(s.complete for s in statuses) or bool(held) or bool(persisted)
                      or bool(memory)),
            copies=held, persisted=persisted)
        self._check_world_size(agreed)
        candidates = agreed.steps
        if wanted is not None:
            candidates = tuple((s, i) for s, i in agreed.steps if s == wanted)
            if not candidates:
                listed = ", ".join(str(s) for s, _ in agreed.steps[:20]) or "none"
                raise RestoreError(
                    f"step {wanted} cannot be restored: it is not held and valid for every "
                    f"rank (steps that are: {listed})", step=wanted, rank=self.rank,
                    path=str(self.storage.root),
                    hint="pick one of those steps (ckpt-pipeline ls ROOT)")
        return Agreed(candidates=agreed, steps=candidates, valid=valid, copies=copies,
                      persisted=self._persisted, view=view, held_dirs=held_dirs,
                      scanned=scanned, rejected=rejected, memory=memory)

    async def first_loaded(self, agreed: Agreed, load: CandidateLoad[_L]
                           ) -> tuple[_L, Runs[Any], frozenset[int]] | None:
        """Try the candidates newest first, falling back: this rank loads its shard of one
        (``load``), then the ranks vote on it; the first that loads on every rank is the
        restore's. Returns its load, every rank's extra, and the candidates every rank
        rejected (corruption, not a rewind); None when no rank holds any step.

        Raises the StateError of a live state that does not fit (a usage error: nothing is
        rejected then), RestoreError when another rank's does not fit or when no candidate
        loads everywhere.
        """
        failed: set[int] = set()
        for step, save_id in agreed.steps:
            loaded, error, extra = await load(step, save_id)
            fatal = isinstance(error, StateError)
            failures, any_fatal, extras = await gather_outcome(
                self.coordinator, step, save_id, None if error is None else error.message,
                what="restore load", fatal=fatal, extra=extra)
            if any_fatal:
                if error is not None and fatal:
                    raise error  # the live state does not fit: a usage error, nothing rejected
                raise RestoreError(
                    f"step {step} does not fit the live state on rank(s) "
                    f"{sorted(failures)}: {listing(failures)}", step=step, rank=self.rank,
                    hint="restore into the same state layout that was saved")
            if not failures and loaded is not None:
                self.log_unresolved(agreed.candidates, newer_than=step)
                return loaded, extras, frozenset(failed)
            status = agreed.own(step, save_id)
            path = status.path if status is not None else ""
            agreed.rejected.append(self._reject(step, path, listing(failures)))
            failed.add(step)
        if not agreed.candidates.held_any:
            return None
        raise self.none_loaded(agreed.candidates, agreed.rejected)

    def none_loaded(self, agreed: Candidates, rejected: list[RejectedStep]) -> RestoreError:
        """The error when every candidate failed: what each rank holds, what no rank holds,
        and why each candidate was rejected."""
        self.log_unresolved(agreed, newer_than=-1)
        missing = self._missing_shards(agreed)
        unresolved = self._unresolved(agreed)
        alike = Runs.join([agreed.valid])  # adjacent ranks holding equal steps: one entry
        by_rank = "; ".join(f"rank(s) {spans_text([(start, stop)])}: {list(steps) or 'none'}"
                            for start, stop, steps in alike.runs())
        listing = "; ".join(f"step {r.step}: {r.reason}" for r in rejected)
        return RestoreError(
            f"no checkpoint could be loaded on every rank (valid steps by rank: {by_rank}"
            + (f"; missing everywhere: {missing}" if missing else "")
            + (f"; {unresolved}" if unresolved else "")
            + (f"; rejected: {listing}" if listing else "") + ")", rank=self.rank,
            path=str(self.storage.root),
            hint="inspect with `ckpt-pipeline verify`; move the roots aside to start fresh")

    @staticmethod
    def _unresolved(agreed: Candidates) -> str:
        """Why the newest step no save id could be agreed on for was left out ("" if
        none)."""
        if not agreed.unresolved:
            return ""
        step = max(agreed.unresolved)
        return f"step {step}: {agreed.unresolved[step]}"

    def log_unresolved(self, agreed: Candidates, *, newer_than: int) -> None:
        """Log the steps newer than ``newer_than`` that no save id could be agreed on for."""
        for step, why in sorted(agreed.unresolved.items(), reverse=True):
            if step > newer_than:
                _log.warning("ckpt.recovery.step_unresolved", step=step, rank=self.rank,
                             reason=why)

    @staticmethod
    def _missing_shards(agreed: Candidates) -> str:
        """For the newest step any rank holds: the ranks whose shard no rank holds."""
        newest = agreed.newest_valid
        if newest is None:
            return ""
        lacking = [(r, r + 1) for start, stop, steps in agreed.valid.runs()
                   if newest not in steps
                   for r in range(start, stop) if not agreed.copies_of(newest, r)]
        if not lacking or any(step == newest for step, _ in agreed.persisted):
            return ""
        return (f"step {newest}: the shard of rank(s) {spans_text(lacking)} (no own file, no "
                "copy on any rank, not in the persistent tier)")

    async def _scan_memory(self, limiter: anyio.CapacityLimiter) -> list[StepStatus]:
        """This rank's steps in the memory tier ([] without one; those written where this
        rank ran elsewhere were dropped at open: ``MemoryStage.open``)."""
        storage = self.memory_storage
        if storage is None:
            return []
        try:
            found = await in_thread(limiter, scan, storage, self.rank)
        except CheckpointError as exc:
            _log.warning("ckpt.recovery.memory_unreadable", rank=self.rank,
                         path=str(storage.root), error=exc.message)
            return []
        for seen in found:
            if seen.complete and not seen.valid:
                _log.warning("ckpt.recovery.memory_step_invalid", step=seen.step,
                             rank=self.rank, path=seen.path, reason=seen.reason)
        return found

    async def _list_persisted(self, limiter: anyio.CapacityLimiter) -> dict[int, StepRecord]:
        """The steps complete in the persistent tier ({} without one, or when it cannot be
        listed: that is logged, and restore goes on with the other tiers)."""
        if self.promoter is None:
            return {}
        self._tier_listed = False
        try:
            found = await in_thread(limiter, self.promoter.complete_steps)
        except CheckpointError as exc:
            _log.warning("ckpt.recovery.persistent_unreachable", rank=self.rank,
                         url=self.promoter.url, error=exc.message)
            return {}
        self._tier_listed = True
        return found

    @property
    def persisted(self) -> Mapping[int, StepRecord]:
        """The persistent tier's complete steps that this rank listed in the last ``agree``
        (none abandoned by a rewind); {} without a tier or when it could not be listed."""
        return self._persisted

    def _check_world_size(self, agreed: Candidates) -> None:
        """Refuse when the newest step any rank holds (in its root, in a copy, or in the
        persistent tier: what the ranks exchanged, the same on every rank) was saved by
        another world size."""
        newest = max([*(() if agreed.newest_valid is None else (agreed.newest_valid,)),
                      *(s for s, _ in agreed.persisted), *agreed.world_sizes], default=None)
        if newest is not None and newest in agreed.world_sizes:
            saved = agreed.world_sizes[newest]
            raise WorldSizeChanged(
                f"step {newest} was saved by {saved} rank(s), this job has "
                f"{self.coordinator.world_size}", step=newest, rank=self.rank,
                path=str(self.storage.root), saved_world=saved,
                hint=f"restore with {saved} ranks, or keep every rank's files of the step in "
                     "one root that every rank reads (a shared root), or in the persistent "
                     "tier: that reshards")

    async def _agree_timeline(self, statuses: list[StepStatus],
                              copies: list[StepStatus],
                              limiter: anyio.CapacityLimiter) -> TimelineView:
        """Every rank's marks and steps (``rewind.py``): the same view on every rank."""
        rewinds = await in_thread(limiter, read_rewinds, self.storage)
        if self.promoter is not None:
            rewinds += await self._tier_rewinds(limiter)
        return await agree_timeline(
            self.coordinator, own=[s for s in statuses if s.valid],
            copies=[c for c in copies if c.valid], persisted=self._persisted,
            rewinds=rewinds, known=() if self.promoter is None else self.promoter.marks(),
            timeline=self.timeline.timeline)

    async def _tier_rewinds(self, limiter: anyio.CapacityLimiter) -> list[Rewind]:
        """The rewinds the persistent tier records ([] and a log line when it cannot be
        read: the local records still count)."""
        promoter = self.promoter
        assert promoter is not None
        if not self._tier_listed:  # unreachable in this restore: not waited for twice
            return []
        try:
            return await in_thread(limiter, promoter.recorded_rewinds)
        except CheckpointError as exc:
            _log.warning("ckpt.recovery.tier_rewinds_unreadable", rank=self.rank,
                         url=promoter.url, error=exc.message)
            return []

    def _current(self, view: TimelineView, statuses: list[StepStatus]
                 ) -> list[StepStatus]:
        """``statuses`` less the valid ones of an abandoned timeline (logged)."""
        out = []
        for status in statuses:
            if status.valid and view.abandons(status.step, status.lineage):
                _log.info("ckpt.recovery.abandoned_skipped", step=status.step, rank=self.rank,
                          save_id=status.save_id, source=status.source, path=status.path)
                continue
            out.append(status)
        return out


def listing(failures: Mapping[int, str]) -> str:
    """``{rank: error}`` as one line, by rank (for the errors that name the failed ranks)."""
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
