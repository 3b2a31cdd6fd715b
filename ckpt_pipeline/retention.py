"""Retention policies: which committed steps the retain stage keeps.

A policy is any object with ``keep(steps)``. Call order: after every commit, the retain stage
of each rank lists that rank's committed steps (by the step recorded in each commit record),
calls ``keep`` once with them, newest first, and removes the others, except that the newest
complete step (the one just committed on every rank) and anything newer are never removed,
whatever the policy says. ``keep`` must be a pure function of its argument, so that every rank
keeps the same steps. ``keep_last=N`` is shorthand for ``KeepLast(N)``.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .errors import ConfigError

__all__ = ("KeepLast", "RetentionPolicy")


@runtime_checkable
class RetentionPolicy(Protocol):
    """Chooses the committed steps to keep (see the module docstring for the call order)."""

    def keep(self, steps: Sequence[int]) -> Set[int]:
        """The steps to keep, out of ``steps`` (every committed step, newest first)."""
        ...


@dataclass(frozen=True, slots=True)
class KeepLast:
    """Keep the newest ``count`` committed steps."""

    count: int

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ConfigError(f"KeepLast({self.count!r}): count must be a positive int",
                              hint="keep at least one checkpoint: KeepLast(1)")

    def keep(self, steps: Sequence[int]) -> Set[int]:
        return frozenset(sorted(steps, reverse=True)[:self.count])
