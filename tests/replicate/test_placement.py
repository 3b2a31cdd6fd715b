"""Placement of shard copies: deterministic, each copy on a node of its own, loads balanced."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt_pipeline as cp
from ckpt_pipeline._tiers.replica.placement import place_replicas


def test_four_ranks_on_two_nodes_swap_their_copies_rank_for_rank() -> None:
    placement = place_replicas(["a", "a", "b", "b"], 1)
    assert placement.nodes == ((0, 1), (2, 3))
    assert placement.holders == ((2,), (3,), (0,), (1,))
    assert placement.held_by(0) == (2,)


def test_no_replicas_places_nothing() -> None:
    placement = place_replicas(["a", "b"], 0)
    assert placement.holders == ((), ())


def test_nodes_are_ordered_by_their_lowest_rank_not_by_name() -> None:
    assert place_replicas(["z", "a", "z", "a"], 1).holders == ((1,), (0,), (3,), (2,))


@pytest.mark.parametrize(("names", "replicas"), [(["a", "a"], 1), (["a", "b"], 2),
                                                 (["a", "b", "c"], 3)])
def test_more_replicas_than_other_nodes_is_a_config_error(names: list[str],
                                                          replicas: int) -> None:
    with pytest.raises(cp.ConfigError, match=rf"copies={replicas} needs {replicas + 1} nodes"):
        place_replicas(names, replicas)


@pytest.mark.parametrize("replicas", [-1, True, 1.0])
def test_a_replica_count_that_is_not_a_count_is_a_config_error(replicas: object) -> None:
    with pytest.raises(cp.ConfigError, match="is not a number of copies"):
        place_replicas(["a", "b"], replicas)  # type: ignore[arg-type]


@st.composite
def jobs(draw: st.DrawFn) -> tuple[list[str], int]:
    names = draw(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=64))
    nodes = len(set(names))
    return names, draw(st.integers(0, nodes - 1))


@settings(max_examples=200, deadline=None)
@given(jobs())
@pytest.mark.slow
def test_every_copy_is_on_another_node_than_the_shard_and_the_other_copies(
        job: tuple[list[str], int]) -> None:
    names, replicas = job
    placement = place_replicas(names, replicas)
    assert placement == place_replicas(list(names), replicas)  # deterministic
    for rank, holders in enumerate(placement.holders):
        assert len(holders) == replicas
        nodes = [names[h] for h in holders]
        assert names[rank] not in nodes
        assert len(set(nodes)) == replicas
    if len({len(ranks) for ranks in placement.nodes}) == 1:  # equal nodes: equal loads
        assert all(len(placement.held_by(r)) == replicas for r in range(len(names)))
