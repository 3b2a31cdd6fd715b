"""Coordinators that stand in for the other ranks of a job in single-process tests of an
agreement: rank 0's view of an all-gather whose other answers are given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckpt_pipeline._format.documents import encode_message

__all__ = ("Answers",)


class Answers:
    """Rank 0's coordinator in a job whose other ranks answer ``others`` (their messages, as
    the gloo all-gather hands them to rank 0)."""

    def __init__(self, others: Sequence[dict[str, Any]]) -> None:
        self.rank = 0
        self.world_size = 1 + len(others)
        self.others = others

    async def all_gather(self, payload: bytes, *, what: str, step: int | None = None
                         ) -> list[bytes]:
        return [payload, *(encode_message(m) for m in self.others)]
