"""Stage 4, commit: agree with the other ranks, then write the commit record last.

With replication (``replicas``), the first vote also carries which holders acknowledged a
durable copy of each rank's shard. The step commits when every rank's own shard is durable;
each holder then writes the commit record of the copies it acknowledged (and removes any other
copy of the step), and the second vote carries the copies that could not be committed. Every
rank thus ends with the same list of missing copies (``Replicas``).

The values the retention policies rank steps by (``metrics``) are read from rank 0's
``TrainState.extra`` and ride along with rank 0's first vote; every rank writes them into its
commit record, so that every rank, now and after a restart, prunes by the same values. A save
whose rank-0 ``extra`` lacks one fails on every rank, before any commit record is written.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from .._crash import crash_point
from .._format.documents import CommitRecord, encode_commit
from .._format.names import commit_name
from .._format.timeline import Lineage
from .._logging import log
from .._threads import in_thread
from .._tiers.replica.push import PushOutcome
from .._tiers.replica.replication import Replication
from ..coordination import Coordinator
from ..coordination._agree import gather_outcome
from ..errors import CheckpointError, SaveError, StateError
from ..retention import metric_value
from ..storage import Storage
from .job import SaveJob
from .seal import publish_small

if TYPE_CHECKING:
    from .._tiers.persistent.promote import Promoter

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
                 promoter: Promoter | None = None,
                 metrics: Sequence[str] = (), lineage: Lineage | None = None) -> Replicas:
    """Vote with the other ranks; write this rank's commit record if every rank succeeded.

    A job that failed earlier still votes (with its error), so the other ranks learn of it and
    no rank commits. The first vote also carries the persistent tier's reports
    (``promoter``). After writing the record the ranks vote again, so that a step counts as
    complete (and older steps may be pruned) only when every rank's record is durable. On any
    failure the caller removes this rank's files of the step, commit record first; the copies
    this rank holds of the step are removed here. Shielded from cancellation: once the vote
    starts, the commit finishes or fails cleanly. ``metrics``: the ``TrainState.extra``
    keys to record (see the module docstring); rank 0 checks them before it votes.
    ``lineage``: what the commit records (this rank's and the copies') name as the step's
    parent and timeline, the same on every rank (``_lineage.Timeline``).
    """
    with anyio.CancelScope(shield=True):
        own = None if job.error is None else f"{job.failed_stage}: {job.error.message}"
        values: dict[str, float | None] | None = None
        bad_metric: StateError | None = None
        if job.error is None and job.rank == 0 and metrics:
            try:
                values = _metric_values(job, metrics, storage)
            except StateError as exc:
                bad_metric = exc
                own = f"commit: {exc.message}"
        pushed: PushOutcome | None = None
        if job.push is not None:
            if job.error is None:
                pushed = await in_thread(limiter, job.push.collect)
            else:
                job.push.abort(f"the save failed on rank {job.rank}")
        sent: dict[str, Any] | None = None if pushed is None else {
            "acked": list(pushed.acked),
            "errors": {str(h): e for h, e in pushed.errors.items()}}
        if values is not None:
            sent = {**(sent or {}), "metrics": values}
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
        if bad_metric is not None:
            raise bad_metric
        if failures:
            detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
            error = SaveError(f"rank(s) {sorted(failures)} failed this save ({detail}); no "
                              "rank committed it", step=job.step, rank=job.rank,
                              path=os.path.join(storage.root, job.files.dir_name),
                              hint="the previous checkpoint is intact",
                              ranks=tuple(sorted(failures)))
            raise error
        crash_point("commit.voted")
        written: CheckpointError | None = None
        recorded: dict[str, float] = {}
        try:
            recorded = _recorded_metrics(job, first[0], metrics, storage)
            record = encode_commit(CommitRecord(job.step, job.rank, job.world_size,
                                                job.save_id, time.time(), recorded, lineage))
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
                                          commit_sources, recorded, lineage)
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


def _metric_values(job: SaveJob, names: Sequence[str], storage: Storage
                   ) -> dict[str, float | None]:
    """The values of ``names`` in this rank's TrainState.extra (rank 0's decide). A NaN or
    infinite float (a diverging loss) is sent as None: the step commits, without a value for
    that metric, so it is never among the best (logged as ``ckpt.retention.metric_not_finite``)."""
    extra = job.train_state.get("extra")
    extra = extra if isinstance(extra, Mapping) else {}
    out: dict[str, float | None] = {}
    path = os.path.join(storage.root, job.files.dir_name)
    for name in names:
        if name not in extra:
            raise StateError(
                f"the retention policy ranks steps by {name!r}, but rank 0's "
                f"TrainState.extra at step {job.step} has no {name!r} (its keys: "
                f"{sorted(map(str, extra))}); the save is not committed", step=job.step,
                rank=job.rank, path=path,
                hint=f"pass it with every save, e.g. TrainState(step=..., extra={{{name!r}: "
                     "value}), or drop the KeepBest policy that names it; the previous "
                     "checkpoint is intact")
        value = extra[name]
        number = metric_value(value)
        if number is None and type(value) is float:  # NaN or inf: saved, never the best
            log.warning("ckpt.retention.metric_not_finite", step=job.step, rank=job.rank,
                        metric=name, value=repr(value), path=path)
            out[name] = None
            continue
        if number is None:
            raise StateError(
                f"the retention policy ranks steps by {name!r}, but rank 0's "
                f"TrainState.extra[{name!r}] at step {job.step} is {value!r}, not an int or "
                "float; the save is not committed", step=job.step, rank=job.rank,
                path=path,
                hint="pass a real number (a Python float, e.g. loss.item()); the previous "
                     "checkpoint is intact")
        out[name] = number
    return out


def _recorded_metrics(job: SaveJob, sent: Any, names: Sequence[str],
                      storage: Storage) -> dict[str, float]:
    """The metric values rank 0 sent with its vote, checked: what every rank records."""
    values = sent.get("metrics", {}) if isinstance(sent, Mapping) else {}
    if not isinstance(values, Mapping) or not all(
        isinstance(k, str) and k and (v is None or (type(v) is float and math.isfinite(v)))
        for k, v in values.items()
    ) or (names and not set(names) <= set(values)):
        raise SaveError(f"rank 0 sent malformed or missing metric values {values!r} with its "
                        f"commit vote (expected {list(names)})", step=job.step, rank=job.rank,
                        path=os.path.join(storage.root, job.files.dir_name),
                        hint="run the same version of ckpt_pipeline and the same retention "
                             "policies on every rank; the previous checkpoint is intact",
                        ranks=(0,))
    return {k: v for k, v in values.items() if v is not None}
