"""Stage 4, commit: agree with the other ranks, then write the commit record last.

The ranks vote twice. The first vote says whether every rank's shard is durable; the second,
after every rank wrote its commit record, whether the step is complete on every rank (only
then may older steps be pruned for it). The commit participants take part in both: each adds
a typed part to the votes and settles the outcome (``_tiers.base.CommitParticipant``): the
retention metrics (``metrics``, always first), and the tiers the pipeline hands in, replication
(``_tiers.replica.vote``) and the persistent tier (``Promoter``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from .._crash import crash_point
from .._format.documents import CommitRecord, encode_commit
from .._format.names import commit_name
from .._format.publish import PendingFiles
from .._format.timeline import Lineage
from .._threads import in_thread
from .._tiers.base import CommitParticipant, Recorded, Vote
from ..coordination import Coordinator
from ..coordination._agree import Ballot, VotePart, gather_vote
from ..errors import CheckpointError, SaveError
from ..storage import Storage
from .job import SaveJob
from .metrics import RetentionMetrics

__all__ = ("commit",)


async def commit(job: SaveJob, storage: Storage, coordinator: Coordinator, *,
                 limiter: anyio.CapacityLimiter,
                 participants: Sequence[CommitParticipant[Any, Any]] = (),
                 metrics: Sequence[str] = (), lineage: Lineage | None = None,
                 files: PendingFiles | None = None) -> None:
    """Vote with the other ranks; write this rank's commit record if every rank succeeded.

    A job that failed earlier still votes (with its error), so the other ranks learn of it and
    no rank commits. After writing the record the ranks vote again, so that a step counts as
    complete (and older steps may be pruned) only when every rank's record is durable. On any
    failure the caller removes this rank's files of the step, commit record first; the
    participants settle theirs (replication removes the copies this rank holds of the step).
    Shielded from cancellation: once the vote starts, the commit finishes or fails cleanly.
    ``participants``: the tiers' (see the module docstring). ``metrics``: the
    ``TrainState.extra`` keys to record (``RetentionMetrics``); rank 0 checks them before it
    votes. ``lineage``: what the commit records (this rank's and the copies') name as the
    step's parent and timeline, the same on every rank (``_lineage.Timeline``). ``files``:
    the file set the record joins (default ``job.files``; the memory tier's in its root).
    """
    target = job.files if files is None else files
    with anyio.CancelScope(shield=True):
        retention = RetentionMetrics(job, metrics, storage)
        everyone: tuple[CommitParticipant[Any, Any], ...] = (retention, *participants)
        own = None if job.error is None else f"{job.failed_stage}: {job.error.message}"
        refused: CheckpointError | None = None
        parts: dict[str, VotePart | None] = {}
        for participant in everyone:
            try:
                parts[participant.key] = await participant.contribute(job.error is not None)
            except CheckpointError as exc:  # the save fails on every rank, after the vote
                parts[participant.key] = None
                if refused is None:
                    refused, own = exc, f"commit: {exc.message}"
        first = await gather_vote(
            coordinator, job.step, job.save_id, own, what="commit",
            ballots={p.key: Ballot(parts[p.key], p.decode_vote, p.any_step, p.rooted)
                     for p in everyone})
        for participant in everyone:
            await participant.voted(Vote(not first.failures, first.parts[participant.key],
                                         first.roots.get(participant.key, {})))
        if job.error is not None:
            return
        if refused is not None:
            raise refused
        if first.failures:
            raise _failed(job, storage, target, first.failures, "failed this save ({detail}); no rank "
                          "committed it")
        crash_point("commit.voted")
        written: CheckpointError | None = None
        recorded: dict[str, float] = {}
        try:
            recorded = retention.recorded()
            record = encode_commit(CommitRecord(job.step, job.rank, job.world_size,
                                                job.save_id, time.time(), recorded, lineage))
            await in_thread(limiter, target.publish_small, storage, commit_name(job.rank),
                            record)
        except CheckpointError as exc:
            written = exc
        else:
            crash_point("commit.record_published")
        confirms: dict[str, VotePart | None] = {}
        for participant in everyone:
            confirms[participant.key] = await participant.confirm(Recorded(recorded, lineage))
        # Second vote: the step is complete only once every rank's commit record is durable.
        # Until then no rank prunes an older step for it.
        second = await gather_vote(
            coordinator, job.step, job.save_id, None if written is None else written.message,
            what="commit confirm",
            ballots={p.key: Ballot(confirms[p.key], p.decode_confirm) for p in everyone})
        for participant in everyone:
            await participant.confirmed(Vote(written is None and not second.failures,
                                             second.parts[participant.key]))
        if written is not None:
            raise written
        if second.failures:
            raise _failed(job, storage, target, second.failures, "could not write their commit record "
                          "({detail}); the step is not complete on every rank")


def _failed(job: SaveJob, storage: Storage, files: PendingFiles, failures: Mapping[int, str],
            what: str) -> SaveError:
    """The error of a vote that some rank(s) failed: ``what`` says how (``{detail}``: every
    failed rank's error)."""
    detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
    return SaveError(f"rank(s) {sorted(failures)} " + what.format(detail=detail),
                     step=job.step, rank=job.rank,
                     path=os.path.join(storage.root, files.dir_name),
                     hint="the previous checkpoint is intact", ranks=tuple(sorted(failures)))
