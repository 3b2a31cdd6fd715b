"""Stage 4, commit: agree with the other ranks, then write the commit record last."""

from __future__ import annotations

import os
import time

import anyio

from .._crash import crash_point
from .._format.documents import CommitRecord, encode_commit
from .._format.names import commit_name
from ..coordination import Coordinator
from ..coordination._agree import agree_outcome
from ..errors import CheckpointError, SaveError
from ..storage import Storage
from .job import SaveJob
from .seal import publish_small

__all__ = ("commit",)


async def commit(job: SaveJob, storage: Storage, coordinator: Coordinator, *,
                 limiter: anyio.CapacityLimiter) -> None:
    """Vote with the other ranks; write this rank's commit record if every rank succeeded.

    A job that failed earlier still votes (with its error), so the other ranks learn of it and
    no rank commits. After writing the record the ranks vote again, so that a step counts as
    complete (and older steps may be pruned) only when every rank's record is durable. On any
    failure the caller removes this rank's files of the step, commit record first. Shielded
    from cancellation: once the vote starts, the commit finishes or fails cleanly.
    """
    with anyio.CancelScope(shield=True):
        own = None if job.error is None else f"{job.failed_stage}: {job.error.message}"
        failures, _ = await agree_outcome(coordinator, job.step, job.save_id, own,
                                          what="commit")
        if job.error is not None:
            return
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
        # Second vote: the step is complete only once every rank's commit record is durable.
        # Until then no rank prunes an older step for it.
        failures, _ = await agree_outcome(coordinator, job.step, job.save_id,
                                          None if written is None else written.message,
                                          what="commit confirm")
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
