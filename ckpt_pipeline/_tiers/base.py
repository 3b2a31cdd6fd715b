"""The typed interfaces every tier implements (replicas, the persistent tier, next the memory
tier): a commit participant takes part in a save's vote and settles its outcome; a shard source
is one place a rank's committed shard can be read back from, in the order recovery and
``cp.load`` try them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import anyio

from .._format.scan import StepStatus
from ..errors import CheckpointError, CheckpointIntegrityError, StorageError

__all__ = ("LocatedShard", "ShardSource", "ShardSources", "SourceFailure", "SourceKind")

_T = TypeVar("_T")

# -- commit participants ---------------------------------------------------------------------

# -- shard sources ---------------------------------------------------------------------------

SourceKind = Literal["own", "copy", "persistent"]
"""Which kind of place a shard was read from: the rank's own files, a copy another rank holds
(in this root, or fetched from its holder), the persistent tier."""


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
