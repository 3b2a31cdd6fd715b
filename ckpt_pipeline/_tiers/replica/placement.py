"""Which ranks hold the copies of each rank's shard: deterministic, each copy on another node.

Nodes are ordered by the lowest rank on each (not by name, so the order does not depend on how
hosts are named), and each node's ranks in increasing order. The k-th copy (k = 1 ..
``replicas``) of the shard of the rank at position ``j`` of node ``i`` goes to node
``(i + k) mod N``, to the rank at position ``j mod size`` of that node. The copies of one shard
are thus on ``replicas`` distinct nodes, none of them its own, whenever ``replicas <= N - 1``;
with nodes of equal size every rank holds exactly ``replicas`` copies.

Example: 4 ranks on 2 nodes (a: ranks 0, 1; b: ranks 2, 3), ``replicas=1``: rank 0's copy is on
rank 2, rank 1's on rank 3, rank 2's on rank 0, rank 3's on rank 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ...errors import ConfigError

__all__ = ("Placement", "place_replicas")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the copies of every rank's shard go, and which copies each rank holds."""

    nodes: tuple[tuple[int, ...], ...]
    """The ranks of each node, nodes ordered by their lowest rank."""
    holders: tuple[tuple[int, ...], ...]
    """For each rank, the ranks that hold copies of its shard (the k-th copy k-th)."""
    _held: Mapping[int, tuple[int, ...]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        held: dict[int, list[int]] = {}
        for source, holders in enumerate(self.holders):
            for holder in holders:
                held.setdefault(holder, []).append(source)
        object.__setattr__(self, "_held", {h: tuple(s) for h, s in held.items()})

    def held_by_any(self) -> tuple[int, ...]:
        """Every rank that holds some copy, in increasing order."""
        return tuple(sorted(self._held))

    def held_by(self, rank: int) -> tuple[int, ...]:
        """The ranks whose shards ``rank`` holds copies of, in increasing order (O(1): the
        placement's inverse, made once)."""
        return self._held.get(rank, ())


def place_replicas(node_names: Sequence[str], replicas: int) -> Placement:
    """The placement for a job whose rank ``r`` runs on node ``node_names[r]``.

    Raises ConfigError when ``replicas`` is negative or larger than the number of other nodes.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ConfigError(f"copies={replicas!r} is not a number of copies",
                          hint="use 0 (no copies, the default) or a positive int")
    by_node: dict[str, list[int]] = {}
    for rank, name in enumerate(node_names):
        by_node.setdefault(name, []).append(rank)
    nodes = tuple(tuple(ranks) for ranks in by_node.values())  # first seen = lowest rank
    count = len(nodes)
    if replicas > count - 1:
        listing = ", ".join(f"{name!r} ({len(ranks)} rank(s))"
                            for name, ranks in list(by_node.items())[:8])
        raise ConfigError(
            f"copies={replicas} needs {replicas + 1} nodes, this job runs on {count}: "
            f"{listing}{', ...' if count > 8 else ''}",
            hint=f"use ReplicationConfig(copies={max(count - 1, 0)}) or less, or give ranks on "
                 "different machines different node names (ReplicationConfig(node_name=))")
    where = {rank: (i, j) for i, ranks in enumerate(nodes) for j, rank in enumerate(ranks)}
    holders = []
    for rank in range(len(node_names)):
        i, j = where[rank]
        targets = []
        for k in range(1, replicas + 1):
            node = nodes[(i + k) % count]
            targets.append(node[j % len(node)])
        holders.append(tuple(targets))
    return Placement(nodes, tuple(holders))
