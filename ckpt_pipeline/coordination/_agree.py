"""Agreements between ranks, built on the coordinator's all-gather of msgpack messages.

Every function here is called by every rank, in the same order; each returns the same decision
on every rank, so that no rank can take a path the others do not take.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._format.documents import decode_message, encode_message
from ..errors import CheckpointIntegrityError, CoordinationError
from ._control_plane import Coordinator

__all__ = ("Candidates", "agree_barrier", "agree_candidates", "agree_outcome", "agree_run_id")


async def _exchange(coordinator: Coordinator, message: dict[str, Any], *, what: str,
                    step: int | None = None) -> list[dict[str, Any]]:
    raw = await coordinator.all_gather(encode_message(message), what=what, step=step)
    if len(raw) != coordinator.world_size:
        raise CoordinationError(f"{what}: {len(raw)} answers for {coordinator.world_size} "
                                "ranks", step=step, rank=coordinator.rank)
    out = []
    for rank, payload in enumerate(raw):
        try:
            decoded = decode_message(payload, f"{what} message of rank {rank}")
        except CheckpointIntegrityError as exc:  # a peer's message, not a file on disk
            raise CoordinationError(f"{what}: rank {rank} sent a malformed message "
                                    f"({exc.message})", step=step, rank=coordinator.rank,
                                    hint="ranks running different versions of ckpt_pipeline?"
                                         " restart the job with the same version everywhere",
                                    ranks=(rank,)) from exc
        out.append(decoded)
    return out


async def agree_run_id(coordinator: Coordinator) -> str:
    """Rank 0's random run id, known to every rank."""
    answers = await _exchange(coordinator, {"run_id": secrets.token_hex(8)}, what="start")
    run_id = answers[0].get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise CoordinationError("start: rank 0 sent no run id", rank=coordinator.rank)
    return run_id


async def agree_outcome(coordinator: Coordinator, step: int, save_id: str,
                        error: str | None, *, what: str, fatal: bool = False
                        ) -> tuple[dict[int, str], bool]:
    """Every rank's outcome of one operation on ``step``: ({rank: error}, any fatal).

    A rank that answers for another step or save id counts as failed too.
    """
    answers = await _exchange(coordinator, {"step": step, "save_id": save_id, "error": error,
                                            "fatal": fatal}, what=what, step=step)
    failures: dict[int, str] = {}
    any_fatal = False
    for rank, answer in enumerate(answers):
        err = answer.get("error")
        if answer.get("step") != step or answer.get("save_id") != save_id:
            failures[rank] = (f"was at step {answer.get('step')} (save {answer.get('save_id')})"
                              f", not step {step}")
        elif err is not None:
            failures[rank] = str(err)
        any_fatal = any_fatal or bool(answer.get("fatal"))
    return failures, any_fatal


@dataclass(frozen=True, slots=True)
class Candidates:
    """What the ranks hold: steps every rank holds with the same save id, newest first."""

    steps: tuple[tuple[int, str], ...]
    valid_by_rank: Mapping[int, tuple[int, ...]]
    world_sizes: Mapping[int, int]
    """World sizes recorded in the valid steps of any rank, by step (only those != this job's)."""
    held_any: bool
    """Some rank holds a complete step (valid or not): starting from scratch would lose it."""


async def agree_candidates(coordinator: Coordinator, valid: Mapping[int, tuple[str, int]],
                           *, held_any: bool) -> Candidates:
    """Exchange {step: (save_id, world_size)} of every rank's valid steps."""
    answers = await _exchange(
        coordinator, {"valid": [[s, sid, ws] for s, (sid, ws) in sorted(valid.items())],
                      "held_any": held_any}, what="restore candidates")
    held: list[dict[int, str]] = []
    other_sizes: dict[int, int] = {}
    for rank, answer in enumerate(answers):
        entries = answer.get("valid")
        if not isinstance(entries, list):
            raise CoordinationError(f"restore candidates: rank {rank} sent a malformed list",
                                    rank=coordinator.rank)
        steps: dict[int, str] = {}
        for entry in entries:
            if (not isinstance(entry, list) or len(entry) != 3
                    or not isinstance(entry[0], int) or not isinstance(entry[1], str)
                    or not isinstance(entry[2], int)):
                raise CoordinationError(
                    f"restore candidates: rank {rank} sent a malformed entry",
                    rank=coordinator.rank)
            steps[entry[0]] = entry[1]
            if entry[2] != coordinator.world_size:
                other_sizes[entry[0]] = entry[2]
        held.append(steps)
    common = {s for s in held[0] if s not in other_sizes}
    for steps in held[1:]:
        common &= set(steps)
    agreed = tuple(sorted(((s, held[0][s]) for s in common
                           if all(h[s] == held[0][s] for h in held)), reverse=True))
    return Candidates(agreed, {r: tuple(sorted(h, reverse=True)) for r, h in enumerate(held)},
                      other_sizes, any(bool(a.get("held_any")) for a in answers))


async def agree_barrier(coordinator: Coordinator, *, what: str, step: int | None = None
                        ) -> None:
    """Return once every rank got here."""
    await _exchange(coordinator, {}, what=what, step=step)
