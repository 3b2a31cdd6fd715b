"""A shard source of the restore: this rank's shard fetched from a rank that holds a copy of it
(``fetch.py``), into this rank's root under its own names, holders tried in rank order."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from ..._format.filesets import FileSet
from ..._format.names import step_dir_name
from ..._format.scan import scan_files
from ..._logging import log
from ..._threads import in_thread
from ...errors import CheckpointError, CheckpointIntegrityError
from ...storage import Storage
from ..base import LocatedShard, SourceKind

__all__ = ("Fetch", "FetchedCopy")

Fetch = Callable[[int, int, str], tuple[int, float]]
"""``fetch(holder, step, save_id) -> (bytes, seconds)``: ``Replication.fetch`` (worker
thread)."""


class FetchedCopy:
    """This rank's shard of ``step`` (of save ``save_id``) from the first of ``holders`` whose
    copy arrives and checks out (a ``ShardSource``).

    ``fetch`` is None when this pipeline cannot fetch (no replication): ``open`` then fails.
    ``before`` runs once before the first fetch (the restore moves the rank's own files of the
    step aside); ``landed(shard, bytes, seconds)`` hears of the copy published in the root. A
    published copy stays there whatever its read finds (the next source moves it aside).
    """

    def __init__(self, storage: Storage, rank: int, step: int, save_id: str,
                 holders: tuple[int, ...], fetch: Fetch | None,
                 limiter: anyio.CapacityLimiter, *, before: Callable[[], Awaitable[None]],
                 landed: Callable[[LocatedShard, int, float], None]) -> None:
        self.storage = storage
        self.rank = rank
        self.step = step
        self.save_id = save_id
        self.holders = holders
        self.fetch = fetch
        self.limiter = limiter
        self.before = before
        self.landed = landed

    @property
    def kind(self) -> SourceKind:
        return "copy"

    @property
    def action(self) -> str:
        return f"fetching a copy from rank(s) {list(self.holders)}"

    async def open(self) -> LocatedShard:
        """Fetch the copy into this rank's root; CheckpointIntegrityError naming every
        holder's failure when none checks out."""
        step, fetch = self.step, self.fetch
        if fetch is None:
            raise CheckpointIntegrityError("copies exist but this pipeline cannot fetch them",
                                           step=step, rank=self.rank)
        dir_name = step_dir_name(step)
        await self.before()
        errors: list[str] = []
        for holder in self.holders:
            try:
                size, seconds = await in_thread(self.limiter, fetch, holder, step,
                                                self.save_id)
            except CheckpointError as exc:
                errors.append(exc.message)
                log.warning("ckpt.recovery.fetch_failed", step=step, rank=self.rank,
                            peer=holder, error=exc.message)
                continue
            status = await in_thread(self.limiter, scan_files, self.storage,
                                     FileSet(self.rank), step, dir_name)
            if not status.valid:
                errors.append(f"the copy from rank {holder}: {status.reason}")
                continue
            shard = LocatedShard(status, "copy", holder=holder)
            self.landed(shard, size, seconds)
            return shard
        raise CheckpointIntegrityError(
            f"no copy of this rank's shard could be fetched ({'; '.join(errors)})",
            step=step, rank=self.rank, path=str(self.storage.root))

    async def close(self, error: BaseException | None) -> None:
        return None
