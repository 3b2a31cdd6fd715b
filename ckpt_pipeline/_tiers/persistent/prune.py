"""Rank 0's removals from the persistent tier: a step taken off (commit object first), the
leftovers of killed uploads swept, and ``persistent_keep`` applied after each commit object."""

from __future__ import annotations

from ..._format.names import parse_step_dir, step_dir_name
from ..._logging import log
from ...events import PersistPruned
from .layout import STEP_COMMIT
from .state import PromoterState

__all__ = ("Pruning",)


class Pruning(PromoterState):
    """Removing steps and leftovers from the tier (rank 0, never once the URL is lost)."""

    def _remove_step(self, step: int) -> None:
        """Rank 0: take a step off the persistent tier, its commit object first, and what
        killed uploads left of it. Nothing once the URL is another job's."""
        remote = self.remote
        if remote is None or self._owner is None or self._owner.lost is not None:
            return
        dir_name = step_dir_name(step)
        try:
            names = remote.list_dir(dir_name)
            if STEP_COMMIT in names:
                remote.delete([f"{dir_name}/{STEP_COMMIT}"])
            leftovers = remote.leftovers(dir_name)
            remote.delete([f"{dir_name}/{n}" for n in [*names, *leftovers]
                           if n != STEP_COMMIT])
        except Exception as exc:
            log.warning("ckpt.persist.remove_failed", step=step, rank=self.rank, url=self.url,
                        error=f"{type(exc).__name__}: {exc}")
            return
        if names or leftovers:
            self._emit(PersistPruned(step=step, rank=self.rank, url=self.url,
                                     complete=STEP_COMMIT in names))

    def _sweep(self, step: int) -> None:
        """Rank 0: remove what killed uploads left in a complete step's prefix (temporaries
        of another attempt at the same step). Failures are logged."""
        remote = self.remote
        assert remote is not None
        dir_name = step_dir_name(step)
        try:
            leftovers = remote.leftovers(dir_name)
            if leftovers:
                remote.delete([f"{dir_name}/{n}" for n in leftovers])
                log.info("ckpt.persist.leftovers_removed", step=step, rank=self.rank,
                         url=self.url, names=leftovers)
        except Exception as exc:
            log.warning("ckpt.persist.remove_failed", step=step, rank=self.rank, url=self.url,
                        error=f"{type(exc).__name__}: {exc}")

    def _prune(self, newest: int) -> None:
        """Rank 0, after committing ``newest``: keep the newest ``persistent_keep`` complete
        steps; remove the others, and unfinished promotions older than ``newest``, and what
        killed uploads left in the steps kept."""
        remote = self.remote
        assert remote is not None
        if self._owner is None or self._owner.lost is not None:
            return
        keep = self.config.keep
        try:
            steps = sorted((s for s in map(parse_step_dir, remote.list_steps())
                            if s is not None), reverse=True)
            complete = [s for s in steps if remote.exists(f"{step_dir_name(s)}/{STEP_COMMIT}")]
        except Exception as exc:
            log.warning("ckpt.persist.prune_failed", rank=self.rank, url=self.url,
                        error=f"{type(exc).__name__}: {exc}")
            return
        kept = set(complete if keep is None else complete[:keep])
        for step in steps:
            if step >= newest or step in self._assigned:
                continue
            if step in kept:
                self._sweep(step)
            else:
                self._remove_step(step)
