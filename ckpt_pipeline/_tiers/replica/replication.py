"""Replication for one pipeline: the copy server, the placement, the peers, and what the
stages and the restore ask of them.

Every pipeline has one (``replicas=0`` too): the lifecycle's opening agreement (``agree_open``,
with the run id) always exchanges each rank's node name and copy-server address, so that any
rank can fetch a copy at restore; ``start`` takes what it agreed. A rank runs
a copy server when the job asks for copies (``replicas > 0``) or when its root holds copies of
other ranks' shards or its own files of a step saved by another number of ranks (they may be
needed at restore: a reshard reads every saved rank's shard); a single process never does.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Mapping, Sequence

import anyio

from ..._config_groups import ReplicationConfig
from ..._format.documents import CommitRecord, encode_commit
from ..._format.scan import scan, scan_replicas
from ..._format.timeline import Lineage
from ..._logging import log
from ..._threads import in_thread
from ...coordination._agree import Opening
from ...coordination._runs import Runs
from ...errors import CheckpointError, ConfigError
from ...events import Event
from ...storage import Storage
from .fetch import fetch_shard
from .placement import Placement, place_replicas
from .push import Peer, Push
from .ranged import PeerShard
from .resend import Resend
from .server import CopyServer

__all__ = ("Replication", "local_addresses")


class Replication:
    """See the module docstring. Created by the pipeline; at open ``serve``, then (after
    the opening agreement) ``start``; ``close`` at close."""

    def __init__(self, storage: Storage, config: ReplicationConfig,
                 emit: Callable[[Event], None], *, rank: int, world_size: int) -> None:
        self.storage = storage
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.node = config.node_name or socket.gethostname()
        self._emit = emit
        self.server: CopyServer | None = None
        self.opening: Opening | None = None
        self.placement: Placement | None = None
        self.peers: dict[int, Peer] = {}
        self._resends: list[Resend] = []

    async def serve(self, limiter: anyio.CapacityLimiter) -> tuple[str, int] | None:
        """Start this rank's copy server when it needs one (see the module docstring);
        returns its address, which the opening agreement tells the other ranks (None: no
        server)."""
        config = self.config
        serve = self.world_size > 1 and (
            config.copies > 0 or await in_thread(limiter, _holds_for_others, self.storage,
                                                 self.rank, self.world_size))
        if serve:
            bind, advertise = local_addresses(config.host)
            self.server = CopyServer(self.storage, self.rank, bind_host=bind,
                                     advertise_host=advertise,
                                     timeout_s=config.timeout_s, emit=self._emit)
        return None if self.server is None else self.server.address

    def start(self, opening: Opening) -> None:
        """With what the ranks agreed at open (``agree_open``: the token, every rank's node
        and copy-server address): the peers; place the copies. A ConfigError (too few nodes)
        is raised on every rank."""
        config = self.config
        try:
            self.opening = opening
            addresses = opening.addresses  # runs: O(ranks with a server), not O(ranks)
            runs = addresses if isinstance(addresses, Runs) else Runs.of(addresses)
            self.peers = {rank: Peer(rank, opening.nodes[rank], addr[0], addr[1])
                          for start, stop, addr in runs.runs() if addr is not None
                          for rank in range(start, stop)}
            if config.copies > 0:
                self.placement = place_replicas(opening.nodes, config.copies)
                missing = [h for h in self.placement.held_by_any() if h not in self.peers]
                if missing:
                    raise ConfigError(f"rank(s) {missing} run no copy server, though the job "
                                      f"asks for {config.copies} cop(ies) of each shard",
                                      rank=self.rank,
                                      hint="pass the same ReplicationConfig(copies=...) on every rank")
            if self.server is not None:
                self.server.world_size = self.world_size
                self.server.sources = frozenset(
                    range(self.world_size) if self.placement is None
                    else self.placement.held_by(self.rank))
                self.server.token = opening.token
        except BaseException:
            self.close()
            raise
        if self.placement is not None:
            log.info("ckpt.replicate.placement", rank=self.rank, node=self.node,
                     holders=list(self.placement.holders[self.rank]),
                     holds=list(self.placement.held_by(self.rank)))

    def close(self) -> None:
        """Let the copies sent again after a restore finish (bounded by the timeout), then
        stop the copy server (which removes every copy it did not commit)."""
        resends, self._resends = self._resends, []
        for resend in resends:
            if not resend.close(self.config.timeout_s):
                log.warning("ckpt.replicate.resend_abandoned", step=resend.step,
                            rank=self.rank, holders=[p.rank for p in resend.peers],
                            timeout_s=self.config.timeout_s)
        if self.server is not None:
            self.server.close()
            self.server = None

    # ------------------------------------------------------------------ saving

    def push_for(self, step: int, save_id: str) -> Push | None:
        """The copies of this rank's shard of a save, or None without replication."""
        if self.placement is None or self.opening is None:
            return None
        holders = self.placement.holders[self.rank]
        if not holders:
            return None
        return Push([self.peers[h] for h in holders], token=self.opening.token, step=step,
                    save_id=save_id, rank=self.rank,
                    timeout_s=self.config.timeout_s)

    def settle(self, step: int, save_id: str, commit: Sequence[int],
               metrics: Mapping[str, float] | None = None,
               lineage: Lineage | None = None) -> dict[int, str]:
        """Commit the copies this rank holds of the sources in ``commit``, remove the others
        (worker thread; see ``Receptions.settle``). ``metrics`` and ``lineage``: what the
        copies' commit records carry, as the owners' do (retention ranks a held copy by them
        too; recovery tells a copy of an abandoned timeline by its lineage)."""
        if self.server is None:
            return {src: f"rank {self.rank} runs no copy server" for src in commit}
        world = self.world_size

        def record(source: int) -> bytes:
            import time

            return encode_commit(CommitRecord(step, source, world, save_id, time.time(),
                                              dict(metrics or {}), lineage))

        return self.server.receptions.settle(step, save_id, commit, record)

    def drop(self, step: int, save_id: str) -> None:
        if self.server is not None:
            self.server.receptions.drop(step, save_id)

    def forget(self, step: int, save_id: str) -> None:
        if self.server is not None:
            self.server.receptions.forget(step, save_id)

    # ------------------------------------------------------------------ restoring

    def copies_lacking(self, step: int, held: Mapping[int, Sequence[int]]
                       ) -> dict[int, tuple[int, ...]]:
        """{holder: sources} of the copies of ``step`` the placement puts on a holder that
        holds no valid copy of it (``held``: {source: ranks holding a valid copy}, from the
        restore's agreement). The same on every rank; {} without replication."""
        if self.placement is None:
            return {}
        out: dict[int, list[int]] = {}
        for source, holders in enumerate(self.placement.holders):
            for holder in holders:
                if holder not in held.get(source, ()):
                    out.setdefault(holder, []).append(source)
        return {h: tuple(sorted(srcs)) for h, srcs in sorted(out.items())}

    def resend(self, step: int, save_id: str, holders: Sequence[int]) -> None:
        """Send this rank's shard of the restored ``step`` again to ``holders``, in the
        background (``resend.py``); the events say how each ended."""
        if not holders or self.opening is None:
            return
        resend = Resend(self.storage, [self.peers[h] for h in holders if h in self.peers],
                        token=self.opening.token, step=step, save_id=save_id, rank=self.rank,
                        timeout_s=self.config.timeout_s, emit=self._emit)
        self._resends.append(resend)
        resend.start()

    def fetch(self, holder: int, step: int, save_id: str) -> tuple[int, float]:
        """Fetch this rank's shard of ``step`` from ``holder``'s copy (worker thread)."""
        peer = self.peers.get(holder)
        if peer is None or self.opening is None:
            raise CheckpointError(f"rank {holder} holds a copy but runs no copy server",
                                  step=step, rank=self.rank)
        return fetch_shard(self.storage, peer, token=self.opening.token, step=step,
                           save_id=save_id, rank=self.rank,
                           world_size=self.world_size,
                           timeout_s=self.config.timeout_s)


    def open_saved(self, holder: int, step: int, save_id: str, source: int,
                   saved_world: int) -> PeerShard:
        """Saved rank ``source``'s shard of ``step`` (saved by ``saved_world`` ranks), which
        ``holder``'s root holds as its own files or as a copy, open for a reshard's range
        reads (worker thread)."""
        peer = self.peers.get(holder)
        if peer is None or self.opening is None:
            raise CheckpointError(f"rank {holder} holds rank {source}'s shard but runs no "
                                  "copy server", step=step, rank=self.rank)
        return PeerShard(peer, token=self.opening.token, step=step, save_id=save_id,
                         source=source, world_size=saved_world,
                         timeout_s=self.config.timeout_s)


def _holds_for_others(storage: Storage, rank: int, world_size: int) -> bool:
    """Whether this root holds what other ranks may fetch at restore: copies of their shards,
    or this rank's own files of a step saved by another number of ranks (a reshard reads
    every saved rank's shard, on whichever live rank's root it is). Worker thread."""
    if scan_replicas(storage, rank):
        return True
    return any(s.valid and s.world_size != world_size for s in scan(storage, rank))


def local_addresses(configured: str | None) -> tuple[str, str]:
    """(address to listen on, address to advertise) of this rank's copy server.

    ``configured`` wins. Else the address of the interface this host uses to reach
    ``MASTER_ADDR`` (the address the job's rendezvous already uses), else the address of the
    host name, else the loopback address.
    """
    if configured:
        return configured, configured
    master = os.environ.get("MASTER_ADDR")
    candidates: list[str] = []
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))  # no packet is sent: only the route is looked up
                candidates.append(probe.getsockname()[0])
        except OSError:
            pass
    with contextlib.suppress(OSError):
        candidates.append(socket.gethostbyname(socket.gethostname()))
    for address in candidates:
        if address and address != "0.0.0.0":
            return address, address
    return "127.0.0.1", "127.0.0.1"
