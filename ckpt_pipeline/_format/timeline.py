"""Lineage and rewinds: which steps belong to the run's current timeline (docs/format.md).

Every commit record names its ``Lineage``: the step (and save id) it continues from, and the
run's *timeline*, a number that grows by one at every restore. A restore that goes back behind
steps that some tier still holds is a *rewind*, recorded durably (``Rewind``) in every tier
before ``restore()`` returns. Both say the same thing, a ``Mark``: "from timeline T on, the run
continues from step N", so every step of an older timeline newer than N is *abandoned*:

- a rewind record is the mark (N, T) itself;
- a commit record of timeline T that continues from step P is the mark (P, T) (its timeline
  forked at P or earlier), so the lineage alone already hides the steps it replaced, even where
  every rewind record is lost.

``abandoned`` is the one rule every reader applies (recovery, ``cp.load``, ``show``, the
persistent tier's pruning). A record without lineage (written before lineage existed) is of
timeline 0 and continues from nothing: it marks nothing, and only a mark can hide it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointIntegrityError
from .limits import MAX_SAVE_ID_LEN

__all__ = (
    "MAX_REWINDS",
    "Lineage",
    "Mark",
    "Rewind",
    "abandoned",
    "decode_lineage",
    "decode_rewind",
    "encode_lineage",
    "marks_of",
    "rewind_doc",
)

MAX_REWINDS = 256
"""Bound on the rewinds one record file holds (the persistent tier's keeps the newest)."""


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a committed step comes from: ``parent`` (step, save id) of the step it continues
    from (None: the first save of a pipeline that restored nothing), and its ``timeline``."""

    timeline: int
    parent: tuple[int, str] | None = None


@dataclass(frozen=True, slots=True, order=True)
class Mark:
    """From ``timeline`` on, the run continues from ``step``: steps of older timelines newer
    than ``step`` are abandoned."""

    timeline: int
    step: int


@dataclass(frozen=True, slots=True)
class Rewind:
    """A restore that abandoned newer steps of the current timeline: the run goes on from
    ``step`` (``save_id``) as ``timeline``. ``abandoned``: (step, save id) of the steps it
    saw and left, for the record (the rule needs only the mark)."""

    step: int
    save_id: str
    timeline: int
    unix: float
    abandoned: tuple[tuple[int, str], ...] = ()

    @property
    def mark(self) -> Mark:
        return Mark(self.timeline, self.step)


def marks_of(lineages: Iterable[Lineage | None], rewinds: Iterable[Rewind] = ()) -> set[Mark]:
    """The marks that commit records (their lineage) and rewind records make."""
    out = {r.mark for r in rewinds}
    for lineage in lineages:
        if lineage is not None and lineage.parent is not None and lineage.timeline > 0:
            out.add(Mark(lineage.timeline, lineage.parent[0]))
    return out


def abandoned(step: int, lineage: Lineage | None, marks: Iterable[Mark]) -> bool:
    """Whether a committed ``step`` of ``lineage`` is off the current timeline: some mark of a
    newer timeline continues from an older step."""
    timeline = 0 if lineage is None else lineage.timeline
    return any(m.timeline > timeline and step > m.step for m in marks)


def encode_lineage(lineage: Lineage) -> dict[str, Any]:
    """The commit record's ``timeline`` and ``parent`` fields."""
    doc: dict[str, Any] = {"timeline": lineage.timeline}
    if lineage.parent is not None:
        doc["parent"] = {"step": lineage.parent[0], "save_id": lineage.parent[1]}
    return doc


def decode_lineage(doc: Mapping[str, Any], path: str) -> Lineage | None:
    """The optional ``timeline`` and ``parent`` fields (None when both are absent, as in
    records written before lineage existed)."""
    if "timeline" not in doc and "parent" not in doc:
        return None
    timeline = doc.get("timeline", 0)
    if type(timeline) is not int or timeline < 0:
        raise CheckpointIntegrityError("field 'timeline' is not a non-negative int", path=path)
    parent = doc.get("parent")
    if parent is None:
        return Lineage(timeline)
    return Lineage(timeline, _step_and_id(parent, "parent", path))


def _step_and_id(value: Any, what: str, path: str) -> tuple[int, str]:
    if not isinstance(value, dict):
        raise CheckpointIntegrityError(f"field {what!r} is not a map", path=path)
    step, save_id = value.get("step"), value.get("save_id")
    if type(step) is not int or step < 0 or not isinstance(save_id, str) or not (
        0 < len(save_id) <= MAX_SAVE_ID_LEN
    ):
        raise CheckpointIntegrityError(f"field {what!r} needs a step and a save id",
                                       path=path)
    return step, save_id


def rewind_doc(rewind: Rewind) -> dict[str, Any]:
    """One rewind as a map (in a local rewind record, or in the tier's list)."""
    return {"step": rewind.step, "save_id": rewind.save_id, "timeline": rewind.timeline,
            "unix": float(rewind.unix),
            "abandoned": [[s, i] for s, i in rewind.abandoned[:MAX_REWINDS]]}


def decode_rewind(value: Any, path: str) -> Rewind:
    """One rewind from its map; CheckpointIntegrityError naming ``path`` otherwise."""
    if not isinstance(value, dict):
        raise CheckpointIntegrityError("a rewind is not a map", path=path)
    step, save_id = _step_and_id(value, "rewind", path)
    timeline, unix = value.get("timeline"), value.get("unix")
    gone = value.get("abandoned", [])
    if type(timeline) is not int or timeline < 1 or type(unix) is not float or not (
        math.isfinite(unix)
    ) or not isinstance(gone, list) or not all(
        isinstance(g, list) and len(g) == 2 and type(g[0]) is int and isinstance(g[1], str)
        for g in gone
    ):
        raise CheckpointIntegrityError("a rewind has a malformed timeline, time or list of "
                                       "abandoned steps", path=path)
    return Rewind(step, save_id, timeline, unix, tuple((g[0], g[1]) for g in gone))
