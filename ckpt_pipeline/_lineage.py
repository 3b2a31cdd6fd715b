"""The run's timeline in a local root: what the next commit continues from, and the rewind
records every rank keeps (the rule and the record format are in ``_format/timeline.py``).

Shared by the save path (the lineage each commit record names), the restore path (which steps
are abandoned, and the rewind it records) and the readers (``cp.load``, ``show``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ._format.documents import decode_rewinds, encode_rewinds
from ._format.filesets import rank_sets
from ._format.names import TIER_REWINDS, parse_rewind_file, rewind_file_name
from ._format.publish import publish_file
from ._format.steps import committed_steps, read_commit, read_small
from ._format.timeline import (
    Lineage,
    Mark,
    Rewind,
    abandoned,
    marks_of,
)
from ._logging import log
from .errors import CheckpointError
from .storage import Storage

__all__ = ("Timeline", "current_steps", "forget_rewind", "local_marks", "local_timeline", "read_rewinds",
           "step_lineage", "write_rewind")


@dataclass(slots=True)
class Timeline:
    """This pipeline's place in the run's history, the same on every rank: the ``timeline``
    its commits carry and the step the next commit continues from (``head``). Agreed at open
    and at every restore; moved on by each commit."""

    timeline: int = 0
    head: tuple[int, str] | None = None

    def lineage(self) -> Lineage:
        """What the next commit record names."""
        return Lineage(self.timeline, self.head)

    def committed(self, step: int, save_id: str) -> None:
        self.head = (step, save_id)


def write_rewind(storage: Storage, rank: int, rewind: Rewind) -> str:
    """Record ``rewind`` in the root as ``rank``'s file, durably (published, the root fsynced)
    before it returns. An existing record of the same timeline stays as it is (the rewind was
    recorded already). Returns its path. Worker thread."""
    name = rewind_file_name(rewind.timeline, rank)
    path = os.path.join(str(storage.root), name)
    if any(e.name == name for e in storage.list_dir("")):
        return path
    publish_file(storage, "", name, encode_rewinds([rewind]))
    return path


def forget_rewind(storage: Storage, rank: int, rewind: Rewind) -> None:
    """Remove ``rank``'s record of ``rewind`` (a rewind that failed on another rank, before
    anything was moved aside). Best-effort: a failure is logged. Worker thread."""
    name = rewind_file_name(rewind.timeline, rank)
    try:
        storage.unlink(name)
        storage.fsync_dir("")
    except CheckpointError as exc:
        log.error("ckpt.lineage.rewind_not_removed", rank=rank, step=rewind.step,
                  path=os.path.join(str(storage.root), name), error=exc.message,
                  hint="remove the file by hand: until then the steps after "
                       f"{rewind.step} are treated as abandoned")


def read_rewinds(storage: Storage) -> list[Rewind]:
    """Every rewind recorded in the root (any rank's file: they are the run's; and the
    persistent tier's record, for a directory tier read as a root), oldest timeline first. A
    record that cannot be read is logged and left out. Worker thread."""
    out: dict[int, Rewind] = {}
    for entry in storage.list_dir(""):
        named = parse_rewind_file(entry.name) is not None or entry.name == TIER_REWINDS
        if not named or not entry.is_file:
            continue
        path = os.path.join(str(storage.root), entry.name)
        try:
            rewinds = decode_rewinds(read_small(storage, entry.name), path)
        except CheckpointError as exc:
            log.warning("ckpt.lineage.rewind_unreadable", path=path, error=exc.message)
            continue
        for rewind in rewinds:
            out.setdefault(rewind.timeline, rewind)
    return [out[t] for t in sorted(out)]


def step_lineage(storage: Storage, rank: int, step: int, dir_name: str) -> Lineage | None:
    """The lineage in the commit record of ``rank``'s files of ``step`` (its own, else the
    first copy's); None without one, or when none can be read."""
    names = {e.name for e in storage.list_dir(dir_name)}
    for files in rank_sets(names, rank):
        if files.commit not in names:
            continue
        try:
            return read_commit(storage, dir_name, step, rank, files).lineage
        except CheckpointError:
            continue
    return None


def local_marks(storage: Storage, lineages: Iterable[Lineage | None]) -> set[Mark]:
    """The marks of the root's rewind records and of ``lineages``. Worker thread."""
    return marks_of(lineages, read_rewinds(storage))


def current_steps(storage: Storage, rank: int, steps: Mapping[int, str]) -> dict[int, str]:
    """``steps`` ({step: directory}, e.g. ``committed_steps``) less those a rewind recorded in
    the root, or the lineage of another step there, abandons. Worker thread."""
    lineages = {step: step_lineage(storage, rank, step, d) for step, d in steps.items()}
    marks = local_marks(storage, lineages.values())
    return {step: d for step, d in steps.items()
            if not abandoned(step, lineages[step], marks)}



def local_timeline(storage: Storage, rank: int) -> int:
    """The newest timeline that this rank's commit records or the root's rewind records
    name (0 when none does). Worker thread."""
    timelines = [r.timeline for r in read_rewinds(storage)]
    for step, dir_name in committed_steps(storage, rank, copies=True).items():
        lineage = step_lineage(storage, rank, step, dir_name)
        if lineage is not None:
            timelines.append(lineage.timeline)
    return max(timelines, default=0)
