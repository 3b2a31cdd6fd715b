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

from ckpt_pipeline._format.documents import encode_message
from ckpt_pipeline.coordination._agree import (
    Candidates,
    Opening,
    agree_candidates,
    agree_open,
    candidates_message,
)
from ckpt_pipeline.coordination._runs import Runs
from ckpt_pipeline.errors import CoordinationError
from tests._support.coordinators import Answers


def _message(valid: dict[int, str], copies: Sequence[tuple[int, int, str]] = (),
             world: int = 4) -> dict[str, Any]:
    """What rank r would send, as (r, world) -> its message: its own valid steps and its
    copies (step, source, save id)."""
    return {"valid": {s: (sid, world) for s, sid in valid.items()},
            "copies": [(s, src, sid, world) for s, src, sid in copies], "world": world}


def _sent(rank: int, mine: dict[str, Any], persisted: Sequence[tuple[int, str, int]] = ()
          ) -> dict[str, Any]:
    return candidates_message(rank, mine["world"], mine["valid"], held_any=True,
                              copies=mine["copies"], persisted=persisted)


def _agree(ranks: Sequence[dict[str, Any]], persisted: Sequence[tuple[int, str, int]] = ()
           ) -> Candidates:
    mine = ranks[0]

    async def run() -> Candidates:
        return await agree_candidates(
            Answers([_sent(r, m) for r, m in enumerate(ranks) if r]), mine["valid"],
            held_any=True, copies=mine["copies"], persisted=persisted)

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


class _RunsOfAnswers:
    """Rank 0's coordinator in a job of ``runs`` (pairs of a rank count and the message each
    of those ranks sends; None: what rank 0 sent, for a first run of one rank), handed back
    as the per-node control plane does: one entry a run."""

    def __init__(self, runs: Sequence[tuple[int, dict[str, Any] | None]]) -> None:
        self.rank = 0
        self.runs = runs
        self.world_size = sum(count for count, _ in runs)

    async def all_gather(self, payload: bytes, *, what: str, step: int | None = None
                         ) -> Runs[bytes]:
        stops, items, at = [], [], 0
        for count, message in self.runs:
            at += count
            stops.append(at)
            items.append(payload if message is None else encode_message(message))
        assert items[0] == payload  # rank 0 sent what the first run stands for
        return Runs(stops, items)


BILLION = 1_000_000_000  # a walk over every rank would not end within the test's timeout


@pytest.mark.timeout(10)
def test_a_billion_ranks_holding_alike_are_read_run_by_run() -> None:
    """Half the ranks hold steps 10 and 20, the other half step 10 only, and one rank holds
    a copy of rank 0's shard of step 20: the decision, the holders and the reasons come out of
    the runs; nothing walks the ranks one by one."""
    both = _sent(0, _message({10: "A10", 20: "A"}, world=BILLION))
    older = _sent(0, _message({10: "A10"}, world=BILLION))
    copier = _sent(BILLION // 2, _message({10: "A10"}, [(20, 0, "A")], world=BILLION))
    coordinator = _RunsOfAnswers([(BILLION // 2, both), (1, copier),
                                  (BILLION // 2 - 1, older)])

    async def run() -> Candidates:
        return await agree_candidates(coordinator, {10: ("A10", BILLION), 20: ("A", BILLION)},
                                      held_any=True)

    agreed = anyio.run(run)
    assert agreed.steps == ((10, "A10"),)
    assert agreed.unresolved[20] == ("no save makes it whole (save A holds the shards of "
                                     f"rank(s) [0-{BILLION // 2 - 1}])")
    assert agreed.newest_valid == 20
    assert agreed.valid_by_rank[0] == (20, 10) and agreed.valid_by_rank[BILLION - 1] == (10,)
    assert len(agreed.valid_by_rank) == BILLION
    assert agreed.copies_of(20, 0) and not agreed.copies_of(20, 1)
    assert agreed.held_any


@pytest.mark.timeout(10)
def test_a_billion_ranks_whole_from_their_own_shards_and_the_tier() -> None:
    """Every rank but the last holds step 20 of save A; the persistent tier holds it whole:
    A is agreed, with no copy holders."""
    own = _sent(0, _message({20: "A"}, world=BILLION))
    lost = _sent(0, _message({}, world=BILLION), persisted=[(20, "A", BILLION)])
    coordinator = _RunsOfAnswers([(BILLION - 1, own), (1, lost)])

    async def run() -> Candidates:
        return await agree_candidates(coordinator, {20: ("A", BILLION)}, held_any=True)

    agreed = anyio.run(run)
    assert agreed.steps == ((20, "A"),) and agreed.holders == {}
    assert agreed.persisted == frozenset({(20, "A")})
    assert agreed.valid_by_rank[BILLION - 1] == ()


@pytest.mark.timeout(10)
def test_the_opening_of_a_billion_ranks_takes_rank_0s_run_id_and_reads_by_run() -> None:
    """Only rank 0 sends a run id and token; nodes without copy servers answer alike, and
    every rank's node and address come back indexed by rank."""
    node0: dict[str, Any] = {"run_id": None, "token": None, "node": "n0", "address": None}
    node1 = {**node0, "node": "n1"}
    served = {**node0, "node": "n1", "address": ["10.0.0.9", 4321]}
    coordinator = _RunsOfAnswers([(1, None), (BILLION // 2 - 1, node0),
                                  (BILLION // 2 - 1, node1), (1, served)])

    async def run() -> Opening:
        return await agree_open(coordinator, "n0", None)

    opening = anyio.run(run)
    assert len(opening.run_id) == 16 and len(opening.token) == 32
    assert opening.nodes[0] == opening.nodes[BILLION // 2 - 1] == "n0"
    assert opening.nodes[BILLION // 2] == opening.nodes[BILLION - 1] == "n1"
    assert opening.addresses[BILLION - 2] is None
    assert opening.addresses[BILLION - 1] == ("10.0.0.9", 4321)
    assert len(opening.nodes) == len(opening.addresses) == BILLION


@pytest.mark.timeout(10)
def test_a_malformed_answer_in_a_run_names_the_runs_first_rank() -> None:
    bad = {"valid": "nonsense", "copies": [], "persisted": [], "held_any": True}
    coordinator = _RunsOfAnswers([(5, _sent(0, _message({20: "A"}, world=10))), (5, bad)])

    async def run() -> Candidates:
        return await agree_candidates(coordinator, {20: ("A", 10)}, held_any=True)

    with pytest.raises(CoordinationError, match="rank 5 sent a malformed list"):
        anyio.run(run)


@pytest.mark.timeout(30)
def test_copies_at_one_offset_make_every_rank_answer_alike(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """1,024 ranks on nodes of 8, one copy each on the next node (the placement's): every
    rank sends the same bytes, so the answers are read once; rank 1,020's shard is lost and
    comes from its copy on rank 4 (the wrap-around), and the holders are every rank's."""
    from ckpt_pipeline.coordination import _agree as agreeing

    world, per_node = 1024, 8
    reads: list[int] = []
    read = agreeing._Held.read.__func__  # type: ignore[attr-defined]

    def counted(cls: Any, answer: dict[str, Any], me: int, rank: int) -> Any:
        reads.append(rank)
        return read(cls, answer, me, rank)

    monkeypatch.setattr(agreeing._Held, "read", classmethod(counted))
    ranks = [_message({} if r == 1020 else {20: "A"}, [(20, (r - per_node) % world, "A")],
                      world=world) for r in range(world)]
    sent = [_sent(r, m) for r, m in enumerate(ranks)]
    assert all(message["copies"] == sent[0]["copies"] for message in sent)
    agreed = _agree(ranks)
    assert agreed.steps == ((20, "A"),)
    assert agreed.holders[(20, 1020)] == (4,)
    assert agreed.holders[(20, 0)] == (8,)
    assert len(agreed.holders) == world
    assert reads == [0, 1020]  # the answer of every rank but one, then that one's


@pytest.mark.timeout(10)
def test_a_copy_of_another_world_size_counts_only_its_size() -> None:
    """Copies of a step saved by 8 ranks, in a job of 4: the step is of another world size,
    wherever its source rank was."""
    ranks = [_message({10: "A"}, [(20, 6, "B")]) for _ in range(4)]
    for r, message in enumerate(ranks):
        message["copies"] = [(20, 6 - r, "B", 8)]
    agreed = _agree(ranks)
    assert agreed.world_sizes == {20: 8}
    assert agreed.steps == ((10, "A"),)
    assert all(c[1] == -1 for c in _sent(0, ranks[0])["copies"])
