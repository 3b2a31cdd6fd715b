"""The typed interfaces every tier implements (replicas, the persistent tier, next the memory
tier): a commit participant takes part in a save's vote and settles its outcome; a shard source
is one place a rank's committed shard can be read back from, in the order recovery and
``cp.load`` try them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from .._format.timeline import Lineage
from ..coordination._agree import VotePart

__all__ = ("CommitParticipant", "Recorded", "Vote", "VotePart", "no_part")

# -- commit participants ---------------------------------------------------------------------

P = TypeVar("P", bound=VotePart)
V = TypeVar("V", bound=VotePart)
C = TypeVar("C", bound=VotePart)


@dataclass(frozen=True, slots=True)
class Vote(Generic[P]):
    """One vote of a save as a participant sees it: whether it carries (every rank voted for
    this save, without an error) and every rank's part of this participant, by rank (None:
    the rank sent none, or voted on another save)."""

    agreed: bool
    parts: tuple[P | None, ...]


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the step's commit records name, the same on every rank: the retention metrics
    and the lineage (the copies' commit records carry them too)."""

    metrics: Mapping[str, float]
    lineage: Lineage | None


class CommitParticipant(Protocol[V, C]):
    """Something that takes part in a save's commit: a tier, or the retention metrics.

    It contributes a typed, frozen part (``VotePart``) to the commit vote and settles the
    outcome; ``commit`` calls every participant, on every rank, in the same order:

    1. ``contribute(failed)`` before the first vote: this rank's part (None: nothing to say;
       ``failed``: the save failed on this rank before commit). A CheckpointError raised here
       fails the save on every rank (its message is this rank's vote); it is raised after the
       vote.
    2. ``voted(vote)`` with every rank's part (read back by ``decode_vote``). When not
       ``vote.agreed`` nothing is committed and this is the last call.
    3. ``confirm(recorded)`` once this rank wrote its commit record, or failed to: its part
       of the second vote (read back by ``decode_confirm``).
    4. ``confirmed(vote)``: ``vote.agreed`` when every rank's commit record is durable (the
       step is complete on every rank); not, when it is not committed on every rank.

    ``key`` names the participant's parts in the votes (unique among participants);
    ``any_step``: its first-vote part counts from a rank that votes on another save too.
    """

    @property
    def key(self) -> str:
        """The name of this participant's parts in the votes."""
        ...

    @property
    def any_step(self) -> bool:
        """Whether its first-vote part counts from a rank voting on another save."""
        ...

    def decode_vote(self, message: Any) -> V:
        """A rank's first-vote part; ValueError or CheckpointError when malformed."""
        ...

    def decode_confirm(self, message: Any) -> C:
        """A rank's second-vote part; ValueError or CheckpointError when malformed."""
        ...

    async def contribute(self, failed: bool) -> V | None:
        """This rank's part of the first vote."""
        ...

    async def voted(self, vote: Vote[V]) -> None:
        """Every rank's part of the first vote, and whether it carries."""
        ...

    async def confirm(self, recorded: Recorded) -> C | None:
        """This rank's part of the second vote, once its commit record is written (or not)."""
        ...

    async def confirmed(self, vote: Vote[C]) -> None:
        """Every rank's part of the second vote: whether the step is complete everywhere."""
        ...


def no_part(message: Any) -> VotePart:
    """The decoder of a participant that sends no part in a vote: any part is malformed."""
    raise ValueError(f"a part was sent where none is expected ({type(message).__name__})")

# -- shard sources ---------------------------------------------------------------------------
