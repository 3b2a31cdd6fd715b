"""The persistent tier at restore: its complete steps and rewinds, read within
``LIST_WAIT_S``, and a rank's shard downloaded into its root."""

from __future__ import annotations

import time

from ..._format.timeline import Rewind
from ..._logging import log
from ...storage import Storage
from . import state
from .layout import StepRecord
from .records import complete_steps
from .remote import Remote
from .retries import UNAVAILABLE_HINT, RemoteError
from .rewinds import read_tier_rewinds
from .state import PromoterState
from .stream import ShardStream
from .workers import bounded

__all__ = ("Restoring", "download_rank")


class Restoring(PromoterState):
    """What a restore asks of the persistent tier."""

    def complete_steps(self) -> dict[int, StepRecord]:
        """``complete_steps`` of this rank's persistent tier, within ``LIST_WAIT_S``: a
        RemoteError when the store cannot be reached in that time (the restore then goes on
        with the local tier and the copies); the newest steps read by then when the
        listing takes longer. Runs in a worker thread."""
        deadline = time.monotonic() + state.LIST_WAIT_S
        if not self._connection.reach(state.LIST_WAIT_S):
            raise RemoteError(
                f"the persistent tier {self.url} is unreachable: {self._connection.error}",
                path=self.url, transient=True, hint=UNAVAILABLE_HINT)
        remote = self.remote
        assert remote is not None
        found: list[StepRecord] = []
        try:
            bounded(lambda: complete_steps(remote, rank=self.rank, into=found),
                    max(0.0, deadline - time.monotonic()), f"ckpt-persist-list-r{self.rank}")
        except TimeoutError:
            log.warning("ckpt.recovery.persisted_partial", rank=self.rank, url=self.url,
                        steps=[r.step for r in found], wait_s=state.LIST_WAIT_S,
                        action="the restore considers the newest steps read in time")
        return {r.step: r for r in list(found)}

    def recorded_rewinds(self) -> list[Rewind]:
        """The rewinds the tier records (``timeline.rewinds``), within ``LIST_WAIT_S``: a
        RemoteError when the store is not reachable or does not answer in that time. Runs
        in a worker thread."""
        remote = self.remote
        if remote is None or not self._connection.reachable:
            raise RemoteError(f"the persistent tier {self.url} is unreachable", path=self.url,
                              transient=True, hint=UNAVAILABLE_HINT)
        try:
            return bounded(lambda: read_tier_rewinds(remote), state.LIST_WAIT_S,
                           f"ckpt-persist-rewinds-r{self.rank}")
        except TimeoutError as exc:
            raise RemoteError(f"reading the rewinds of {self.url}: {exc}", path=self.url,
                              transient=True, hint=UNAVAILABLE_HINT) from None

    def stream(self, record: StepRecord) -> ShardStream:
        """This rank's shard of ``record``'s step, downloading into its root while the
        restore reads it (``ShardStream``). Runs in a worker thread."""
        assert self.remote is not None
        return ShardStream(self.remote, self.storage, record, self.rank)


def download_rank(remote: Remote, storage: Storage, record: StepRecord, rank: int
                  ) -> tuple[str, int]:
    """Download ``rank``'s files of ``record``'s step into ``storage``, each part checked
    against the commit object, published as a save publishes them (commit record last).
    Returns (path of the shard, bytes). Runs in a worker thread."""
    stream = ShardStream(remote, storage, record, rank)
    try:
        path, size, _ = stream.publish()
    except BaseException:
        stream.discard()
        raise
    return path, size
