"""The rewinds of the run in the persistent tier, and the steps of its current timeline there.

Rank 0 records every rewind in one object, ``URL/timeline.rewinds`` (the same document as a
local rewind record, listing every rewind; ``_format/timeline.py`` has the rule), and only
then takes the commit objects of the abandoned steps off the tier (their data follow). A reader
of the tier (recovery, ``cp.load URL``, ``show URL``) applies the record and the steps' own
lineage, so a step a rewind abandoned is never the newest, whichever of the two survived.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..._format.documents import decode_rewinds, encode_rewinds
from ..._format.names import TIER_REWINDS, step_dir_name
from ..._format.timeline import Mark, Rewind, abandoned, marks_of
from .layout import STEP_COMMIT, StepRecord
from .remote import Remote

__all__ = ("TIER_REWINDS", "current_records", "drop_commit_objects", "read_tier_rewinds",
           "record_rewinds", "tier_marks")

_MAX_BYTES = 1024 * 1024


def read_tier_rewinds(remote: Remote) -> list[Rewind]:
    """The rewinds recorded in the tier ([] when none was); CheckpointIntegrityError when the
    object does not decode, RemoteError when it cannot be read. Worker thread."""
    raw = remote.get_small(TIER_REWINDS, _MAX_BYTES)
    if raw is None:
        return []
    return decode_rewinds(raw, f"{remote.url}/{TIER_REWINDS}")


def record_rewinds(remote: Remote, rewinds: Iterable[Rewind]) -> list[Rewind]:
    """Rank 0: add ``rewinds`` to the tier's record (one put of the whole object: a reader
    sees the old record or the new one). Returns those that were new. Worker thread."""
    present = {r.timeline: r for r in read_tier_rewinds(remote)}
    new = [r for r in rewinds if r.timeline not in present]
    if new:
        for rewind in new:
            present[rewind.timeline] = rewind
        remote.put_small(TIER_REWINDS, encode_rewinds(list(present.values())))
    return new


def tier_marks(records: Mapping[int, StepRecord], rewinds: Iterable[Rewind]) -> set[Mark]:
    """The marks of the tier: its rewind record and the lineage of its complete steps."""
    return marks_of((r.lineage for r in records.values()), rewinds)


def current_records(records: Mapping[int, StepRecord], marks: Iterable[Mark]
                    ) -> dict[int, StepRecord]:
    """``records`` less the steps that ``marks`` abandon."""
    marks = set(marks)
    return {step: r for step, r in records.items()
            if not abandoned(step, r.lineage, marks)}


def drop_commit_objects(remote: Remote, records: Mapping[int, StepRecord],
                        marks: Iterable[Mark]) -> list[int]:
    """Rank 0, after the rewind is recorded: delete the commit object of every complete step
    that ``marks`` abandon, so that no reader, old or new, takes it for complete. Returns those
    steps (the caller removes their data objects next). Worker thread."""
    marks = set(marks)
    gone = sorted(step for step, r in records.items() if abandoned(step, r.lineage, marks))
    for step in sorted(gone, reverse=True):
        remote.delete([f"{step_dir_name(step)}/{STEP_COMMIT}"])
    return gone
