"""Agreement between ranks: which saves commit and which step every rank restores.

The pipeline asks a coordinator at three points, always from its event loop:

1. ``start()`` once, when the pipeline opens: returns the run id that save ids are built from.
2. ``agree_commit(step, save_id, error)`` after this rank's shard is durable (or failed):
   returns the failures of all ranks; the commit record is written only when it is empty.
3. ``agree_candidates(valid)`` during restore with this rank's valid steps and their save ids:
   returns the steps every rank holds with the same save id, newest first; then
   ``agree_loaded(step, error)`` after each attempt to load one of them: returns the failures
   of all ranks, and all ranks fall back together to the next candidate when it is not empty.

A multi-rank implementation on torch.distributed comes with the distributed issue; this module
holds the single-process one.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

__all__ = ("Coordinator", "LocalCoordinator")


@runtime_checkable
class Coordinator(Protocol):
    """Agreement between the ranks of one job (see the module docstring for the call order)."""

    rank: int
    world_size: int

    async def start(self) -> str:
        """A run id shared by all ranks."""

    async def agree_commit(self, step: int, save_id: str, error: str | None) -> dict[int, str]:
        """Exchange this rank's save outcome; return {rank: error} of the ranks that failed."""

    async def agree_candidates(self, valid: Mapping[int, str]) -> list[tuple[int, str]]:
        """Exchange valid {step: save_id}; return (step, save_id) held by all, newest first."""

    async def agree_loaded(self, step: int, error: str | None) -> dict[int, str]:
        """Exchange this rank's load outcome; return {rank: error} of the ranks that failed."""


class LocalCoordinator:
    """The coordinator of a single process: every rank is this one."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    async def start(self) -> str:
        return secrets.token_hex(8)

    async def agree_commit(self, step: int, save_id: str, error: str | None) -> dict[int, str]:
        return {} if error is None else {self.rank: error}

    async def agree_candidates(self, valid: Mapping[int, str]) -> list[tuple[int, str]]:
        return sorted(valid.items(), reverse=True)

    async def agree_loaded(self, step: int, error: str | None) -> dict[int, str]:
        return {} if error is None else {self.rank: error}
