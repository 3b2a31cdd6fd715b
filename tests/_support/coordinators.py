"""Coordinators that stand in for the other ranks of a job in single-process tests of an
agreement: rank 0's view of an all-gather whose other answers are given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckpt_pipeline._format.documents import decode_message, encode_message

__all__ = ("Agreeing", "Answers")


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


class Agreeing:
    """Rank ``rank`` of a job of ``world_size`` whose other ranks always answer as this one
    does (for example rank 1 of two writing its own root in the one-root-per-rank layout).
    At open, only rank 0 sends a run id and token (``agree_open``): rank 0's answer then
    carries them."""

    def __init__(self, rank: int, world_size: int = 2) -> None:
        self.rank = rank
        self.world_size = world_size

    async def all_gather(self, payload: bytes, *, what: str, step: int | None = None
                         ) -> list[bytes]:
        answers = [payload] * self.world_size
        if what == "start" and self.rank != 0:
            first = decode_message(payload, "start message")
            answers[0] = encode_message({**first, "run_id": "0" * 16, "token": "0" * 32})
        return answers
