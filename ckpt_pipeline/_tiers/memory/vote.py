"""The memory tier's part in a memory commit (a ``CommitParticipant``): whether the step is
also written through to disk. Every ``disk_every``-th memory commit is due; each rank says in
its first vote whether its disk is still busy with the previous write-through, and the step is
written through only when no rank's is, so that every rank decides the same, from the vote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..base import Recorded, Vote, VotePart, no_part

__all__ = ("DiskBusy", "WriteThroughVote")


@dataclass(frozen=True, slots=True)
class DiskBusy:
    """A rank's first-vote part: whether a write-through of an earlier step still runs."""

    busy: bool

    def to_msg(self) -> Any:
        return self.busy

    @classmethod
    def from_msg(cls, message: Any) -> DiskBusy:
        if type(message) is not bool:
            raise ValueError(f"malformed disk state {message!r}")
        return cls(message)


class WriteThroughVote:
    """Decides, for one memory commit, whether the step goes to disk too (``decision``:
    "write", "skip" (due, but some rank's disk is busy: the ranks named in ``busy_ranks``),
    or "none" (not due)). ``due``: the step is the ``disk_every``-th; ``busy``: this rank's
    disk still writes an earlier step."""

    key = "memory"
    any_step = False
    rooted = False

    def __init__(self, *, due: bool, busy: bool) -> None:
        self.due = due
        self.busy = busy
        self.decision = "none"
        self.busy_ranks: tuple[int, ...] = ()

    def decode_vote(self, message: Any) -> DiskBusy:
        return DiskBusy.from_msg(message)

    def decode_confirm(self, message: Any) -> VotePart:
        return no_part(message)

    async def contribute(self, failed: bool) -> DiskBusy | None:
        return None if failed else DiskBusy(self.busy)

    async def voted(self, vote: Vote[DiskBusy]) -> None:
        if not vote.agreed or not self.due:
            return
        self.busy_ranks = tuple(vote.parts.indices(lambda part: part is None or part.busy))
        self.decision = "skip" if self.busy_ranks else "write"

    async def confirm(self, recorded: Recorded) -> None:
        return None

    async def confirmed(self, vote: Vote[VotePart]) -> None:
        if not vote.agreed:
            self.decision = "none"
