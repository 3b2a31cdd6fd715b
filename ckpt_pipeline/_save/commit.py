"""Stage 4, commit: agree with the other ranks, then write the commit record last.

With replication (``replicas``), the first vote also carries which holders acknowledged a
durable copy of each rank's shard. The step commits when every rank's own shard is durable;
each holder then writes the commit record of the copies it acknowledged (and removes any other
copy of the step), and the second vote carries the copies that could not be committed. Every
rank thus ends with the same list of missing copies (``Replicas``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from .._crash import crash_point
from .._format.documents import CommitRecord, encode_commit
from .._format.names import commit_name
from .._replicate.push import PushOutcome
from .._replicate.replication import Replication
from .._threads import in_thread
from ..coordination import Coordinator
from ..coordination._agree import gather_outcome
from ..errors import CheckpointError, SaveError
from ..storage import Storage
from .job import SaveJob
from .seal import publish_small

if TYPE_CHECKING:
    from .._persist.promote import Promoter

__all__ = ("Replicas", "commit")


@dataclass(frozen=True, slots=True)
class Replicas:
    """The copies of a committed step (empty without replication)."""

    holders: tuple[int, ...] = ()
    """Holders of a durable copy of this rank's shard."""
    missing: tuple[tuple[int, int], ...] = ()
    """(source, holder) of every copy of the step that is not durable, on every rank."""
    reasons: tuple[str, ...] = ()
    pushed: PushOutcome | None = None


async def commit(job: SaveJob, storage: Storage, coordinator: Coordinator, *,
                 limiter: anyio.CapacityLimiter,
                 replication: Replication | None = None,
                 promoter: Promoter | None = None) -> Replicas:
    """Vote with the other ranks; write this rank's commit record if every rank succeeded.

    A job that failed earlier still votes (with its error), so the other ranks learn of it and
    no rank commits. The first vote also carries the persistent tier's reports
    (``promoter``). After writing the record the ranks vote again, so that a step counts as
    complete (and older steps may be pruned) only when every rank's record is durable. On any
    failure the caller removes this rank's files of the step, commit record first; the copies
    this rank holds of the step are removed here. Shielded from cancellation: once the vote
    starts, the commit finishes or fails cleanly.
    """
    with anyio.CancelScope(shield=True):
        own = None if job.error is None else f"{job.failed_stage}: {job.error.message}"
        pushed: PushOutcome | None = None
        if job.push is not None:
            if job.error is None:
                pushed = await in_thread(limiter, job.push.collect)
            else:
                job.push.abort(f"the save failed on rank {job.rank}")
        sent = None if pushed is None else {
            "acked": list(pushed.acked),
            "errors": {str(h): e for h, e in pushed.errors.items()}}
        reports: list[Any] = []
        failures, _, first = await gather_outcome(
            coordinator, job.step, job.save_id, own, what="commit", extra=sent,
            shared=None if promoter is None else promoter.report(), shared_out=reports)
        if promoter is not None:
            promoter.on_reports(reports)
        if (job.error is not None or failures) and replication is not None:
            await in_thread(limiter, replication.settle, job.step, job.save_id, ())
            replication.forget(job.step, job.save_id)
        if job.error is not None:
            return Replicas()
        if failures:
            detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
            error = SaveError(f"rank(s) {sorted(failures)} failed this save ({detail}); no "
                              "rank committed it", step=job.step, rank=job.rank,
                              path=os.path.join(storage.root, job.files.dir_name),
                              hint="the previous checkpoint is intact",
                              ranks=tuple(sorted(failures)))
            raise error
        crash_point("commit.voted")
        record = encode_commit(CommitRecord(job.step, job.rank, job.world_size, job.save_id,
                                            time.time()))
        written: CheckpointError | None = None
        try:
            await publish_small(job, storage, commit_name(job.rank), record, limiter=limiter)
        except CheckpointError as exc:
            written = exc
        else:
            crash_point("commit.record_published")
        copy_failed: dict[int, str] = {}
        if replication is not None and replication.placement is not None:
            commit_sources = [source for source, extra in enumerate(first)
                              if isinstance(extra, dict)
                              and job.rank in (extra.get("acked") or ())]
            copy_failed = await in_thread(limiter, replication.settle, job.step, job.save_id,
                                          commit_sources)
        # Second vote: the step is complete only once every rank's commit record is durable.
        # Until then no rank prunes an older step for it.
        failures, _, second = await gather_outcome(
            coordinator, job.step, job.save_id, None if written is None else written.message,
            what="commit confirm", extra={str(s): e for s, e in copy_failed.items()})
        if written is not None or failures:
            if replication is not None:
                await in_thread(limiter, replication.drop, job.step, job.save_id)
        elif replication is not None:
            replication.forget(job.step, job.save_id)
        if written is not None:
            raise written
        if failures:
            detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
            error = SaveError(f"rank(s) {sorted(failures)} could not write their commit "
                              f"record ({detail}); the step is not complete on every rank",
                              step=job.step, rank=job.rank,
                              path=os.path.join(storage.root, job.files.dir_name),
                              hint="the previous checkpoint is intact",
                              ranks=tuple(sorted(failures)))
            raise error
        if replication is None:
            return Replicas()
        missing, reasons, holders = replication.missing(first, second)
        return Replicas(holders, missing, reasons, pushed)
    return Replicas()  # not reached: the shielded scope above is never cancelled itself
