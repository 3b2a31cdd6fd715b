"""The commit vote's typed parts (``gather_vote``): each participant's part travels as msgpack
through the documents codec and is read back strictly on every rank; a malformed part from
another rank is a CoordinationError naming it, and a part bound to the step is dropped for a
rank that votes on another save.

Rank 0's coordinator is given the other ranks' messages, as the gloo all-gather hands them
(the multi-process votes are in tests/replicate and tests/persist).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from ckpt_pipeline._format.documents import decode_message, encode_message
from ckpt_pipeline._save.metrics import MetricValues
from ckpt_pipeline._tiers.persistent.remote import ObjectSum
from ckpt_pipeline._tiers.persistent.reports import PersistReport, UploadReport
from ckpt_pipeline._tiers.replica.vote import CopiesAcked, CopiesSettled
from ckpt_pipeline.coordination._agree import (
    Ballot,
    Tally,
    VotePart,
    _pack_pieces,
    _unpack_pieces,
    encode_piece,
    gather_vote,
    read_piece,
)
from ckpt_pipeline.coordination._control_plane import LocalCoordinator
from ckpt_pipeline.errors import CheckpointIntegrityError, CoordinationError
from tests._support.coordinators import Agreeing, Answers

STEP, SAVE = 7, "run-7"




def _vote(others: Sequence[dict[str, Any]], ballots: dict[str, Ballot[Any]]) -> Tally:
    async def run() -> Tally:
        return await gather_vote(Answers(others), STEP, SAVE, None, what="commit",
                                 ballots=ballots)

    return anyio.run(run)


def _answer(parts: dict[str, Any], step: int = STEP) -> dict[str, Any]:
    return {"step": step, "save_id": SAVE, "error": None, "fatal": False, "parts": parts}


_UPLOAD = UploadReport({"rank_00000.shard": ObjectSum(10, 4, (1, 2, 3))},
                       {"rank_00000.shard": "etag-1", "rank_00000.commit": None})
PARTS: list[VotePart] = [
    CopiesAcked((1, 2), {3: "rank 3 did not answer"}),
    CopiesAcked(()),
    CopiesAcked(None),
    CopiesSettled({0: "disk full"}),
    MetricValues({"loss": 0.25, "acc": None}),
    PersistReport(1, (4,), {5: "timed out"}, reachable=True, lost=None, uploads={4: _UPLOAD}),
    PersistReport(0, lost="another job holds the URL"),
]


@pytest.mark.parametrize("part", PARTS, ids=lambda p: type(p).__name__)
def test_a_vote_part_round_trips_through_the_message_codec(part: Any) -> None:
    wire = decode_message(encode_message({"part": part.to_msg()}), "a vote")["part"]
    assert type(part).from_msg(wire) == part


@pytest.mark.parametrize(("kind", "message"), [
    (CopiesAcked, {"acked": [1, "2"], "errors": {}}),
    (CopiesAcked, {"acked": [1], "errors": {"x": "why"}}),
    (CopiesAcked, {"acked": [1]}),
    (CopiesAcked, {"acked": False, "errors": {}}),
    (CopiesSettled, {"0": 5}),
    (CopiesSettled, [1, 2]),
    (MetricValues, {"loss": "low"}),
    (MetricValues, {"": 1.0}),
    (MetricValues, {"loss": float("nan")}),
    (PersistReport, {"unfinished": -1, "done": {}, "failed": {}, "reachable": True,
                     "lost": None}),
    (PersistReport, {"unfinished": 0, "done": {"4": {"sums": {}}}, "failed": {},
                     "reachable": True, "lost": None}),
    (PersistReport, {"unfinished": 0, "done": ["4"], "failed": {}, "reachable": True,
                     "lost": None}),
    (PersistReport, {"unfinished": 0, "done": [-4], "failed": {}, "reachable": True,
                     "lost": None}),
    (PersistReport, {"unfinished": 0, "done": {}, "failed": {"four": "x"},
                     "reachable": True, "lost": None}),
    (PersistReport, {"unfinished": 0, "done": {}, "failed": {}, "reachable": 1,
                     "lost": None}),
])
def test_a_malformed_vote_part_is_refused(kind: Any, message: Any) -> None:
    with pytest.raises(ValueError):
        kind.from_msg(message)


def test_a_persist_reports_checksums_travel_apart_and_round_trip() -> None:
    """The report every rank reads names the finished steps only; the checksums are the
    piece for rank 0, read back by ``uploads_from_msg``."""
    report = PersistReport(0, (4,), reachable=True, uploads={4: _UPLOAD})
    assert "sums" not in repr(report.to_msg())
    wire = decode_message(encode_message({"root": report.root_msg()}), "a piece")["root"]
    assert PersistReport.uploads_from_msg(wire) == {4: _UPLOAD}
    assert PersistReport(0, reachable=True).root_msg() is None
    for bad in ([1], {"four": _UPLOAD.to_msg()}, {"4": {"sums": {}}}):
        with pytest.raises(ValueError):
            PersistReport.uploads_from_msg(bad)


def test_every_ranks_part_arrives_typed_by_participant() -> None:
    mine = CopiesAcked((1,))
    tally = _vote([_answer({"replicas": CopiesAcked((0,)).to_msg(), "metrics": None})],
                  {"replicas": Ballot(mine, CopiesAcked.from_msg),
                   "metrics": Ballot(None, MetricValues.from_msg)})
    assert tally.failures == {}
    assert tally.parts == {"replicas": (mine, CopiesAcked((0,))), "metrics": (None, None)}


def test_a_malformed_part_from_another_rank_is_a_coordination_error_naming_it() -> None:
    with pytest.raises(CoordinationError, match="rank 1 sent a malformed replicas part") as exc:
        _vote([_answer({"replicas": {"acked": "all", "errors": {}}})],
              {"replicas": Ballot(CopiesAcked(()), CopiesAcked.from_msg)})
    assert exc.value.ranks == (1,)


def test_a_message_without_parts_is_a_coordination_error() -> None:
    answer = _answer({})
    del answer["parts"]
    with pytest.raises(CoordinationError, match="rank 1 sent a malformed message"):
        _vote([answer], {"replicas": Ballot(None, CopiesAcked.from_msg)})


def test_a_rank_on_another_save_fails_the_vote_and_only_parts_for_any_step_count() -> None:
    report = PersistReport(0, reachable=True)
    tally = _vote([_answer({"replicas": CopiesAcked((0,)).to_msg(),
                            "persist": report.to_msg()}, step=STEP - 1)],
                  {"replicas": Ballot(None, CopiesAcked.from_msg),
                   "persist": Ballot(report, PersistReport.from_msg, any_step=True)})
    assert list(tally.failures) == [1] and "not step 7" in tally.failures[1]
    assert tally.parts == {"replicas": (None, None), "persist": (report, report)}


def test_rank_0_alone_gets_the_pieces_for_rank_0_of_a_rooted_part() -> None:
    """Through a coordinator without ``all_gather_root`` the pieces ride in the message
    (``for_root``): rank 0 reads each rank's, and only the rooted participant's; a rank's
    piece that rank 0 cannot read is left out (logged), and the vote still carries."""
    mine = PersistReport(0, (4,), reachable=True, uploads={4: _UPLOAD})
    alike = PersistReport(0, (4,), reachable=True)
    pieces = [_pack_pieces({"persist": encode_piece({"4": _UPLOAD.to_msg()})}), b"",
              b"\x09\x00 short of its head"]
    others = [{**_answer({"persist": alike.to_msg(), "replicas": None}), "for_root": piece}
              for piece in pieces]
    tally = _vote(others, {"persist": Ballot(mine, PersistReport.from_msg, any_step=True,
                                             rooted=True),
                           "replicas": Ballot(None, CopiesAcked.from_msg)})
    assert tally.failures == {}
    assert tally.parts["persist"] == (mine, alike, alike, alike)
    assert set(tally.roots) == {"persist"}
    got = {rank: PersistReport.uploads_from_msg(read_piece(m, "a piece"))
           for rank, m in tally.roots["persist"].items()}
    assert got == {0: {4: _UPLOAD}, 1: {4: _UPLOAD}}


def test_a_rank_other_than_0_gets_no_pieces() -> None:
    async def run() -> Tally:
        report = PersistReport(0, (4,), reachable=True, uploads={4: _UPLOAD})
        return await gather_vote(Agreeing(1, 4), STEP, SAVE, None, what="commit", ballots={
            "persist": Ballot(report, PersistReport.from_msg, any_step=True, rooted=True)})

    tally = anyio.run(run)
    assert tally.failures == {} and tally.roots == {"persist": {}}


def test_the_local_coordinator_hands_its_own_piece_to_itself() -> None:
    async def run() -> Tally:
        report = PersistReport(0, (4,), reachable=True, uploads={4: _UPLOAD})
        return await gather_vote(LocalCoordinator(), STEP, SAVE, None, what="commit", ballots={
            "persist": Ballot(report, PersistReport.from_msg, any_step=True, rooted=True)})

    tally = anyio.run(run)
    assert {r: PersistReport.uploads_from_msg(read_piece(m, "a piece"))
            for r, m in tally.roots["persist"].items()} == {0: {4: _UPLOAD}}


def test_pieces_round_trip_by_participant_and_a_short_blob_is_refused() -> None:
    pieces = {"persist": encode_piece({"4": 1}), "other": b"", "\u00e9": b"\x00" * 70000}
    assert _unpack_pieces(_pack_pieces(pieces)) == pieces
    assert _unpack_pieces(b"") == {}
    for bad in (b"\x01", _pack_pieces(pieces)[:-1]):
        with pytest.raises(ValueError):
            _unpack_pieces(bad)
    with pytest.raises(CheckpointIntegrityError):
        read_piece(encode_message({"piece": 1, "more": 2}), "a piece")


def test_ranks_that_vote_alike_are_decoded_once_and_each_that_differs_is_named() -> None:
    """Of 1,000 ranks voting, 997 send the same bytes: their vote and part are decoded once
    (shared); a rank with another part and one that failed still come out as their own."""
    calls: list[Any] = []

    def decode(msg: Any) -> CopiesAcked:
        calls.append(msg)
        return CopiesAcked.from_msg(msg)

    mine = CopiesAcked((1,))
    alike = _answer({"replicas": mine.to_msg()})
    others = [dict(alike) for _ in range(998)]
    others[500] = _answer({"replicas": CopiesAcked((2,)).to_msg()})
    others[700] = {**alike, "error": "disk full"}
    tally = _vote(others, {"replicas": Ballot(mine, decode)})
    assert tally.failures == {701: "disk full"}
    parts = tally.parts["replicas"]
    assert len(parts) == 999 and parts[501] == CopiesAcked((2,))
    assert all(p == mine for i, p in enumerate(parts) if i != 501)
    assert len(calls) == 3  # rank 0's and the 996 like it, rank 501's, rank 701's
