"""Replication's part in a save's commit (a ``CommitParticipant``).

The first vote carries which holders acknowledged a durable copy of this rank's shard
(``CopiesAcked``). The step commits when every rank's own shard is durable; each holder then
writes the commit record of the copies it acknowledged (and removes any other copy of the
step), and the second vote carries the copies that could not be committed
(``CopiesSettled``). Every rank thus ends with the same list of missing copies
(``Replicas``). When the step is not committed, every holder removes its copies of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..._threads import in_thread
from ...coordination._runs import Runs
from ..base import Recorded, Vote
from .push import Push, PushOutcome
from .replication import Replication

__all__ = ("CopiesAcked", "CopiesSettled", "ReplicaVote", "Replicas")


@dataclass(frozen=True, slots=True)
class CopiesAcked:
    """A rank's first-vote part: the holders that acknowledged a durable copy of its shard,
    and why each other holder did not. ``acked`` None: every holder the placement names for
    this rank, the good path. That part is the same message on every rank (``True``, not the
    rank's own list of holders), so that a commit vote with replication on stays one run of
    equal answers, decoded once, however many ranks vote (``docs/scale.md``)."""

    acked: tuple[int, ...] | None
    errors: Mapping[int, str] = field(default_factory=dict)

    def acked_of(self, planned: Sequence[int]) -> tuple[int, ...]:
        """The holders that acknowledged, given those the placement names for the rank."""
        return tuple(planned) if self.acked is None else self.acked

    def to_msg(self) -> Any:
        return {"acked": True if self.acked is None else list(self.acked),
                "errors": {str(h): e for h, e in self.errors.items()}}

    @classmethod
    def from_msg(cls, message: Any) -> CopiesAcked:
        """The inverse of ``to_msg``; a ValueError for anything else."""
        if not isinstance(message, dict) or set(message) != {"acked", "errors"}:
            raise ValueError("not a map of acked and errors")
        acked = message["acked"]
        if acked is True:
            return cls(None, _by_rank(message["errors"]))
        if not isinstance(acked, list) or not all(type(h) is int for h in acked):
            raise ValueError("acked is neither true nor a list of ranks")
        return cls(tuple(acked), _by_rank(message["errors"]))


@dataclass(frozen=True, slots=True)
class CopiesSettled:
    """A holder's second-vote part: {source: why} of the copies it could not commit."""

    failed: Mapping[int, str] = field(default_factory=dict)

    def to_msg(self) -> Any:
        return {str(s): e for s, e in self.failed.items()}

    @classmethod
    def from_msg(cls, message: Any) -> CopiesSettled:
        """The inverse of ``to_msg``; a ValueError for anything else."""
        return cls(_by_rank(message))


@dataclass(frozen=True, slots=True)
class Replicas:
    """The copies of a committed step (empty without replication)."""

    holders: tuple[int, ...] = ()
    """Holders of a durable copy of this rank's shard."""
    missing: tuple[tuple[int, int], ...] = ()
    """(source, holder) of every copy of the step that is not durable, on every rank."""
    reasons: tuple[str, ...] = ()
    pushed: PushOutcome | None = None


class ReplicaVote:
    """Replication's participant in the commit of one save (see the module docstring).
    ``push``: the copies of this rank's shard (None: it sends none)."""

    key = "replicas"
    any_step = False
    rooted = False

    def __init__(self, replication: Replication, push: Push | None, *, step: int,
                 save_id: str, rank: int, limiter: anyio.CapacityLimiter) -> None:
        self.replication = replication
        self.push = push
        self.step = step
        self.save_id = save_id
        self.rank = rank
        self.limiter = limiter
        self.pushed: PushOutcome | None = None
        self._first: Vote[CopiesAcked] = Vote(False, Runs((), ()))
        self._second: Vote[CopiesSettled] = Vote(False, Runs((), ()))

    def decode_vote(self, message: Any) -> CopiesAcked:
        return CopiesAcked.from_msg(message)

    def decode_confirm(self, message: Any) -> CopiesSettled:
        return CopiesSettled.from_msg(message)

    async def contribute(self, failed: bool) -> CopiesAcked | None:
        """Wait for the holders' acknowledgements (or abort the copies of a failed save)."""
        if self.push is None:
            return None
        if failed:
            self.push.abort(f"the save failed on rank {self.rank}")
            return None
        self.pushed = await in_thread(self.limiter, self.push.collect)
        acked, errors = tuple(self.pushed.acked), dict(self.pushed.errors)
        planned = self._planned(self.rank)
        if not errors and sorted(acked) == sorted(planned):
            return CopiesAcked(None)  # every holder: the same part on every rank
        return CopiesAcked(acked, errors)

    def _planned(self, source: int) -> tuple[int, ...]:
        """The holders the placement names for ``source``'s shard."""
        placement = self.replication.placement
        return () if placement is None else placement.holders[source]

    async def voted(self, vote: Vote[CopiesAcked]) -> None:
        """Not committed: remove every copy this rank holds of the step."""
        self._first = vote
        if not vote.agreed:
            await in_thread(self.limiter, self.replication.settle, self.step, self.save_id, ())
            self.replication.forget(self.step, self.save_id)

    async def confirm(self, recorded: Recorded) -> CopiesSettled | None:
        """Commit the copies this rank acknowledged, with the owners' metrics and lineage;
        the part names those that could not be committed."""
        if self.replication.placement is None:
            return None
        parts = self._first.parts
        sources = [source for source in self.replication.placement.held_by(self.rank)
                   if source < len(parts) and (part := parts[source]) is not None
                   and self.rank in part.acked_of(self._planned(source))]
        failed = await in_thread(self.limiter, self.replication.settle, self.step,
                                 self.save_id, sources, recorded.metrics, recorded.lineage)
        return CopiesSettled(failed)

    async def confirmed(self, vote: Vote[CopiesSettled]) -> None:
        """Not complete everywhere: remove the copies; complete: forget the step."""
        self._second = vote
        if vote.agreed:
            self.replication.forget(self.step, self.save_id)
        else:
            await in_thread(self.limiter, self.replication.drop, self.step, self.save_id)

    def replicas(self) -> Replicas:
        """The copies of the committed step (after ``confirmed``): the same missing copies
        on every rank, and the holders of this rank's durable ones."""
        placement = self.replication.placement
        if placement is None:
            return Replicas((), (), (), self.pushed)
        missing: list[tuple[int, int]] = []
        reasons: list[str] = []
        first, second = self._first.parts, self._second.parts
        for source in _suspects(first, second, len(placement.holders)):
            holders = placement.holders[source]
            sent = first[source] if source < len(first) else None
            ok = set(() if sent is None else sent.acked_of(holders))
            for holder in holders:
                settled = second[holder] if holder < len(second) else None
                failed = {} if settled is None else settled.failed
                why = None
                if holder not in ok:
                    why = (None if sent is None else sent.errors.get(holder)) or (
                        f"rank {holder} did not acknowledge it")
                elif source in failed:
                    why = failed[source]
                if why is not None:
                    missing.append((source, holder))
                    reasons.append(str(why))
        lost = {h for s, h in missing if s == self.rank}
        mine = tuple(h for h in placement.holders[self.rank] if h not in lost)
        return Replicas(mine, tuple(missing), tuple(reasons), self.pushed)


def _suspects(first: Runs[CopiesAcked | None], second: Runs[CopiesSettled | None],
              world: int) -> list[int]:
    """The source ranks some copy of which may be missing, ascending: those whose first-vote
    part is not "every holder acknowledged" (or is absent), and those a holder's second-vote
    part names. On the good path there are none, found in O(runs), not O(ranks)."""
    found: set[int] = set(range(len(first), world))
    for start, stop, sent in first.runs():
        if sent is None or sent.acked is not None:
            found.update(range(start, stop))
    for _start, _stop, settled in second.runs():
        if settled is not None:
            found.update(s for s in settled.failed if 0 <= s < world)
    return sorted(found)


def _by_rank(message: Any) -> dict[int, str]:
    """{rank: text} from its msgpack form (rank keys as decimal strings)."""
    if not isinstance(message, dict):
        raise ValueError("not a map of ranks")
    out: dict[int, str] = {}
    for key, value in message.items():
        if not (isinstance(key, str) and key.isdecimal() and isinstance(value, str)):
            raise ValueError("a rank's entry is malformed")
        out[int(key)] = value
    return out
