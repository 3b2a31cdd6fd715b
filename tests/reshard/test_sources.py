"""Which live ranks a reshard fetches each saved rank's shard from (``_spread``): the
candidates' answers of every rank in, the steps the live roots hold whole between them and
what this rank lacks of each out. Pure functions, no processes."""

from __future__ import annotations

from typing import Any

import pytest

from ckpt_pipeline._restore.reshard import _spread

pytestmark = pytest.mark.timeout(30)


def answer(held: dict[tuple[int, str], list[int]], *, fetch: bool = True,
           serves: bool = True) -> dict[str, Any]:
    return {"whole": [], "held": [[s, i, ranks] for (s, i), ranks in held.items()],
            "fetch": fetch, "serves": serves}


# 4 saved ranks; live rank 0 holds saved 0, 2, 3 of step 2 (its own and two copies), live
# rank 1 holds 1, 3, 0; live rank 2 (a new node) holds nothing.
ANSWERS = [answer({(2, "a"): [0, 2, 3]}), answer({(2, "a"): [0, 1, 3]}), answer({})]


def test_a_step_the_roots_hold_between_them_is_a_candidate_on_every_rank() -> None:
    for rank in range(3):
        coverable, _ = _spread(ANSWERS, 4, rank)
        assert coverable == {(2, "a")}


def test_each_rank_fetches_only_what_its_root_lacks_from_the_ranks_that_hold_it() -> None:
    assert _spread(ANSWERS, 4, 0)[1] == {(2, "a"): {1: (1,)}}
    assert _spread(ANSWERS, 4, 1)[1] == {(2, "a"): {2: (0,)}}
    lacking = _spread(ANSWERS, 4, 2)[1][2, "a"]
    assert sorted(lacking) == [0, 1, 2, 3]
    assert sorted(lacking[0]) == [0, 1] and sorted(lacking[3]) == [0, 1]


def test_the_holders_of_a_shard_take_the_fetches_in_turn() -> None:
    """Saved rank 0 held by live ranks 0 and 1; live ranks 2 and 3 lack it: each tries
    another holder first."""
    answers = [answer({(5, "b"): [0, 1]}), answer({(5, "b"): [0, 1]}), answer({}), answer({})]
    firsts = {_spread(answers, 2, rank)[1][5, "b"][0][0] for rank in (2, 3)}
    assert firsts == {0, 1}


def test_a_rank_that_runs_no_copy_server_holds_for_itself_only() -> None:
    answers = [answer({(2, "a"): [0, 2, 3]}), answer({(2, "a"): [1]}, serves=False), answer({})]
    assert _spread(answers, 4, 2) == (set(), {})  # saved rank 1 only where no one can fetch it
    answers[0] = answer({(2, "a"): [0, 1, 2, 3]})
    coverable, lacking = _spread(answers, 4, 1)
    assert coverable == {(2, "a")} and lacking[2, "a"] == {0: (0,), 2: (0,), 3: (0,)}


def test_no_step_is_had_from_peers_when_some_rank_cannot_fetch() -> None:
    answers = [*ANSWERS[:2], answer({}, fetch=False)]
    assert _spread(answers, 4, 0) == (set(), {})


def test_save_ids_are_not_mixed() -> None:
    """The same step of two saves: saved ranks of one save do not fill the other's."""
    answers = [answer({(2, "a"): [0, 1]}), answer({(2, "b"): [2, 3]})]
    assert _spread(answers, 4, 0) == (set(), {})
