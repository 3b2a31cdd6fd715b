"""The control plane in two levels: the ranks of each node agree first, then the nodes' leaders.

``HierarchicalCoordinator`` keeps the contract of ``DistributedCoordinator`` (every rank's
payload, indexed by global rank, identical on every rank; a CoordinationError naming the ranks
that did not answer) and changes how an exchange travels. Each exchange runs three stages,
each by a deadline counted from the exchange's start on this rank:

1. **node**: every rank of a node sends its payload to the node's leader (its lowest rank)
   over a local socket made at construction (``_node_links.py``), and the leader receives
   them all at once (``timeout_s``);
2. **leaders**: the leaders all-gather their nodes' payloads, each distinct payload once with
   runs saying whose it is (``pack_relay``), in ceil(log2 nodes) rounds of gloo
   point-to-point messages on the leaders' group (``log_gather``; ``timeout_s + grace_s``).
   A leader whose node stage failed still takes part, with its failure in place of its
   node's payloads, so that every node learns of it at once;
3. **relay**: each leader sends the whole result so packed, or the failure, to each other
   rank of its node over its socket (``timeout_s + 2 grace_s``).

Equal payloads come back as one shared object, so that a reader decodes each distinct one
once (``_agree._exchange``): when the ranks vote alike, a rank decodes one vote, not one a
rank. Each later stage ends ``grace_s`` later than the one before, so that a failure found by
a stage's deadline still travels through the next stages in time. The good path writes nothing
to the job's store. Once a stage fails, every live rank says in the store that it reached the
exchange, and waits until all ranks did or ``fail_bound_s`` (``timeout_s + 3 grace_s``) passed
since its exchange began; the ranks that said nothing are the missing ones.

Which ranks share a node comes from ``LOCAL_WORLD_SIZE`` (torchrun sets it; node = rank //
LOCAL_WORLD_SIZE), or is given (``nodes=``, ``node_size=``). The ranks check at construction,
in the job's store, that they all see the same layout, and then that the ranks of each node
reach their leader over a local socket (so run on one host): else every rank raises
ConfigError. The only gloo group made is the leaders'.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import os
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._hostmem import byte_view
from .._logging import log
from .._threads import in_thread
from ..errors import CheckpointError, ConfigError, CoordinationError
from ._control_plane import (
    DistributedCoordinator,
    default_store,
    destroy_group,
    join_root,
    pack_frames,
    split_root,
    unpack_frames,
)
from ._node_links import NodeLinks
from ._runs import Runs

__all__ = ("HierarchicalCoordinator", "NodeLayout", "arrive", "job_coordinator", "log_gather",
           "merge_nodes", "node_ids", "node_size_from_env", "pack_distinct", "pack_frames",
           "pack_relay", "pack_rooted", "split_rooted", "store_vote", "unpack_distinct",
           "unpack_frames", "unpack_relay", "unpack_roots")

_COUNT = struct.Struct("<I")
_RELAYED, _FAILED, _ROOTED = 0, 1, 2
_REASON_CHARS = 400
"""How much of one failure's text travels to the other ranks."""


# ---------------------------------------------------------------- framing (no pickle)

def pack_distinct(items: Sequence[bytes]) -> bytes:
    """``items`` with each distinct payload once: the number of runs, each run as (how many
    items in a row, which distinct payload) in little-endian u32, then the distinct payloads
    framed (``pack_frames``), in order of first use. On the good path every rank votes alike
    and a whole job's votes are one run and one payload; each rank that differs adds a run or
    two and, where its payload is new, that payload. ``Runs`` are packed in O(runs)."""
    index: dict[bytes, int] = {}
    runs: list[int] = []  # count, index, count, index, ...
    spans = (items.runs() if isinstance(items, Runs)
             else ((at, at + 1, item) for at, item in enumerate(items)))
    for start, stop, item in spans:
        at = index.setdefault(item, len(index))
        if runs and runs[-1] == at:
            runs[-2] += stop - start
        else:
            runs += (stop - start, at)
    if len(runs) // 2 >= 1 << 32 or any(n >= 1 << 32 for n in runs[0::2]):
        raise ValueError("a frame holds at most 2**32 - 1 runs of at most 2**32 - 1 items")
    return struct.pack(f"<I{len(runs)}I", len(runs) // 2, *runs) + pack_frames(list(index))


def unpack_distinct(data: bytes) -> Runs[bytes]:
    """The items ``pack_distinct`` packed, as its runs (O(runs), whatever the number of
    items: equal payloads are one shared object); ValueError for anything else (short,
    trailing bytes, a run of no items or of a payload it lacks, a payload no run uses)."""
    if len(data) < _COUNT.size:
        raise ValueError(f"a frame of {len(data)} bytes has no run count")
    (count,) = _COUNT.unpack_from(data)
    head = _COUNT.size * (1 + 2 * count)
    if len(data) < head:
        raise ValueError(f"a frame of {len(data)} bytes is too short for {count} runs")
    runs = struct.unpack_from(f"<{2 * count}I", data, _COUNT.size)
    distinct = unpack_frames(data[head:])
    used = set(runs[1::2])
    if 0 in runs[0::2] or any(at >= len(distinct) for at in used):
        raise ValueError(f"a frame's runs ({count}) hold an empty run or a payload beyond "
                         f"its {len(distinct)}")
    if len(used) != len(distinct):
        raise ValueError(f"a frame holds {len(distinct)} payloads, {len(used)} of them used")
    stops, stop = [], 0
    for n in runs[0::2]:
        stop += n
        stops.append(stop)
    return Runs(stops, [distinct[at] for at in runs[1::2]])


def pack_relay(items: Sequence[bytes] | None, failure: str | None = None) -> bytes:
    """What a stage passes on: ``items`` (``pack_distinct``), or ``failure`` (why there are
    none)."""
    if (items is None) == (failure is None):
        raise ValueError("a relay holds either items or a failure")
    if failure is not None:
        return bytes([_FAILED]) + failure.encode("utf-8", "replace")
    assert items is not None
    return bytes([_RELAYED]) + pack_distinct(items)


def unpack_relay(data: bytes) -> tuple[Runs[bytes] | None, str | None]:
    """(items, None) or (None, failure) of a ``pack_relay`` message; ValueError otherwise."""
    if not data or data[0] not in (_RELAYED, _FAILED):
        raise ValueError("a relay message starts with its kind (0: items, 1: a failure)")
    if data[0] == _FAILED:
        return None, bytes(data[1:]).decode("utf-8", "replace")
    return unpack_distinct(data[1:]), None


def pack_rooted(frame: bytes, roots: Mapping[int, bytes]) -> bytes:
    """A leader's frame (``pack_relay``) with its node's pieces for rank 0 (``roots``, by
    rank) after it: ``frame`` itself when there are none, else the kind 2 and ``join_root``
    of the frame and the pieces (``pack_frames``: the ranks as u32, then each piece)."""
    if not roots:
        return frame
    ranks = sorted(roots)
    pieces = pack_frames([struct.pack(f"<{len(ranks)}I", *ranks), *(roots[r] for r in ranks)])
    return bytes([_ROOTED]) + join_root(frame, pieces)


def split_rooted(data: bytes) -> tuple[bytes, bytes]:
    """(the leader's frame, its pieces for rank 0 as packed, b"" for none) of a
    ``pack_rooted`` frame; the pieces are not read. ValueError when it is malformed."""
    if data[:1] != bytes([_ROOTED]):
        return data, b""
    return split_root(data[1:])


def unpack_roots(layout: NodeLayout, parts: Sequence[bytes]) -> dict[int, bytes]:
    """Rank 0: every rank's piece for rank 0, from each node's packed pieces
    (``split_rooted``, in the order of ``layout.nodes``). A node's pieces that are malformed,
    or name a rank of another node, are left out and logged: they are rank 0's alone to
    read, so they never fail the exchange (which would fail on rank 0 only)."""
    roots: dict[int, bytes] = {}
    for node, packed in zip(layout.nodes, parts, strict=True):
        if not packed:
            continue
        try:
            head, *items = unpack_frames(packed)
            ranks = struct.unpack(f"<{len(items)}I", head)
            if not set(ranks) <= set(node):
                raise ValueError(f"pieces of ranks {list(ranks)[:8]} outside the node")
        except (ValueError, struct.error) as exc:
            log.error("ckpt.control.root_parts_malformed", leader=node[0], error=str(exc))
            continue
        roots.update(zip(ranks, items, strict=True))
    return roots


# ---------------------------------------------------------------- which ranks share a node

@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Which ranks share a node: ``nodes`` in the order of their leaders (each node's lowest
    rank), each node's ranks ascending."""

    nodes: tuple[tuple[int, ...], ...]
    consecutive: bool = field(init=False, compare=False, repr=False)
    """Whether the nodes, in order, hold ranks 0, 1, 2, ... one after the other."""

    def __post_init__(self) -> None:
        at, consecutive = 0, True
        for node in self.nodes:
            consecutive = consecutive and node == tuple(range(at, at + len(node)))
            at += len(node)
        object.__setattr__(self, "consecutive", consecutive)

    @classmethod
    def from_ids(cls, ids: Sequence[int]) -> NodeLayout:
        """The layout of one node id per rank."""
        members: dict[int, list[int]] = {}
        for rank, node in enumerate(ids):
            members.setdefault(node, []).append(rank)
        return cls(tuple(sorted(tuple(m) for m in members.values())))

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(node[0] for node in self.nodes)

    def node_of(self, rank: int) -> tuple[int, ...]:
        return next(node for node in self.nodes if rank in node)


def node_ids(world_size: int, *, nodes: Sequence[int] | None = None,
             node_size: int | None = None,
             environ: Mapping[str, str] = os.environ) -> tuple[int, ...]:
    """The node of every rank: ``nodes`` (one id per rank), else ``node_size`` consecutive
    ranks a node, else ``LOCAL_WORLD_SIZE`` of them. ValueError says what is wrong."""
    if nodes is not None and node_size is not None:
        raise ValueError("give nodes= or node_size=, not both")
    if nodes is not None:
        ids = tuple(nodes)
        if len(ids) != world_size:
            raise ValueError(f"nodes= has {len(ids)} entries for {world_size} ranks")
        if not all(type(i) is int and 0 <= i < 1 << 62 for i in ids):
            raise ValueError("nodes= holds a node id that is not a non-negative int")
        return ids
    if node_size is None:
        text = environ.get("LOCAL_WORLD_SIZE")
        if text is None:
            raise ValueError("LOCAL_WORLD_SIZE is not set, and neither nodes= nor node_size= "
                             "was given")
        try:
            node_size = int(text)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE={text!r} is not an integer") from None
    if type(node_size) is not int or node_size < 1 or world_size % node_size:
        raise ValueError(f"a node size of {node_size!r} does not divide the {world_size} ranks")
    return tuple(rank // node_size for rank in range(world_size))


def node_size_from_env(world_size: int, environ: Mapping[str, str] = os.environ) -> int | None:
    """``LOCAL_WORLD_SIZE`` when it is set, divides ``world_size`` and makes more than one
    node of more than one rank; else None. (Nodes of one rank would gain nothing: the leaders'
    stage would be the flat all-gather. Some launchers set LOCAL_WORLD_SIZE=1 by default.)"""
    try:
        size = int(environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return None
    return size if 1 < size < world_size and world_size % size == 0 else None


def job_coordinator(*, timeout_s: float) -> DistributedCoordinator | HierarchicalCoordinator:
    """The coordinator a pipeline makes for an initialized torch.distributed job: per node
    first when ``LOCAL_WORLD_SIZE`` makes more than one node (``node_size_from_env``) on every
    rank alike, else flat.

    The ranks decide together: each says what ``LOCAL_WORLD_SIZE`` makes of the job in the
    job's store (``store_vote``: a few store operations a rank, no gloo group of every rank);
    a job without a store gets the flat one. A rank that decided alone could make
    the hierarchical groups while another made the flat one (a launcher that sets another
    node size on some ranks), and their collectives would not match."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = node_size_from_env(world)
    store = default_store(dist)
    if store is None:  # no store to agree in: the flat control plane works everywhere
        return DistributedCoordinator(timeout_s=timeout_s)
    try:
        differ = store_vote(store, f"ckpt_pipeline/job/{next(_VOTES)}", rank, world,
                            str(mine or 0).encode(), timeout_s)
    except Exception as exc:  # TimeoutError names the ranks; else the store is gone
        raise CoordinationError(f"open: the ranks could not agree on the control plane "
                                f"({_short(exc)})", rank=rank,
                                hint="every rank must open the pipeline at the same "
                                     "point; restart the job") from exc
    if differ is None and mine is not None:
        return HierarchicalCoordinator(node_size=mine, timeout_s=timeout_s)
    if differ is not None:
        _sizes_differ(rank, [v.decode(errors="replace") for v in differ])
    return DistributedCoordinator(timeout_s=timeout_s)


def _sizes_differ(rank: int, sizes: Sequence[str]) -> None:
    log.warning("ckpt.control.node_sizes_differ", rank=rank, sizes=sorted(sizes),
                hint="LOCAL_WORLD_SIZE differs between the ranks: the flat control plane "
                     "is used")


_VOTES = itertools.count()
"""Numbers the store votes of this process: every rank makes them in the same order (each
where every rank opens a pipeline or makes a coordinator), so a vote has the same key on every
rank. The job's store is one of this run (torchrun scopes it by attempt)."""


def store_vote(store: Any, key: str, rank: int, world: int, value: bytes, timeout_s: float
               ) -> dict[bytes, list[int]] | None:
    """Whether every rank put the same ``value`` under ``key`` in the job's store: None when
    they did, at four store operations a rank (a count of its value, then ``arrive``);
    otherwise {value: its ranks}, read from each rank's entry (O(ranks), on this path only).
    TimeoutError, naming the ranks that did not come, when some rank did not within
    ``timeout_s``, or saying that the store stopped answering."""
    digest = hashlib.blake2b(value, digest_size=8).hexdigest()
    store.add(f"{key}/value/{digest}", 1)  # before it counts as come: the last one sees all
    try:
        missing = arrive(store, key, rank, world, value, timeout_s)
    except Exception as exc:
        raise TimeoutError("the job's store (rank 0's) stopped answering: rank 0 may be "
                           "gone") from exc
    if missing:
        raise TimeoutError(f"rank(s) {_ranks_text(missing)} did not come within "
                           f"{timeout_s:.0f} s")
    if store.add(f"{key}/value/{digest}", 0) == world:
        return None
    seen: dict[bytes, list[int]] = {}
    for r in range(world):
        seen.setdefault(bytes(store.get(f"{key}/rank/{r}")), []).append(r)
    return seen


def arrive(store: Any, key: str, rank: int, world: int, entry: bytes, timeout_s: float
           ) -> list[int]:
    """Say in the job's store that this rank came to ``key`` (its ``entry``, and a count of
    the ranks come), then wait, with one ``wait``, until every rank did or ``timeout_s``
    passed: [] when every rank came, else the ranks with no entry. Raises what the store
    raises when it does not answer."""
    everyone = f"{key}/all"
    store.set(f"{key}/rank/{rank}", entry)
    if store.add(f"{key}/come", 1) >= world:
        store.set(everyone, b"1")
        return []
    try:
        store.wait([everyone], datetime.timedelta(seconds=max(timeout_s, 0.1)))
        return []
    except Exception:  # the wait ran out: somebody never came (or the store is gone)
        pass
    return [r for r in range(world) if not store.check([f"{key}/rank/{r}"])]


# ---------------------------------------------------------------- the coordinator

class _StageFailed(Exception):
    """A stage of an exchange failed here, or another rank's failure was relayed here."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage


class HierarchicalCoordinator:
    """All-gathers per node first, then across the nodes' leaders (see the module docstring).

    Construct it on every rank at the same point, after ``init_process_group`` (making its
    groups is a collective of the default group). ``nodes``: the node id of every rank;
    ``node_size``: ranks per node, consecutive; neither: ``LOCAL_WORLD_SIZE``. ``timeout_s``
    bounds how late a rank may come to an exchange; ``grace_s`` (default: a tenth of it,
    between 1 and 30 s) is the margin each later stage and the naming of missing ranks add.
    A layout the ranks disagree on is a ConfigError on every rank.
    """

    def __init__(self, *, nodes: Sequence[int] | None = None, node_size: int | None = None,
                 timeout_s: float = 300.0, grace_s: float | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialized",
                              hint="call torch.distributed.init_process_group first, or use "
                                   "LocalCoordinator for a single process")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r} must be positive")
        if grace_s is None:
            grace_s = min(max(1.0, timeout_s / 10), 30.0)
        if not grace_s > 0:
            raise ConfigError(f"grace_s={grace_s!r} must be positive")
        self._dist = dist
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.layout, name = self._agree_layout(nodes, node_size)
        self._keys = f"ckpt_pipeline/{name}"
        self._node = self.layout.node_of(self.rank)
        self._leaders = self.layout.leaders
        self._leader = self._node[0]
        self._leaders_group: Any = None
        self._store = default_store(dist)
        self._links = self._link_node()
        try:  # every wait has a deadline of its own: the timeout only bounds the group's setup
            self._leaders_group = self._group_of(self._leaders, self.timeout_s + self.grace_s)
        except BaseException:
            self.close()
            raise
        self._seq = 0
        self._broken: str | None = None
        self._lock = threading.Lock()

    @property
    def fail_bound_s(self) -> float:
        """How long after an exchange began a live rank raises, when one rank dies or hangs."""
        return self.timeout_s + 3 * self.grace_s

    def channel(self, name: str) -> HierarchicalCoordinator:
        """An independent coordinator of the same ranks and layout (the memory tier's), made
        on every rank at the same point."""
        ids = [0] * self.world_size
        for index, node in enumerate(self.layout.nodes):
            for rank in node:
                ids[rank] = index
        return HierarchicalCoordinator(nodes=ids, timeout_s=self.timeout_s,
                                       grace_s=self.grace_s)

    def close(self) -> None:
        """Destroy this coordinator's gloo group and close its node's sockets; later
        exchanges raise. Safe to call twice; never raises."""
        group, self._leaders_group = self._leaders_group, None
        links, self._links = self._links, None
        if self._broken is None:
            self._broken = "the coordinator was closed"
        if links is not None:
            links.close()
        if group is not None:
            destroy_group(self._dist, group)

    # ------------------------------------------------------------ an exchange

    async def all_gather(self, payload: bytes, *, what: str, step: int | None = None
                         ) -> Runs[bytes]:
        result, _ = await self._exchange(payload, None, what=what, step=step)
        return result

    async def all_gather_root(self, payload: bytes, for_root: bytes, *, what: str,
                              step: int | None = None) -> tuple[Runs[bytes], dict[int, bytes]]:
        """``all_gather``, and on rank 0 every rank's non-empty ``for_root`` by rank ({} on
        the other ranks). Those parts travel to the leader with the payload, between the
        leaders beside the node's frame (``pack_rooted``: never read, only passed on), and
        are not relayed: rank 0, a leader, keeps them. No rank but rank 0 decodes them."""
        return await self._exchange(payload, for_root, what=what, step=step)

    async def _exchange(self, payload: bytes, for_root: bytes | None, *, what: str,
                        step: int | None) -> tuple[Runs[bytes], dict[int, bytes]]:
        with self._lock:
            self._seq += 1
            seq = self._seq
        if self._broken is not None:
            raise CoordinationError(
                f"{what}: the control plane failed earlier ({self._broken})", step=step,
                rank=self.rank, hint="restart the job; checkpoints committed so far are intact")
        started = time.monotonic()
        try:
            return await in_thread(None, self._gather, payload, for_root)
        except Exception as exc:
            failed_after = time.monotonic() - started
            stage = exc.stage if isinstance(exc, _StageFailed) else "exchange"
            self._broken = f"{what} at step {step}: the {stage} stage failed"
            missing = await in_thread(None, self._missing, seq, started)
            who = ("the exchange failed (the job's store, served by rank 0, did not answer: "
                   "rank 0 may be gone)" if missing is None
                   else f"rank(s) {_ranks_text(missing)} did not take part" if missing
                   else "the exchange failed")
            raise CoordinationError(
                f"{what}: {who} (the {stage} stage failed after {failed_after:.1f} s: "
                f"{_short(exc)})", step=step, rank=self.rank,
                hint="a rank died or is stuck; restart the job, it resumes from the newest "
                     "checkpoint committed on every rank", ranks=tuple(missing or ())) from exc

    def _gather(self, payload: bytes, for_root: bytes | None
                ) -> tuple[Runs[bytes], dict[int, bytes]]:
        """The three stages, on this rank's part of the layout (``for_root``: see
        ``all_gather_root``; None for a plain exchange). Raises _StageFailed, or the error of
        the stage that failed here."""
        begun = time.monotonic()
        ours: list[bytes] | None = None
        roots: dict[int, bytes] | None = None if for_root is None else {}
        failure = None
        try:
            ours = self._into_node_leader(
                payload if for_root is None else join_root(payload, for_root),
                begun + self.timeout_s)
            if ours is not None and for_root is not None:
                ours, roots = self._split_roots(ours)
        except Exception as exc:
            ours, failure = None, f"node of rank(s) {_ranks_text(self._node)}: {_short(exc)}"
        relay_by = begun + self.timeout_s + 2 * self.grace_s
        if self.rank != self._leader:
            if failure is not None:
                raise _StageFailed("node", failure)
            try:
                (relayed,) = self._node_links().receive_all((self._leader,), relay_by)
            except Exception as exc:
                raise _StageFailed("relay", _short(exc)) from exc
            return self._result(relayed), {}
        relayed, result, why, roots = self._across_nodes(
            ours, failure, begun + self.timeout_s + self.grace_s, roots)
        # Every other rank of the node waits for the relay, the failure included: a rank that
        # is gone fails its send alone.
        lost = self._to_node(relayed, relay_by)
        if result is None:
            raise _StageFailed("node" if failure is not None else "leaders", why or "")
        if lost is not None and failure is None:
            raise _StageFailed("relay", lost)
        return result, roots or {}

    def _split_roots(self, messages: list[bytes]) -> tuple[list[bytes], dict[int, bytes]]:
        """The leader: its node's ``join_root`` messages as (payloads, {rank: non-empty part
        for rank 0}). A malformed message fails the node stage, naming its rank."""
        payloads: list[bytes] = []
        roots: dict[int, bytes] = {}
        for rank, message in zip(self._node, messages, strict=True):
            try:
                payload, part = split_root(message)
            except ValueError as exc:
                raise ValueError(f"rank {rank} sent a malformed message ({exc})") from exc
            payloads.append(payload)
            if part:
                roots[rank] = part
        return payloads, roots

    def _to_node(self, relayed: bytes, deadline: float) -> str | None:
        """The leader's relay to each other rank of its node; why a send failed (the first),
        or None."""
        if len(self._node) == 1:
            return None
        links = self._node_links()
        lost = None
        for rank in self._node[1:]:
            try:
                links.send(rank, relayed, deadline)
            except Exception as exc:
                lost = lost or f"rank {rank}: {_short(exc)}"
        return lost

    def _into_node_leader(self, payload: bytes, deadline: float) -> list[bytes] | None:
        """The node stage: every rank of the node sends its payload to the leader over its
        local socket (``_node_links.py``), and the leader receives them all at once. The
        node's payloads in node order on the leader, None on the others."""
        if len(self._node) == 1:  # a node of one rank: this one
            return [payload]
        links = self._node_links()
        if self.rank != self._leader:
            links.send(self._leader, payload, deadline)
            return None
        return [payload, *links.receive_all(self._node[1:], deadline)]

    def _node_links(self) -> NodeLinks:
        links = self._links
        if links is None:
            raise RuntimeError("the coordinator was closed")
        return links

    def _across_nodes(self, ours: list[bytes] | None, failure: str | None, deadline: float,
                      roots: dict[int, bytes] | None
                      ) -> tuple[bytes, Runs[bytes] | None, str | None, dict[int, bytes]]:
        """The leaders' stage: (what this leader relays to its node, the result or None, why
        not, and on rank 0 every rank's part for rank 0). ``roots``: this node's parts for
        rank 0, None in a plain exchange (whose frames are then not looked at for parts).
        Never raises: whatever happens, the node hears of it."""
        try:
            frame = pack_relay(ours, failure)
            if roots is not None:
                frame = pack_rooted(frame, roots if ours is not None else {})
            frames = [frame]
            if self._leaders_group is not None:
                frames = log_gather(self._dist, self._leaders_group, self._leaders, frame,
                                    deadline - time.monotonic())
            relays, parts = frames, None
            if roots is not None:
                split = [split_rooted(f) for f in frames]
                relays, parts = [relay for relay, _ in split], [part for _, part in split]
        except Exception as exc:
            why = f"leaders: {_short(exc)}"
            return pack_relay(None, why), None, why, {}
        try:
            result = merge_nodes(self.layout, relays)
        except ValueError as exc:
            why = str(exc)
            return pack_relay(None, why), None, why, {}
        return pack_relay(result), result, None, (
            unpack_roots(self.layout, parts) if self.rank == 0 and parts is not None else {})

    def _result(self, relayed: bytes) -> Runs[bytes]:
        try:
            items, failure = unpack_relay(relayed)
        except ValueError as exc:
            raise _StageFailed("relay", f"leader {self._leader} sent a malformed message "
                                        f"({exc})") from exc
        if items is None:
            raise _StageFailed("leaders", failure or "")
        if len(items) != self.world_size:
            raise _StageFailed("relay", f"leader {self._leader} relayed {len(items)} payloads "
                                        f"for {self.world_size} ranks")
        return items

    def _missing(self, seq: int, started: float) -> list[int] | None:
        """The ranks that never reached exchange ``seq``: every live rank says it did, in the
        job's store, and waits for the others until ``fail_bound_s`` after ``started``. None
        when the store does not answer (rank 0 serves it), [] without a store."""
        if self._store is None:
            return []
        try:
            return arrive(self._store, f"{self._keys}/reached/{seq}", self.rank,
                          self.world_size, b"1", started + self.fail_bound_s - time.monotonic())
        except Exception:
            return None

    # ------------------------------------------------------------ construction

    def _agree_layout(self, nodes: Sequence[int] | None, node_size: int | None
                      ) -> tuple[NodeLayout, str]:
        """Every rank's node, checked in the job's store (``store_vote``): every rank must
        see the same layout, or every rank raises ConfigError. Also a name, the same on every
        rank, which keys this coordinator's store entries."""
        reason = None
        try:
            ids = node_ids(self.world_size, nodes=nodes, node_size=node_size)
        except ValueError as exc:
            ids, reason = (), str(exc)
        digest = int.from_bytes(
            hashlib.blake2b(struct.pack(f"<{len(ids)}q", *ids), digest_size=8).digest(),
            "little", signed=True)
        store = default_store(self._dist)
        if store is None:
            raise ConfigError("the per-node control plane checks its layout in the job's "
                              "store, and this job has none (torch.distributed's default "
                              "store could not be had)", rank=self.rank,
                              hint="use cp.DistributedCoordinator (the flat control plane)")
        n = next(_VOTES)
        name = f"hierarchy-{n}"
        try:
            differ = store_vote(store, f"ckpt_pipeline/layout/{n}", self.rank, self.world_size,
                                b"unset" if reason is not None else str(digest).encode(),
                                self.timeout_s)
        except Exception as exc:  # TimeoutError names the ranks; else the store is gone
            raise CoordinationError(
                f"the control plane's node layout could not be checked ({_short(exc)})",
                rank=self.rank, hint="every rank must construct the coordinator at the "
                                     "same point") from exc
        if differ is None:  # every rank alike: a layout, or none on any rank
            differ = {b"unset" if reason is not None else b"": list(range(self.world_size))}
        unset = differ.pop(b"unset", [])
        views = differ
        if unset:
            raise ConfigError(
                f"rank(s) {_ranks_text(unset)} have no node layout for the control plane"
                + (f": {reason}" if reason else ""), rank=self.rank,
                hint="set LOCAL_WORLD_SIZE (torchrun does), or pass nodes= or node_size= "
                     "alike on every rank")
        if len(views) > 1:
            groups = " | ".join(_ranks_text(ranks) for ranks in views.values())
            raise ConfigError(
                f"the ranks disagree on which ranks share a node: {len(views)} layouts, seen "
                f"by ranks {groups}", rank=self.rank,
                hint="give every rank the same LOCAL_WORLD_SIZE, nodes= or node_size=")
        return NodeLayout.from_ids(ids), name

    def _link_node(self) -> NodeLinks | None:
        """This rank's links within its node (``NodeLinks``; None for a node of one rank),
        made on every rank, then checked in the job's store (``store_vote``): where any rank
        could not make its links, every rank raises ConfigError, naming what failed where."""
        failure: str | None = None
        links = None
        deadline = time.monotonic() + self.timeout_s
        try:
            if len(self._node) > 1:
                links = NodeLinks(store=self._store, key=f"{self._keys}/node/{self._leader}",
                                  rank=self.rank, node=self._node, deadline=deadline)
        except CheckpointError as exc:
            failure = exc.message
        except Exception as exc:
            failure = _short(exc)
        try:
            differ = store_vote(self._store, f"{self._keys}/links", self.rank, self.world_size,
                                (failure or "").encode(), self.timeout_s)
        except Exception as exc:  # TimeoutError names the ranks; else the store is gone
            if links is not None:
                links.close()
            raise CoordinationError(
                f"the control plane's node links could not be checked ({_short(exc)})"
                + (f"; here: {failure}" if failure else ""), rank=self.rank,
                hint="every rank must construct the coordinator at the same point") from exc
        if differ is None and failure is None:
            return links
        if links is not None:
            links.close()
        if differ is None:  # every rank alike, and this one failed: so did they all
            differ = {(failure or "").encode(): list(range(self.world_size))}
        failed = {value.decode(errors="replace"): ranks for value, ranks in differ.items()
                  if value}
        listing = "; ".join(f"rank(s) {_ranks_text(ranks)}: {why}"
                            for why, ranks in failed.items())
        raise ConfigError(f"the per-node control plane could not link the ranks of each node "
                          f"({listing})", rank=self.rank,
                          hint="the ranks given as one node must run on one host: check "
                               "LOCAL_WORLD_SIZE, nodes= or node_size=; or use "
                               "cp.DistributedCoordinator (the flat control plane)")

    def _group_of(self, ranks: Sequence[int], timeout_s: float) -> Any:
        """A gloo group of ``ranks``, made by every rank (torch requires it): the group on
        its members, None on the others and for a single rank."""
        if len(ranks) == 1:
            return None
        group = self._dist.new_group(ranks=list(ranks), backend="gloo",
                                     timeout=datetime.timedelta(seconds=timeout_s))
        return group if self.rank in ranks else None


def merge_nodes(layout: NodeLayout, frames: Sequence[bytes]) -> Runs[bytes]:
    """Every rank's payload, from each node's ``pack_relay`` frame (in the order of
    ``layout.nodes``). Equal frames (nodes whose ranks voted alike) are read once. When each
    node's ranks follow one another (consecutive ranks a node, as ``LOCAL_WORLD_SIZE`` makes
    them) the nodes' runs are joined in O(nodes + runs); otherwise each rank's payload is put
    in its place (O(ranks)). ValueError names every node whose leader relayed a failure or a
    malformed frame."""
    parts: list[Runs[bytes]] = []
    failures: list[str] = []
    read: dict[tuple[bytes, int], tuple[Runs[bytes] | None, str, bool]] = {}
    for node, frame in zip(layout.nodes, frames, strict=True):
        key = (frame, len(node))
        got = read.get(key)
        if got is None:  # (items, why not, whether the frame was malformed)
            try:
                items, failed = unpack_relay(frame)
                if items is not None and len(items) != len(node):
                    raise ValueError(f"{len(items)} payloads for {len(node)} ranks")
                got = read[key] = (items, failed or "", False)
            except ValueError as exc:
                got = read[key] = (None, str(exc), True)
        items, why, malformed = got
        if items is not None:
            parts.append(items)
        else:
            failures.append(f"leader {node[0]} sent a malformed message ({why})" if malformed
                            else why)
    if failures:
        raise ValueError("; ".join(failures))
    if layout.consecutive:
        return Runs.join(parts)
    result: list[bytes] = [b""] * sum(len(node) for node in layout.nodes)
    for node, items in zip(layout.nodes, parts, strict=True):
        for rank, item in zip(node, items, strict=True):
            result[rank] = item
    return Runs.of(result)


def log_gather(dist: Any, group: Any, members: Sequence[int], payload: bytes,
               timeout_s: float) -> list[bytes]:
    """Every member's ``payload``, in the order of ``members`` (the global ranks of gloo
    ``group``), in ceil(log2 n) rounds (Bruck's all-gather) rather than the n - 1 steps of
    gloo's ring: in round r each member sends the payloads it holds of itself and the
    2^r - 1 members after it to the member 2^r before it, and receives those of the member
    2^r after it. Every wait ends by ``timeout_s`` after the call (TimeoutError, or gloo's
    error of a peer that went away)."""
    n = len(members)
    me = members.index(dist.get_rank())
    deadline = time.monotonic() + timeout_s
    held = [payload]  # the payloads of me, me + 1, ... (mod n)
    step, round_ = 1, 0
    while step < n:
        out = pack_frames(held[:min(step, n - step)])
        held += unpack_frames(_swap(dist, group, out, members[(me - step) % n],
                                    members[(me + step) % n], 2 * round_, deadline))
        step, round_ = 2 * step, round_ + 1
    return [held[(i - me) % n] for i in range(n)]


def _swap(dist: Any, group: Any, out: bytes, to: int, source: int, tag: int,
          deadline: float) -> bytes:
    """Send ``out`` to rank ``to`` and receive what rank ``source`` sends this way, by
    ``deadline``."""
    sends = _send(dist, group, out, to, tag)
    (got,) = _receive_all(dist, group, (source,), tag, deadline)
    for work in sends:
        _wait(work, deadline)
    return got


_FRAME_BYTES = 1024
"""A message's first frame, always this size: its length (u32, little-endian) and its first
1,020 bytes. A longer message sends the rest as a second frame of exactly that size (tag +
1). A vote (about 100 bytes) is thus one gloo message where a length and then the bytes were
two: gloo posts each receive before the sender may send, so every message costs a round trip,
and on the 2-core VM one frame made a node's exchange 1.5-2x faster (when the node stage
still went over gloo; it is the leaders' stage, ``log_gather``, that sends these now)."""


def _send(dist: Any, group: Any, out: bytes, to: int, tag: int) -> list[Any]:
    """Start sending ``out`` to rank ``to``: its first frame (tag ``tag``), and what does
    not fit in it (tag ``tag + 1``); the works to wait for."""
    head = _FRAME_BYTES - _COUNT.size
    first = bytearray(_FRAME_BYTES)
    _COUNT.pack_into(first, 0, len(out))
    first[_COUNT.size:_COUNT.size + min(len(out), head)] = out[:head]
    works = [dist.isend(torch.frombuffer(first, dtype=torch.uint8), dst=to, group=group,
                        tag=tag)]
    if len(out) > head:
        rest = torch.frombuffer(bytearray(out[head:]), dtype=torch.uint8)
        works.append(dist.isend(rest, dst=to, group=group, tag=tag + 1))
    return works


def _receive_all(dist: Any, group: Any, sources: Sequence[int], tag: int,
                 deadline: float) -> list[bytes]:
    """What each of ``sources`` sends this rank with ``_send``, received at once (every first
    frame, then the rest of the longer ones), by ``deadline``."""
    head = _FRAME_BYTES - _COUNT.size
    frames = [torch.empty(_FRAME_BYTES, dtype=torch.uint8) for _ in sources]
    works = [dist.irecv(frame, src=source, group=group, tag=tag)
             for frame, source in zip(frames, sources, strict=True)]
    for work in works:
        _wait(work, deadline)
    firsts = [bytes(byte_view(frame, 0, _FRAME_BYTES)) for frame in frames]
    sizes = [_COUNT.unpack_from(first)[0] for first in firsts]
    rests = {at: torch.empty(size - head, dtype=torch.uint8)
             for at, size in enumerate(sizes) if size > head}
    works = [dist.irecv(rest, src=sources[at], group=group, tag=tag + 1)
             for at, rest in rests.items()]
    for work in works:
        _wait(work, deadline)
    return [first[_COUNT.size:_COUNT.size + min(size, head)]
            + (bytes(byte_view(rests[at], 0, size - head)) if at in rests else b"")
            for at, (first, size) in enumerate(zip(firsts, sizes, strict=True))]


def _wait(work: Any, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0 or not work.wait(timeout=datetime.timedelta(seconds=left)):
        raise TimeoutError(f"a peer did not answer in time ({max(left, 0.0):.1f} s left)")


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if not isinstance(exc, _StageFailed) else str(exc)
    text = " ".join(text.split())
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."


def _ranks_text(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2, 5, 7-8``."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
