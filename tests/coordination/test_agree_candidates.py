"""Which save id of a step the ranks agree on at restore (``agree_candidates``), when roots of
two runs with the same step numbers meet: the decision alone, every rank's answer given.

Rank r's message is what its scan would report: its own valid steps {step: (save id, world
size)}, the copies it holds (step, source, save id, world size), and the steps it found in
the persistent tier. The coordinator hands every rank's message to rank 0, as the gloo
all-gather does (the multi-process cases are in tests/replicate/test_restore_copies.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from ckpt_pipeline.coordination._agree import Candidates, agree_candidates
from tests._support.coordinators import Answers


def _message(valid: dict[int, str], copies: Sequence[tuple[int, int, str]] = (),
             world: int = 4) -> dict[str, Any]:
    return {"valid": [[s, sid, world] for s, sid in sorted(valid.items())],
            "copies": [[s, src, sid, world] for s, src, sid in copies], "persisted": [],
            "held_any": True}


def _agree(ranks: Sequence[dict[str, Any]], persisted: Sequence[tuple[int, str, int]] = ()
           ) -> Candidates:
    mine = ranks[0]

    async def run() -> Candidates:
        return await agree_candidates(
            Answers(ranks[1:]), {s: (sid, ws) for s, sid, ws in mine["valid"]},
            held_any=True, copies=[tuple(c) for c in mine["copies"]], persisted=persisted)

    return anyio.run(run)


@pytest.mark.timeout(10)
def test_the_save_whole_from_copies_wins_over_a_foreign_root_of_one_rank() -> None:
    """Four nodes, rank r's copy on rank r+1: rank 3's root is another run's (B). Run A's
    step is whole (rank 3's shard from its copy on rank 0); B's is not."""
    ranks = [_message({20: "A"}, [(20, 3, "A")]), _message({20: "A"}, [(20, 0, "A")]),
             _message({20: "A"}, [(20, 1, "A")]), _message({20: "B"}, [(20, 2, "B")])]
    agreed = _agree(ranks)
    assert agreed.steps == ((20, "A"),)
    assert agreed.holders[(20, 3)] == (0,)
    assert agreed.unresolved == {}


@pytest.mark.timeout(10)
def test_two_saves_whole_and_held_alike_are_ambiguous() -> None:
    """Two nodes of two ranks, node1 another run's: each run's step is whole from its own
    node's shards and copies. Nothing tells which run is this one: the step is left out."""
    ranks = [_message({20: "A"}, [(20, 2, "A")]), _message({20: "A"}, [(20, 3, "A")]),
             _message({20: "B"}, [(20, 0, "B")]), _message({20: "B"}, [(20, 1, "B")])]
    agreed = _agree(ranks)
    assert agreed.steps == ()
    assert "saves ['A', 'B'] are each whole" in agreed.unresolved[20]
    assert "ambiguous" in agreed.unresolved[20]


@pytest.mark.timeout(10)
def test_the_persistent_tier_breaks_a_tie_between_two_whole_saves() -> None:
    ranks = [_message({20: "A"}, [(20, 2, "A")]), _message({20: "A"}, [(20, 3, "A")]),
             _message({20: "B"}, [(20, 0, "B")]), _message({20: "B"}, [(20, 1, "B")])]
    assert _agree(ranks, persisted=[(20, "A", 4)]).steps == ((20, "A"),)


@pytest.mark.timeout(10)
def test_no_whole_save_names_the_shards_each_save_holds_and_older_steps_still_count(
        ) -> None:
    ranks = [_message({10: "A10", 20: "A"}, [(20, 3, "A")]), _message({10: "A10", 20: "A"}),
             _message({10: "A10", 20: "B"}), _message({10: "A10", 20: "B"}, [(20, 2, "B")])]
    agreed = _agree(ranks)
    assert agreed.steps == ((10, "A10"),)
    assert agreed.unresolved[20] == ("no save makes it whole (save A holds the shards of "
                                     "rank(s) [0, 1, 3]; save B holds the shards of rank(s) "
                                     "[2, 3])")


@pytest.mark.timeout(10)
def test_the_majority_of_own_shards_wins_when_both_saves_are_whole() -> None:
    """Rank 3's root is another run's and that run's copies cover every shard too (rank 3
    held copies of everything): the save most ranks hold their own shard of wins."""
    ranks = [_message({20: "A"}, [(20, 3, "A")]), _message({20: "A"}),
             _message({20: "A"}),
             _message({20: "B"}, [(20, 0, "B"), (20, 1, "B"), (20, 2, "B")])]
    agreed = _agree(ranks)
    assert agreed.steps == ((20, "A"),)
    assert agreed.holders == {(20, 3): (0,)}
