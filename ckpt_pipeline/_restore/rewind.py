"""The restore's view of the run's timeline: which steps are abandoned, and the rewind.

Before the ranks agree on candidates, every rank sends what it knows of the timeline: the
marks of the rewind records it can read (its root, the persistent tier, its pipeline's
memory) and of the lineage of every step it holds (own files, copies, the tier's complete
steps), and those steps. Every rank then holds the same ``TimelineView``, so every rank drops
the same abandoned steps from every tier before the agreement, and takes the same decision
on whether the restore is a rewind (``rewind_for``): some step of the current timeline newer
than the restored one is held somewhere. A rewind is recorded in every tier before anything
is moved aside (``Recovery.finish``).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._format.scan import StepStatus
from .._format.timeline import Lineage, Mark, Rewind, abandoned, marks_of
from ..coordination import Coordinator
from ..coordination._agree import gather_shared
from ..errors import CoordinationError

if TYPE_CHECKING:
    from .._tiers.persistent.layout import StepRecord

__all__ = ("TimelineView", "agree_timeline")

_MAX_ENTRIES = 100_000


@dataclass(frozen=True, slots=True)
class TimelineView:
    """What every rank knows of the timeline, the same on every rank."""

    marks: frozenset[Mark]
    top: int
    """The newest timeline any record names."""
    entries: frozenset[tuple[int, str, int]]
    """(step, save id, timeline) of every step any rank holds in any tier."""

    def abandons(self, step: int, lineage: Lineage | None) -> bool:
        return abandoned(step, lineage, self.marks)

    def rewind_for(self, step: int, save_id: str, failed: Collection[int] = ()
                   ) -> Rewind | None:
        """The rewind that restoring ``step`` makes: None unless some step of the current
        timeline newer than it is held somewhere (those are listed). ``failed``: the steps
        this restore tried and every rank rejected (corruption, not a rewind)."""
        newer = sorted({(s, i) for s, i, t in self.entries
                        if s > step and s not in failed
                        and not abandoned(s, Lineage(t), self.marks)})
        if not newer:
            return None
        return Rewind(step, save_id, self.top + 1, time.time(), tuple(newer))


async def agree_timeline(coordinator: Coordinator, *, own: Iterable[StepStatus],
                         copies: Iterable[StepStatus],
                         persisted: Mapping[int, StepRecord], rewinds: Iterable[Rewind],
                         known: Iterable[Mark] = (), timeline: int) -> TimelineView:
    """Exchange every rank's marks and steps (see the module docstring). ``own`` and
    ``copies``: the valid statuses of this rank's files; ``rewinds``: the records it read;
    ``known``: the marks its pipeline holds in memory; ``timeline``: its current one."""
    own, copies, rewinds = list(own), list(copies), list(rewinds)
    lineages = [s.lineage for s in [*own, *copies]] + [r.lineage for r in persisted.values()]
    marks = marks_of(lineages, rewinds) | set(known)
    entries = {(s.step, s.save_id or "", 0 if s.lineage is None else s.lineage.timeline)
               for s in [*own, *copies]}
    entries |= {(r.step, r.save_id, 0 if r.lineage is None else r.lineage.timeline)
                for r in persisted.values()}
    top = max([timeline, *(m.timeline for m in marks),
               *(t for _s, _i, t in entries)])
    answers = await gather_shared(coordinator, {
        "marks": sorted([m.timeline, m.step] for m in marks), "top": top,
        "entries": sorted([s, i, t] for s, i, t in entries)}, what="restore timeline")
    all_marks: set[Mark] = set()
    all_entries: set[tuple[int, str, int]] = set()
    tops: list[int] = []
    for rank, _stop, answer in answers.runs():  # ranks that answered alike: read once
        try:
            all_marks |= {Mark(int(t), int(s)) for t, s in _pairs(answer["marks"], 2)}
            all_entries |= {(int(s), str(i), int(t)) for s, i, t in _pairs(answer["entries"], 3)}
            tops.append(_int(answer["top"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CoordinationError(f"restore timeline: rank {rank} sent a malformed message "
                                    f"({exc})", rank=coordinator.rank, ranks=(rank,),
                                    hint="run the same version of ckpt_pipeline on every "
                                         "rank") from exc
    return TimelineView(frozenset(all_marks), max(tops), frozenset(all_entries))


def _pairs(value: Any, width: int) -> list[list[Any]]:
    if not isinstance(value, list) or len(value) > _MAX_ENTRIES or not all(
        isinstance(v, list) and len(v) == width for v in value
    ):
        raise ValueError("not a list of entries")
    return value


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError("not a non-negative int")
    return value
