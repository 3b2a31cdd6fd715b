"""The farthest shard source: a rank's shard of a persisted step, downloading from the
persistent tier while it is read (``ShardStream``, ``stream.py``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from ..._threads import in_thread
from ..base import LocatedShard, SourceKind
from .stream import ShardStream

__all__ = ("TierDownload",)


class TierDownload:
    """The shard ``open_stream`` starts downloading (a ``ShardStream``; a ``ShardSource``).

    With ``keep`` (the restore) the read shard is published into the root as a save publishes
    it, so the step stays in the local tier, and ``landed(shard, path, bytes, seconds)``
    hears of it; without (``cp.load``, into a temporary root) the download is discarded once
    read. ``before`` runs first (the restore moves the rank's own files of the step aside).
    """

    def __init__(self, open_stream: Callable[[], ShardStream], limiter: anyio.CapacityLimiter,
                 *, keep: bool, before: Callable[[], Awaitable[None]] | None = None,
                 landed: Callable[[LocatedShard, str, int, float], None] | None = None
                 ) -> None:
        self.open_stream = open_stream
        self.limiter = limiter
        self.keep = keep
        self.before = before
        self.landed = landed
        self._stream: ShardStream | None = None
        self._shard: LocatedShard | None = None

    @property
    def kind(self) -> SourceKind:
        return "persistent"

    @property
    def action(self) -> str:
        return "downloading it from the persistent tier"

    async def open(self) -> LocatedShard:
        """Start the download; the shard once its preamble and header are in."""
        if self.before is not None:
            await self.before()
        stream = self._stream = await in_thread(self.limiter, self.open_stream)
        try:
            status = await in_thread(self.limiter, stream.status)
        except BaseException:
            await self._discard()
            raise
        self._shard = LocatedShard(status, "persistent", shard_file=stream.shard_file,
                                   arrived=stream.wait)
        return self._shard

    async def close(self, error: BaseException | None) -> None:
        """Publish (``keep``, the read having succeeded) or discard the download."""
        stream, shard = self._stream, self._shard
        assert stream is not None and shard is not None
        if error is not None or not self.keep:
            await self._discard()
            return
        try:
            path, size, seconds = await in_thread(self.limiter, stream.publish)
        except BaseException:
            await self._discard()
            raise
        if self.landed is not None:
            self.landed(shard, path, size, seconds)

    async def _discard(self) -> None:
        stream = self._stream
        if stream is not None:
            with anyio.CancelScope(shield=True):
                await in_thread(self.limiter, stream.discard)
