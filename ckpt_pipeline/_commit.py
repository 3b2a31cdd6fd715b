"""Stage 4, commit: agree with the other ranks, then write the commit record last."""

from __future__ import annotations

import time

import anyio

from ._format import CommitRecord, commit_name, encode_commit
from ._job import SaveJob
from ._write import publish_small
from .coordination import Coordinator
from .errors import SaveError
from .storage import Storage

__all__ = ("commit",)


async def commit(job: SaveJob, storage: Storage, coordinator: Coordinator, *,
                 limiter: anyio.CapacityLimiter) -> None:
    """Write this rank's commit record if every rank's shard is durable; raise otherwise.

    Shielded from cancellation: once agreement starts, the commit finishes or fails cleanly.
    """
    with anyio.CancelScope(shield=True):
        failures = await coordinator.agree_commit(job.step, job.save_id, None)
        if failures:
            detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
            raise SaveError(f"ranks {sorted(failures)} failed this save ({detail}); "
                            "nothing was committed", step=job.step, rank=job.rank,
                            path=job.dir_name, hint="the previous checkpoint is intact")
        record = encode_commit(CommitRecord(job.step, job.rank, job.world_size, job.save_id,
                                            time.time()))
        await publish_small(job, storage, commit_name(job.rank), record, limiter=limiter)
