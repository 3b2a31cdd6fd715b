"""ShardSources: the places a rank's shard is read from, tried in order, the first that reads
wins; integrity and storage errors go on to the next place, any other error ends the read."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from ckpt_pipeline._format.scan import StepStatus
from ckpt_pipeline._tiers.base import (
    LocatedShard,
    ShardSource,
    ShardSources,
    SourceFailure,
    SourceKind,
)
from ckpt_pipeline.errors import (
    CheckpointError,
    CheckpointIntegrityError,
    StateError,
    StorageError,
)


class _Place:
    """A source that has the shard unless ``missing`` is set; records how it was closed."""

    def __init__(self, kind: SourceKind, log: list[str], *,
                 missing: CheckpointError | None = None) -> None:
        self._kind = kind
        self.log = log
        self.missing = missing

    @property
    def kind(self) -> SourceKind:
        return self._kind

    @property
    def action(self) -> str:
        return f"trying {self._kind}"

    async def open(self) -> LocatedShard:
        self.log.append(f"open {self._kind}")
        if self.missing is not None:
            raise self.missing
        status = StepStatus(step=5, dir_name="step-5", path=f"/{self._kind}", complete=True,
                            valid=True, reason=None)
        return LocatedShard(status, self._kind)

    async def close(self, error: BaseException | None) -> None:
        self.log.append(f"close {self._kind} {'undo' if error else 'keep'}")


def _read(sources: ShardSources, bad: set[str], error: type[CheckpointError]
          ) -> tuple[str, LocatedShard]:
    async def reader(shard: LocatedShard) -> str:
        if shard.kind in bad:
            raise error(f"{shard.kind} does not verify")
        return shard.status.path

    async def main() -> tuple[str, LocatedShard]:
        return await sources.read(reader)

    return anyio.run(main)


def test_the_first_place_that_reads_wins_and_later_ones_are_not_tried() -> None:
    log: list[str] = []
    places = (_Place("own", log), _Place("copy", log))
    value, shard = _read(ShardSources(places), set(), CheckpointIntegrityError)
    assert (value, shard.kind) == ("/own", "own")
    assert log == ["open own", "close own keep"]


@pytest.mark.parametrize("error", [CheckpointIntegrityError, StorageError])
def test_a_shard_that_does_not_read_falls_back_to_the_next_place(
        error: type[CheckpointError]) -> None:
    log: list[str] = []
    heard: list[tuple[str, bool, str | None]] = []
    places: tuple[ShardSource, ...] = (
        _Place("own", log), _Place("copy", log, missing=CheckpointIntegrityError("gone")),
        _Place("persistent", log))

    def failed(failure: SourceFailure, following: ShardSource | None) -> None:
        heard.append((failure.source.kind, failure.read,
                      None if following is None else following.action))

    value, _ = _read(ShardSources(places, failed=failed), {"own"}, error)
    assert value == "/persistent"
    assert log == ["open own", "close own undo", "open copy", "open persistent",
                   "close persistent keep"]
    assert heard == [("own", True, "trying copy"), ("copy", False, "trying persistent")]


def test_the_last_places_error_is_raised_as_it_was_by_default() -> None:
    gone = CheckpointIntegrityError("the copy is gone")
    places = (_Place("own", []), _Place("copy", [], missing=gone))
    with pytest.raises(CheckpointIntegrityError) as raised:
        _read(ShardSources(places), {"own"}, CheckpointIntegrityError)
    assert raised.value is gone


def test_exhausted_builds_the_error_from_every_place_tried() -> None:
    def exhausted(failures: Sequence[SourceFailure]) -> CheckpointError:
        return CheckpointIntegrityError("; ".join(f.error.message for f in failures))

    places = (_Place("own", []), _Place("copy", []))
    with pytest.raises(CheckpointIntegrityError,
                       match=r"^own does not verify; copy does not verify"):
        _read(ShardSources(places, exhausted=exhausted), {"own", "copy"},
              CheckpointIntegrityError)


def test_another_error_ends_the_read_without_trying_the_next_place() -> None:
    log: list[str] = []
    heard: list[ShardSource | None] = []
    places = (_Place("own", log), _Place("copy", log))
    with pytest.raises(StateError, match="own does not verify"):
        _read(ShardSources(places, failed=lambda f, following: heard.append(following)),
              {"own"}, StateError)
    assert log == ["open own", "close own undo"]
    assert heard == [None]
