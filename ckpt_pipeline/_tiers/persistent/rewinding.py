"""The rewinds the promoter knows of, and rank 0 recording them in the tier (``rewinds``):
pending while the tier cannot be reached, flushed before the next commit object."""

from __future__ import annotations

from collections.abc import Sequence

from ..._format.timeline import Mark, Rewind
from ..._logging import log
from ...errors import CheckpointError
from . import state
from .prune import Pruning
from .records import complete_steps
from .rewinds import drop_commit_objects, record_rewinds, tier_marks
from .workers import bounded

__all__ = ("Rewinding",)


class Rewinding(Pruning):
    """Recording rewinds in the tier and taking the abandoned steps off it."""

    def rewound(self, rewinds: Sequence[Rewind]) -> bool:
        """The run was rewound (``rewinds``: this one, or those a local root records): on
        rank 0, record them in the tier and take the abandoned steps' commit objects off it.
        Returns whether the tier has them now (True on other ranks). When it cannot be
        reached they stay pending (logged), recorded before the next commit object; readers
        meanwhile ignore the abandoned steps by the local records. Worker thread."""
        with self._lock:
            for rewind in rewinds:
                if rewind.timeline not in self._rewinds:
                    self._rewinds[rewind.timeline] = rewind
                    if self.rank == 0:
                        self._pending[rewind.timeline] = rewind
        try:  # a hung store must not hold the restore up: then the rewind stays pending
            return bounded(self._flush_rewinds, state.LIST_WAIT_S, f"ckpt-persist-rewind-r{self.rank}")
        except TimeoutError as exc:
            log.warning("ckpt.persist.rewind_pending", rank=self.rank, url=self.url,
                        error=str(exc), action="the rewind is recorded in the local roots; "
                        "it is recorded in the tier before the next commit object")
            return False

    def marks(self) -> set[Mark]:
        """The marks of the rewinds this pipeline knows of."""
        with self._lock:
            return {r.mark for r in self._rewinds.values()}

    def _flush_rewinds(self) -> bool:
        with self._lock:
            pending = list(self._pending.values())
        if not pending:
            return True
        remote = self.remote
        try:
            if remote is None:
                raise CheckpointError("the persistent tier is not open")
            if self._owner is None or self._owner.lost is not None:
                raise CheckpointError("this open does not hold the persistent URL")
            # Recorded by this pipeline already (its drop failed), or new to the tier: the
            # abandoned commit objects go. One the tier recorded before is left alone.
            recorded = [r for r in pending if r.timeline in self._recorded]
            recorded += record_rewinds(remote, [r for r in pending if r not in recorded])
            self._recorded |= {r.timeline for r in recorded}
            gone: list[int] = []
            if recorded:
                records = complete_steps(remote, rank=self.rank)
                gone = drop_commit_objects(remote, records,
                                           tier_marks(records, pending) | self.marks())
        except Exception as exc:
            error = exc.message if isinstance(exc, CheckpointError) else (
                f"{type(exc).__name__}: {exc}")
            log.warning("ckpt.persist.rewind_pending", rank=self.rank, url=self.url,
                        timelines=[r.timeline for r in pending], error=error,
                        action="the rewind is recorded in the local roots; it is recorded "
                               "in the tier before the next commit object")
            return False
        with self._lock:
            for rewind in pending:
                self._pending.pop(rewind.timeline, None)
        for step in gone:  # before any upload of the new timeline can reuse the prefix
            self._remove_step(step)
        log.debug("ckpt.persist.rewind_recorded", rank=self.rank, url=self.url,
                  timelines=[r.timeline for r in pending], abandoned=gone)
        return True
