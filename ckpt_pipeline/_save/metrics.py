"""The retention metrics' part in a save's commit (a ``CommitParticipant``).

The values the retention policies rank steps by (``metrics``) are read from rank 0's
``TrainState.extra`` and ride along with rank 0's first vote (``MetricValues``); every rank
writes them into its commit record, so that every rank, now and after a restart, prunes by the
same values. A save whose rank-0 ``extra`` lacks one fails on every rank, before any commit
record is written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._logging import log
from .._tiers.base import Recorded, Vote, VotePart, no_part
from ..errors import SaveError, StateError
from ..retention import metric_value
from ..storage import Storage
from .job import SaveJob

__all__ = ("MetricValues", "RetentionMetrics")


@dataclass(frozen=True, slots=True)
class MetricValues:
    """Rank 0's first-vote part: the value of each metric (None: not finite, never the
    best)."""

    values: Mapping[str, float | None]

    def to_msg(self) -> Any:
        return dict(self.values)

    @classmethod
    def from_msg(cls, message: Any) -> MetricValues:
        """The inverse of ``to_msg``; a ValueError for anything else."""
        if not isinstance(message, dict) or not all(
            isinstance(k, str) and k and (v is None or (type(v) is float and math.isfinite(v)))
            for k, v in message.items()
        ):
            raise ValueError(f"malformed metric values {message!r}")
        return cls(dict(message))


class RetentionMetrics:
    """The retention metrics' participant in the commit of one save: rank 0 sends the values
    of ``names`` from its ``TrainState.extra``; every rank records them
    (``recorded``)."""

    key = "metrics"
    any_step = False
    rooted = False

    def __init__(self, job: SaveJob, names: Sequence[str], storage: Storage) -> None:
        self.job = job
        self.names = tuple(names)
        self.storage = storage
        self._sent: MetricValues | None = None

    def decode_vote(self, message: Any) -> MetricValues:
        return MetricValues.from_msg(message)

    def decode_confirm(self, message: Any) -> VotePart:
        return no_part(message)

    async def contribute(self, failed: bool) -> MetricValues | None:
        """Rank 0: the values (a StateError when one is missing or not a number)."""
        if failed or self.job.rank != 0 or not self.names:
            return None
        return MetricValues(_metric_values(self.job, self.names, self.storage))

    async def voted(self, vote: Vote[MetricValues]) -> None:
        self._sent = vote.parts[0] if vote.parts else None

    def recorded(self) -> dict[str, float]:
        """The values rank 0 sent, checked: what every rank's commit record holds."""
        return _recorded_metrics(self.job, self._sent, self.names, self.storage)

    async def confirm(self, recorded: Recorded) -> None:
        return None

    async def confirmed(self, vote: Vote[VotePart]) -> None:
        return None


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


def _recorded_metrics(job: SaveJob, sent: MetricValues | None, names: Sequence[str],
                      storage: Storage) -> dict[str, float]:
    """The metric values rank 0 sent with its vote (their types checked as they arrived:
    ``MetricValues.from_msg``), each of ``names`` there: what every rank records."""
    values = {} if sent is None else sent.values
    if names and not set(names) <= set(values):
        raise SaveError(f"rank 0 sent malformed or missing metric values {values!r} with its "
                        f"commit vote (expected {list(names)})", step=job.step, rank=job.rank,
                        path=os.path.join(storage.root, job.files.dir_name),
                        hint="run the same version of ckpt_pipeline and the same retention "
                             "policies on every rank; the previous checkpoint is intact",
                        ranks=(0,))
    return {k: v for k, v in values.items() if v is not None}
