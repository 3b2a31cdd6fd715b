"""What the hierarchical control plane puts on the wire, and how it reads a job's node layout:
the framing (length-prefixed, no pickle) read back strictly, the relay messages, and the
layout from ``LOCAL_WORLD_SIZE``, ``node_size=`` or ``nodes=``. In-process, no gloo."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpt_pipeline.coordination._control_plane import join_root, split_root
from ckpt_pipeline.coordination._hierarchy import (
    NodeLayout,
    node_ids,
    node_size_from_env,
    pack_distinct,
    pack_frames,
    pack_relay,
    pack_rooted,
    split_rooted,
    unpack_distinct,
    unpack_frames,
    unpack_relay,
    unpack_roots,
)

pytestmark = pytest.mark.timeout(60)

PAYLOADS = [b"", b"a", b"\x00" * 3, bytes(range(256)), b"", b"\xff" * 1000]


@given(st.lists(st.binary(max_size=300), max_size=40))
def test_frames_round_trip(items: list[bytes]) -> None:
    assert unpack_frames(pack_frames(items)) == items


def test_frames_keep_empty_payloads_and_their_order() -> None:
    packed = pack_frames(PAYLOADS)
    assert unpack_frames(packed) == PAYLOADS
    assert len(packed) == 4 * (1 + len(PAYLOADS)) + sum(map(len, PAYLOADS))


def test_every_truncated_frame_is_refused() -> None:
    packed = pack_frames(PAYLOADS)
    for end in range(len(packed)):
        with pytest.raises(ValueError):
            unpack_frames(packed[:end])


def test_a_frame_with_trailing_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="not the"):
        unpack_frames(pack_frames([b"ab"]) + b"!")


def test_a_frame_claiming_more_lengths_than_it_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="too short"):
        unpack_frames(struct.pack("<I", 1_000_000) + b"\x00" * 8)


@given(st.lists(st.sampled_from([b"", b"ok", b"\x00" * 5, b"failed: disk full"]), max_size=60))
def test_distinct_payloads_round_trip_and_equal_ones_come_back_shared(
        items: list[bytes]) -> None:
    back = unpack_distinct(pack_distinct(items))
    assert back == items
    by_value: dict[bytes, bytes] = {}
    for item in back:
        assert by_value.setdefault(item, item) is item  # one object per distinct payload


def test_a_job_voting_alike_packs_to_one_run_whatever_its_size() -> None:
    vote = b"\x85step\x07" + b"x" * 100
    sizes = {n: len(pack_distinct([vote] * n)) for n in (2, 1000, 16000)}
    assert len(set(sizes.values())) == 1 and sizes[2] == 4 + 8 + 4 + 4 + len(vote)
    one_off = [vote] * 16000
    one_off[8000] = b"error: disk full"
    assert len(pack_distinct(one_off)) == sizes[2] + 2 * 8 + 4 + len(b"error: disk full")


@pytest.mark.parametrize("data", [
    b"",
    struct.pack("<I", 5),  # five runs announced, none there
    struct.pack("<3I", 1, 0, 0) + pack_frames([b"a"]),  # a run of no items
    struct.pack("<3I", 1, 2, 1) + pack_frames([b"a"]),  # a run of a payload it lacks
    struct.pack("<3I", 1, 2, 0) + pack_frames([b"a", b"b"]),  # a payload no run uses
    pack_distinct([b"a", b"a"]) + b"!",  # trailing bytes
])
def test_a_malformed_distinct_frame_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        unpack_distinct(data)


def test_every_truncated_distinct_frame_is_refused() -> None:
    packed = pack_distinct([b"ab", b"ab", b"c", b"ab"])
    for end in range(len(packed)):
        with pytest.raises(ValueError):
            unpack_distinct(packed[:end])


@pytest.mark.parametrize("items", [[], [b""], PAYLOADS])
def test_a_relay_of_items_round_trips(items: list[bytes]) -> None:
    assert unpack_relay(pack_relay(items)) == (items, None)


def test_a_relay_of_a_failure_round_trips() -> None:
    why = "node of rank(s) 4-7: RuntimeError: Connection reset by peer \u2014 rank 5"
    assert unpack_relay(pack_relay(None, why)) == (None, why)


@pytest.mark.parametrize("data", [b"", b"\x02", b"\x07abc", b"\x00\x01"])
def test_a_malformed_relay_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        unpack_relay(data)


def test_a_relay_holds_items_or_a_failure_never_both() -> None:
    with pytest.raises(ValueError):
        pack_relay([b"x"], "and a failure")
    with pytest.raises(ValueError):
        pack_relay(None)


# ---------------------------------------------------------------- pieces for rank 0 alone

@given(st.binary(max_size=300), st.binary(max_size=300))
def test_a_payload_and_its_piece_for_rank_0_round_trip(payload: bytes, piece: bytes) -> None:
    assert split_root(join_root(payload, piece)) == (payload, piece)


@pytest.mark.parametrize("data", [b"", b"\x01\x00\x00", b"\x05\x00\x00\x00abc"])
def test_a_message_short_of_its_payload_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        split_root(data)


def test_a_frame_without_pieces_is_sent_as_it_is() -> None:
    frame = pack_relay([b"vote"] * 4)
    assert pack_rooted(frame, {}) == frame
    assert split_rooted(frame) == (frame, b"")


def test_rank_0_reads_every_nodes_pieces_beside_their_frames() -> None:
    """The leaders' frames carry their nodes' pieces after them; every leader splits them
    off in O(1) and rank 0 alone reads them, by rank."""
    layout = NodeLayout.from_ids([0, 0, 1, 1, 2, 2])
    frames = [pack_rooted(pack_relay([b"v", b"v"]), pieces) for pieces in
              ({0: b"zero"}, {}, {4: b"four", 5: b""})]
    split = [split_rooted(frame) for frame in frames]
    assert [relay for relay, _ in split] == [pack_relay([b"v", b"v"])] * 3
    assert unpack_roots(layout, [part for _, part in split]) == {0: b"zero", 4: b"four",
                                                                  5: b""}


def test_pieces_that_rank_0_cannot_read_are_left_out_not_raised() -> None:
    """A node's pieces that are malformed, or name a rank of another node, are dropped
    (logged): only rank 0 reads them, so they cannot fail an exchange on rank 0 alone."""
    layout = NodeLayout.from_ids([0, 0, 1, 1])
    foreign = split_rooted(pack_rooted(pack_relay([b"v", b"v"]), {3: b"three"}))[1]
    good = split_rooted(pack_rooted(pack_relay([b"v", b"v"]), {3: b"three"}))[1]
    assert unpack_roots(layout, [foreign, good]) == {3: b"three"}
    assert unpack_roots(layout, [b"\x09\x00", good]) == {3: b"three"}


def test_a_rooted_frame_short_of_its_relay_is_refused() -> None:
    with pytest.raises(ValueError):
        split_rooted(b"\x02\x10\x00\x00\x00abc")


# ---------------------------------------------------------------- the node layout

def test_local_world_size_makes_nodes_of_consecutive_ranks() -> None:
    assert node_ids(8, environ={"LOCAL_WORLD_SIZE": "4"}) == (0, 0, 0, 0, 1, 1, 1, 1)


def test_node_size_and_nodes_override_the_environment() -> None:
    env = {"LOCAL_WORLD_SIZE": "4"}
    assert node_ids(4, node_size=2, environ=env) == (0, 0, 1, 1)
    assert node_ids(4, nodes=[7, 3, 7, 3], environ=env) == (7, 3, 7, 3)


@pytest.mark.parametrize(("kwargs", "env", "match"), [
    ({}, {}, "LOCAL_WORLD_SIZE is not set"),
    ({}, {"LOCAL_WORLD_SIZE": "four"}, "not an integer"),
    ({}, {"LOCAL_WORLD_SIZE": "3"}, "does not divide"),
    ({"node_size": 0}, {}, "does not divide"),
    ({"nodes": [0, 0, 1]}, {}, "3 entries for 4 ranks"),
    ({"nodes": [0, 0, -1, 1]}, {}, "not a non-negative int"),
    ({"nodes": [0, 0, 1, 1], "node_size": 2}, {}, "not both"),
])
def test_an_unusable_layout_says_what_is_wrong(kwargs: dict[str, object], env: dict[str, str],
                                               match: str) -> None:
    with pytest.raises(ValueError, match=match):
        node_ids(4, environ=env, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"LOCAL_WORLD_SIZE": "x"}, None),
    ({"LOCAL_WORLD_SIZE": "16"}, None),  # one node: the flat coordinator is enough
    ({"LOCAL_WORLD_SIZE": "5"}, None),  # does not divide 16
    ({"LOCAL_WORLD_SIZE": "0"}, None),
    ({"LOCAL_WORLD_SIZE": "1"}, None),  # nodes of one rank: nothing to agree per node
    ({"LOCAL_WORLD_SIZE": "4"}, 4),
])
def test_a_job_is_split_into_nodes_only_when_local_world_size_makes_several(
        env: dict[str, str], expected: int | None) -> None:
    assert node_size_from_env(16, env) == expected


def test_a_layout_orders_nodes_by_their_leader_whatever_their_ids() -> None:
    layout = NodeLayout.from_ids([9, 2, 9, 2, 5])
    assert layout.nodes == ((0, 2), (1, 3), (4,))
    assert layout.leaders == (0, 1, 4)
    assert layout.node_of(3) == (1, 3)
