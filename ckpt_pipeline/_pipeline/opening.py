"""The open sequence of a pipeline, and the persistent tier's part of a clean close.

``OpenSequence.run`` checks the root, takes the root lock, scrubs what crashed saves left,
opens the persistent tier, agrees on the run id and the timeline with the other ranks, and
tells the ledger where the run resumes; undone (tier closed, lock released) if any of it
fails. ``persist_at_close`` is what the persistent tier does after the stages have drained.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from .._format.steps import committed_steps
from .._format.tidy import scrub
from .._lineage import Timeline, local_timeline, read_rewinds
from .._logging import log
from .._threads import in_thread
from .._tiers.persistent.promote import Promoter
from .._tiers.replica.replication import Replication
from ..coordination import Coordinator
from ..coordination._agree import agree_open, gather_parts, gather_shared
from ..errors import CheckpointError, PersistentInUseError
from ..events import Event, TemporariesScrubbed
from ..storage import Storage
from .admission import Admission
from .ledger import Ledger
from .rootlock import RootLock

__all__ = ("OpenSequence", "persist_at_close")


@dataclass(frozen=True, slots=True)
class OpenSequence:
    """What opening a pipeline touches; ``run`` opens it (see the module docstring)."""

    storage: Storage
    coordinator: Coordinator
    limiter: anyio.CapacityLimiter
    emit: Callable[[Event], None]
    admission: Admission
    ledger: Ledger
    replication: Replication
    promoter: Promoter | None
    timeline: Timeline

    @property
    def rank(self) -> int:
        return self.coordinator.rank

    async def run(self) -> RootLock:
        """Check the root, take the root lock, scrub, agree on the run id; return the lock."""
        await in_thread(self.limiter, self.storage.ensure_root)
        # One job per root and rank: a second live opener is refused (RootInUseError).
        lock = await in_thread(self.limiter, RootLock.acquire, self.storage.root, self.rank)
        try:
            for path, size in await in_thread(self.limiter, scrub, self.storage,
                                              self.rank):
                self.emit(TemporariesScrubbed(step=-1, rank=self.rank, path=path, bytes=size))
            # After the scrub: the agreement is also a barrier, so that no rank's first save
            # can create a step directory that another rank's scrub (of a shared root) removes.
            # It also tells every rank where the others' copy servers are (replication).
            if self.promoter is not None:
                await self._open_persistent(self.promoter)
            # The run id (rank 0's), the replication token and every rank's node and copy
            # server, agreed in one exchange.
            opening = await agree_open(self.coordinator, self.replication.node,
                                       await self.replication.serve(self.limiter))
            self.replication.start(opening)
            self.admission.run_id = opening.run_id
            await self._open_timeline()
            committed = await in_thread(self.limiter, committed_steps, self.storage,
                                        self.rank)
            self.ledger.resume_at(max(committed, default=None))
        except BaseException:
            if self.promoter is not None:
                self.promoter.close()  # its heartbeat stops: the URL is not held any more
            self.replication.close()
            lock.release()
            raise
        return lock

    async def _open_persistent(self, promoter: Promoter) -> None:
        """Open the persistent tier on every rank (rank 0 takes the URL: its owner object).
        A refusal (``PersistentInUseError``) is raised on every rank, so that none waits for
        rank 0 in the next agreement."""
        refused: PersistentInUseError | None = None
        try:
            await in_thread(self.limiter, promoter.open)
        except PersistentInUseError as exc:
            refused = exc
        answers = await gather_shared(self.coordinator,
                                      None if refused is None else refused.message,
                                      what="persistent owner")
        if refused is not None:
            raise refused
        if answers and isinstance(answers[0], str):
            raise PersistentInUseError(answers[0], rank=self.rank,
                                       hint="rank 0 was refused the persistent URL; see its "
                                            "error")

    async def _open_timeline(self) -> None:
        """Agree on the timeline the commits carry until a restore (the newest any rank's
        records name); rank 0 records in the persistent tier any rewind its root records
        that the tier lacks (one left pending by an outage)."""
        rewinds = await in_thread(self.limiter, read_rewinds, self.storage)
        mine = await in_thread(self.limiter, local_timeline, self.storage, self.rank)
        answers = await gather_shared(self.coordinator, mine, what="open timeline")
        self.timeline.timeline = max((a for a in answers.distinct() if type(a) is int),
                                     default=0)
        if self.promoter is not None and rewinds:
            await in_thread(self.limiter, self.promoter.rewound, rewinds)


async def persist_at_close(promoter: Promoter, coordinator: Coordinator,
                           timeout: float) -> None:
    """After a clean close: promote the newest committed step (``on_close``), wait for the
    uploads, let every rank report, so that rank 0 commits what every rank finished, and wait
    for those commit objects: all of it within ``timeout`` (the group's ``timeout_s``; and the
    exchange's ``coordination_timeout_s``). What did not end by then is never committed, and
    is reported by ``Promoter.close``. Failures are logged: the local tier holds every
    committed step whatever happens here."""
    rank = coordinator.rank
    promoter.closing()
    try:
        deadline = anyio.current_time() + timeout
        finished = await in_thread(None, promoter.wait, timeout, abandon_on_cancel=True)
        reports, uploads = await gather_parts(coordinator, promoter.key, promoter.ballot(),
                                              what="persist at close")
        promoter.on_reports(reports, uploads)
        left = max(0.0, deadline - anyio.current_time())
        finished = await in_thread(None, functools.partial(promoter.wait, left, uploads=False),
                                   abandon_on_cancel=True) and finished
        if not finished:
            log.warning("ckpt.persist.close_timeout", rank=rank, url=promoter.url,
                        timeout_s=timeout)
        if finished:  # a commit object still in flight keeps the URL held: no release
            await in_thread(None, promoter.release, abandon_on_cancel=True)
    except CheckpointError as exc:
        log.error("ckpt.persist.close_failed", rank=rank, url=promoter.url, error=exc.message)
