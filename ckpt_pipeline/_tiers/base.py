"""The typed interfaces every tier implements (replicas, the persistent tier, next the memory
tier): a commit participant takes part in a save's vote and settles its outcome; a shard source
is one place a rank's committed shard can be read back from, in the order recovery and
``cp.load`` try them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

import anyio

from .._format.scan import StepStatus
from .._format.timeline import Lineage
from ..coordination._agree import VotePart
from ..coordination._runs import Runs
from ..errors import CheckpointError, CheckpointIntegrityError, StorageError
from ..storage import Storage

__all__ = ("CommitParticipant", "LocatedShard", "Recorded", "ShardSource", "ShardSources",
           "SourceFailure", "SourceKind", "Vote", "VotePart", "no_part")

_T = TypeVar("_T")

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
    parts: Runs[P | None]
    """By rank, as runs of equal parts (``Runs``: ``parts[rank]``, or ``runs()`` to read a
    vote in O(runs) rather than O(ranks))."""
    roots: Mapping[int, bytes] = field(default_factory=dict)
    """A ``rooted`` participant's first vote, on rank 0: each rank's piece for rank 0 by
    rank, as it travelled (``coordination._agree.read_piece`` reads one); empty elsewhere."""


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
    ``any_step``: its first-vote part counts from a rank that votes on another save too;
    ``rooted``: its first-vote part is a ``RootedPart`` whose piece for rank 0 travels to
    rank 0 alone (``Vote.roots``).
    """

    @property
    def key(self) -> str:
        """The name of this participant's parts in the votes."""
        ...

    @property
    def any_step(self) -> bool:
        """Whether its first-vote part counts from a rank voting on another save."""
        ...

    @property
    def rooted(self) -> bool:
        """Whether its first-vote part has a piece for rank 0 alone."""
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

SourceKind = Literal["memory", "own", "copy", "persistent"]
"""Which kind of place a shard was read from: the memory tier, the rank's own files, a copy
another rank holds (in this root, or fetched from its holder), the persistent tier."""


@dataclass(frozen=True, slots=True)
class LocatedShard:
    """A rank's shard of a step where a source has it, ready to read: the files ``status``
    validated in the source's storage. ``holder``: the rank whose copy it is (kind "copy").
    A shard still arriving (a download) names its temporary ``shard_file`` and ``arrived``,
    which blocks until bytes [start, end) of it are there."""

    status: StepStatus
    kind: SourceKind
    holder: int | None = None
    shard_file: str | None = None
    arrived: Callable[[int, int], None] | None = None
    storage: Storage | None = None
    """Where the shard's files are, when not the root's storage (the memory tier's)."""


class ShardSource(Protocol):
    """One place a rank's committed shard of a step can be read from.

    Call order: ``open`` once; when it returns, the caller reads (and verifies) the shard it
    located, then calls ``close`` once, with the read's error or None. ``open`` raises a
    CheckpointError when the place does not have the shard (nothing is left behind then);
    ``close(None)`` makes the shard's arrival final where the source keeps it (a download is
    published) and raises when that fails, having undone it; ``close(error)`` undoes what
    ``open`` did. A CheckpointIntegrityError or StorageError of either means: try the next
    place (``ShardSources``); any other error ends the read.
    """

    @property
    def kind(self) -> SourceKind:
        """Which kind of place this is."""
        ...

    @property
    def action(self) -> str:
        """What trying this place is called in the log line of the place before it failing
        ("fetching a copy from rank(s) [1]")."""
        ...

    async def open(self) -> LocatedShard:
        """Locate the shard (fetching or downloading it where this place must)."""
        ...

    async def close(self, error: BaseException | None) -> None:
        """Keep (``error`` None) or undo what ``open`` did; see the class docstring."""
        ...


@dataclass(frozen=True, slots=True)
class SourceFailure:
    """A place that did not give the shard: its error, and whether the shard was located
    there (``read``: then the read of it failed, else ``open`` did)."""

    source: ShardSource
    error: CheckpointError
    read: bool


def _last_failure(failures: Sequence[SourceFailure]) -> CheckpointError:
    return failures[-1].error


@dataclass(frozen=True, slots=True)
class ShardSources:
    """The places a rank's shard of a step is read from, nearest first (own root, copies,
    the persistent tier): each is tried in turn until one gives a shard that reads and
    verifies. The one fallback order of both the restore and ``cp.load``.

    ``failed(failure, next)`` hears of each place that failed with a CheckpointError,
    ``next`` the place tried after it (None when none is). ``exhausted`` builds the error
    raised when every place failed (by default the last place's error, as it was; a caller
    with no place at all says why itself).
    """

    sources: tuple[ShardSource, ...]
    failed: Callable[[SourceFailure, ShardSource | None], None] = lambda failure, next_: None
    exhausted: Callable[[Sequence[SourceFailure]], CheckpointError] = _last_failure

    async def read(self, reader: Callable[[LocatedShard], Awaitable[_T]]
                   ) -> tuple[_T, LocatedShard]:
        """``reader``'s result on the first place whose shard it reads, and that shard."""
        failures: list[SourceFailure] = []
        for index, source in enumerate(self.sources):
            located: LocatedShard | None = None
            try:
                located = await source.open()
                try:
                    value = await reader(located)
                except BaseException as exc:
                    with anyio.CancelScope(shield=True):
                        await source.close(exc)
                    raise
                await source.close(None)
                return value, located
            except CheckpointError as exc:
                failure = SourceFailure(source, exc, read=located is not None)
                passes_on = isinstance(exc, (CheckpointIntegrityError, StorageError))
                following = self.sources[index + 1] if passes_on and index + 1 < len(
                    self.sources) else None
                self.failed(failure, following)
                if not passes_on:
                    raise
                failures.append(failure)
        raise self.exhausted(failures)
