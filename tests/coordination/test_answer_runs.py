"""Every rank's answer held as runs of equal answers (``Runs``): it reads as the list it stands
for, its O(runs) ways through (``runs``, ``map``, ``indices``, ``join``) agree with that
list, the relay hands one back without a reference a rank, and the leader joins its nodes'
runs (or, for nodes whose ranks are not consecutive, puts each rank's payload in its place).
In-process, no gloo."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpt_pipeline.coordination._hierarchy import (
    NodeLayout,
    merge_nodes,
    pack_distinct,
    pack_relay,
    unpack_distinct,
)
from ckpt_pipeline.coordination._runs import Runs, spans_text

pytestmark = pytest.mark.timeout(60)

answers = st.lists(st.sampled_from([b"ok", b"ok", b"busy", b"failed: disk full", b""]),
                   max_size=50)


@given(answers)
def test_runs_read_as_the_list_they_stand_for(items: list[bytes]) -> None:
    runs = Runs.of(items)
    assert len(runs) == len(items)
    assert list(runs) == items and runs == items
    assert [runs[i] for i in range(len(items))] == items
    assert [runs[-i] for i in range(1, len(items) + 1)] == [items[-i] for i in
                                                             range(1, len(items) + 1)]
    assert runs[1:4] == items[1:4]
    spans = list(runs.runs())
    assert sum(stop - start for start, stop, _ in spans) == len(items)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(a[2] != b[2] for a, b in itertools.pairwise(spans))  # merged
    assert list(runs.indices(lambda a: a != b"ok")) == [i for i, a in enumerate(items)
                                                        if a != b"ok"]


@given(answers, answers)
def test_join_is_the_lists_one_after_the_other(a: list[bytes], b: list[bytes]) -> None:
    assert Runs.join([Runs.of(a), Runs.of(b)]) == a + b


def test_map_calls_once_per_distinct_object_and_keeps_the_runs() -> None:
    runs = Runs.of([b"ok"] * 10_000 + [b"busy"] + [b"ok"] * 5)
    calls: list[bytes] = []
    mapped = runs.map(lambda a: calls.append(a) or a.upper())
    assert sorted(calls) == [b"busy", b"ok"]  # the two runs of b"ok" share one object
    assert mapped[0] == b"OK" and mapped[10_000] == b"BUSY" and len(mapped) == 10_006
    assert len(list(mapped.runs())) == 3


def test_out_of_range_and_malformed_runs_are_refused() -> None:
    runs = Runs.of([b"a", b"b"])
    with pytest.raises(IndexError):
        runs[2]
    with pytest.raises(IndexError):
        runs[-3]
    with pytest.raises(ValueError, match="not after"):
        Runs([2, 2], [b"a", b"b"])  # an empty run
    with pytest.raises(ValueError, match="run ends for"):
        Runs([1], [b"a", b"b"])
    assert len(Runs((), ())) == 0 and list(Runs((), ())) == []


def test_the_relay_of_a_whole_job_voting_alike_is_one_run_whatever_its_size() -> None:
    # 4 billion ranks would not fit in a list of references; as runs they are one entry,
    # and packing them back is as cheap.
    huge = (1 << 32) - 1
    back = unpack_distinct(pack_distinct(Runs([huge], [b"vote"])))
    assert isinstance(back, Runs) and len(back) == huge
    assert list(back.runs()) == [(0, huge, b"vote")]
    assert back[huge - 1] == b"vote"
    one_off = Runs([1000, 1001, 16_000], [b"ok", b"failed", b"ok"])
    back = unpack_distinct(pack_distinct(one_off))
    assert back == one_off and [s for s, _, _ in back.runs()] == [0, 1000, 1001]
    with pytest.raises(ValueError, match="at most"):
        pack_distinct(Runs([1 << 32], [b"x"]))


def _frame(items: list[bytes]) -> bytes:
    return pack_relay(items)


def test_the_leader_joins_consecutive_nodes_runs() -> None:
    layout = NodeLayout.from_ids([0, 0, 0, 1, 1, 1])
    assert layout.consecutive
    merged = merge_nodes(layout, [_frame([b"ok"] * 3), _frame([b"ok", b"bad", b"ok"])])
    assert merged == [b"ok", b"ok", b"ok", b"ok", b"bad", b"ok"]
    assert [stop for _, stop, _ in merged.runs()] == [4, 5, 6]


def test_the_leader_places_each_rank_of_interleaved_nodes() -> None:
    layout = NodeLayout.from_ids([0, 1, 0, 1])  # nodes (0, 2) and (1, 3)
    assert not layout.consecutive
    merged = merge_nodes(layout, [_frame([b"r0", b"r2"]), _frame([b"r1", b"r3"])])
    assert merged == [b"r0", b"r1", b"r2", b"r3"]


def test_the_leader_names_every_node_that_failed_or_sent_garbage() -> None:
    layout = NodeLayout.from_ids([0, 0, 1, 1, 2, 2])
    frames = [_frame([b"ok"] * 2), pack_relay(None, "node of rank(s) 2-3: timed out"),
              b"\x07garbage"]
    with pytest.raises(ValueError) as caught:
        merge_nodes(layout, frames)
    assert "node of rank(s) 2-3: timed out" in str(caught.value)
    assert "leader 4 sent a malformed message" in str(caught.value)
    with pytest.raises(ValueError, match="3 payloads for 2 ranks"):
        merge_nodes(layout, [_frame([b"ok"] * 3), _frame([b"ok"] * 2), _frame([b"ok"] * 2)])


@given(answers)
def test_by_index_is_the_mapping_from_rank_to_answer(items: list[bytes]) -> None:
    view = Runs.of(items).by_index()
    assert view == dict(enumerate(items))
    assert len(view) == len(items) and list(view) == list(range(len(items)))
    for missing in (-1, len(items), "0", True):
        assert missing not in view


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), max_size=12))
def test_spans_text_names_every_rank_of_the_spans_once(raw: list[tuple[int, int]]) -> None:
    spans = [(start, start + length) for start, length in raw]
    text = spans_text(spans)
    named: list[int] = []
    for part in filter(None, text.strip("[]").split(", ")):
        first, _, last = part.partition("-")
        named.extend(range(int(first), int(last or first) + 1))
    assert named == sorted({r for start, stop in spans for r in range(start, stop)})


def test_spans_text_shortens_long_spans_only() -> None:
    assert spans_text([(0, 2), (3, 4)]) == "[0, 1, 3]"
    assert spans_text([(0, 8), (8, 16), (17, 18)]) == "[0-15, 17]"
    assert spans_text([(0, 16_000)]) == "[0-15999]"
    assert spans_text([]) == "[]"
