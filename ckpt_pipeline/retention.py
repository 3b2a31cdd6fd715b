"""Retention policies: which committed steps the retain stage keeps.

A policy is any object with ``keep(steps)`` (``RetentionPolicy``). A policy that ranks steps
by a training metric is a ``MetricPolicy`` as well: it names the ``TrainState.extra`` values
it needs in ``metrics``, and decides in ``keep_infos(infos)`` from each step's recorded values.

Call order: after every commit, the retain stage of each rank lists that rank's committed
steps (by the step recorded in each commit record), newest first, and calls the policy once:
``keep_infos`` with a ``StepInfo`` per step when the policy is a ``MetricPolicy``, else
``keep`` with the steps. It removes the others, except that the newest complete step (the one
just committed on every rank) and anything newer are never removed, whatever the policy says.
Both methods must be pure functions of their argument, so that every rank keeps the same steps.

Where the metrics come from: at each save, the values named by the configured policies'
``metrics`` are read from **rank 0's** ``TrainState.extra`` (each must be there and be an int
or a float, not a bool, or the save fails before anything is committed; a NaN or infinite
float, as a diverging loss gives, is saved without a value and logged), sent with rank 0's
commit vote, and written by every rank into its commit record, and into the commit records
of the copies it holds (docs/format.md). The retain
stage reads them back from the records: every rank sees the same values, and so does a
pipeline opened after a restart. A step saved while no policy asked for a metric has no value
for it: it is never among the best, and is kept only if another policy keeps it.

Several policies: ``retention=[KeepLast(2), KeepEvery(1000), KeepBest(3, "loss")]`` keeps a
step if any of them keeps it (``KeepAny``). ``keep_last=N`` is shorthand for ``KeepLast(N)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from .errors import ConfigError

__all__ = ("KeepAny", "KeepBest", "KeepEvery", "KeepLast", "MetricPolicy", "RetentionPolicy",
           "StepInfo", "kept_steps", "metric_value")


@dataclass(frozen=True, slots=True)
class StepInfo:
    """A committed step and the metric values its commit record holds (empty: none)."""

    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class RetentionPolicy(Protocol):
    """Chooses the committed steps to keep (see the module docstring for the call order)."""

    def keep(self, steps: Sequence[int]) -> Set[int]:
        """The steps to keep, out of ``steps`` (every committed step, newest first)."""
        ...


@runtime_checkable
class MetricPolicy(RetentionPolicy, Protocol):
    """A policy that decides from metric values recorded with each step.

    The retain stage calls ``keep_infos`` instead of ``keep`` (module docstring).
    """

    @property
    def metrics(self) -> Sequence[str]:
        """The ``TrainState.extra`` keys every save must carry; recorded with each commit."""
        ...

    def keep_infos(self, infos: Sequence[StepInfo]) -> Set[int]:
        """The steps to keep, out of ``infos`` (every committed step, newest first)."""
        ...


def _positive_count(policy: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{policy}({value!r}): the count must be a positive int",
                          hint=f"keep at least one checkpoint: {policy}(1)")


@dataclass(frozen=True, slots=True)
class KeepLast:
    """Keep the newest ``count`` committed steps."""

    count: int

    def __post_init__(self) -> None:
        _positive_count("KeepLast", self.count)

    def keep(self, steps: Sequence[int]) -> Set[int]:
        return frozenset(sorted(steps, reverse=True)[:self.count])


@dataclass(frozen=True, slots=True)
class KeepEvery:
    """Keep every committed step that is a multiple of ``every``, forever."""

    every: int

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"KeepEvery({self.every!r}): the interval must be a positive int",
                              hint="for example KeepEvery(1000) keeps steps 1000, 2000, ...")

    def keep(self, steps: Sequence[int]) -> Set[int]:
        return frozenset(s for s in steps if s % self.every == 0)


@dataclass(frozen=True, slots=True)
class KeepBest:
    """Keep the ``count`` committed steps with the best ``TrainState.extra[metric]``.

    ``mode``: ``"min"`` (lowest is best, as for a loss) or ``"max"``. Of two steps with the
    same value, the newer one is better. A step without a recorded value is never among the
    best. Every save must then carry the metric in rank 0's ``TrainState.extra`` (an int or
    float), else it fails before it is committed; a NaN or infinite value saves the step
    without a value (never the best).
    """

    count: int
    metric: str
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        _positive_count("KeepBest", self.count)
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"KeepBest(metric={self.metric!r}): the metric must be the "
                              "non-empty name of a TrainState.extra value",
                              hint='for example KeepBest(3, metric="loss")')
        if self.mode not in ("min", "max"):
            raise ConfigError(f"KeepBest(mode={self.mode!r}) is not a mode",
                              hint='use mode="min" (lowest is best) or mode="max"')

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric,)

    def keep(self, steps: Sequence[int]) -> Set[int]:
        """Without recorded values no step is among the best."""
        return frozenset()

    def keep_infos(self, infos: Sequence[StepInfo]) -> Set[int]:
        sign = 1.0 if self.mode == "min" else -1.0
        scored = [(sign * value, -info.step, info.step) for info in infos
                  if (value := metric_value(info.metrics.get(self.metric))) is not None]
        return frozenset(step for _, _, step in sorted(scored)[:self.count])


def kept_steps(result: object, policy: object) -> frozenset[int]:
    """What a policy's ``keep`` or ``keep_infos`` returned, as a frozenset of steps: a
    generator or a list is taken whole (once, before any step is tested against it); anything
    that is not a collection of int steps is an error, and nothing is pruned for it (the retain
    stage reports it as ``RetentionFailed``)."""
    try:
        steps: frozenset[object] = frozenset(result)  # type: ignore[call-overload]
    except TypeError:
        raise ConfigError(f"{policy!r} returned {type(result).__name__} from keep(), not the "
                          "steps to keep", hint="return a set of step numbers") from None
    ints = frozenset(s for s in steps if isinstance(s, int) and not isinstance(s, bool))
    if len(ints) != len(steps):
        odd = [s for s in steps if s not in ints][:3]
        raise ConfigError(f"{policy!r} returned {odd!r} among the steps to keep, not step "
                          "numbers", hint="return a set of step numbers (ints)")
    return ints


def metric_value(value: object) -> float | None:
    """A metric as retention ranks it: a finite int or float (not a bool), as a float; None
    for anything else (a step without a usable value is never among the best)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


@dataclass(frozen=True, slots=True)
class KeepAny:
    """Keep a step if any of ``policies`` keeps it (``retention=[...]`` builds one)."""

    policies: tuple[RetentionPolicy, ...]

    def __post_init__(self) -> None:
        if not self.policies:
            raise ConfigError("KeepAny() needs at least one policy",
                              hint="for example KeepAny((KeepLast(2), KeepEvery(1000)))")
        for policy in self.policies:
            if not isinstance(policy, RetentionPolicy):
                raise ConfigError(f"{policy!r} is not a retention policy",
                                  hint="pass e.g. KeepLast(3), or an object with "
                                       "keep(steps) -> set of steps")
            if isinstance(policy, MetricPolicy):
                names = policy.metrics
                if isinstance(names, str) or not all(
                    isinstance(n, str) and n for n in names
                ):
                    raise ConfigError(f"{policy!r}: metrics={names!r} must be a sequence of "
                                      "non-empty names", hint='for example ("loss",)')

    @property
    def metrics(self) -> tuple[str, ...]:
        names = (n for p in self.policies if isinstance(p, MetricPolicy) for n in p.metrics)
        return tuple(dict.fromkeys(names))

    def keep(self, steps: Sequence[int]) -> Set[int]:
        return self.keep_infos([StepInfo(s) for s in steps])

    def keep_infos(self, infos: Sequence[StepInfo]) -> Set[int]:
        steps = tuple(info.step for info in infos)
        kept: set[int] = set()
        for policy in self.policies:
            if isinstance(policy, MetricPolicy):
                kept |= kept_steps(policy.keep_infos(infos), policy)
            else:
                kept |= kept_steps(policy.keep(steps), policy)
        return frozenset(kept)
