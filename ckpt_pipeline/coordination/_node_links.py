"""The node stage's links: each rank of a node connected to the node's leader by a local socket.

The per-node control plane (``_hierarchy.py``) sends every rank's payload to its node's leader
and the leader's relay back. Those messages never leave the host, so they travel over Unix
domain stream sockets rather than gloo: one ``sendall`` and one ``recv`` a message, a few
microseconds on the host, where a gloo point-to-point message costs the leader a round trip
through gloo's own threads (about 50 us measured on the 16-core GPU host, ``docs/scale.md``),
and no gloo group per node is made at construction (each was a collective of every rank).

At construction the leader listens on a fresh address (Linux: the abstract namespace, no file;
elsewhere a socket file in the temporary directory, removed at ``close``), says it in the
job's store, and accepts one connection from each other rank of its node, which says its rank
first. A rank that cannot connect says so in the store, so that its leader stops waiting, and
raises ``ConfigError``: the ranks given as one node are then not on one host (or not in one
network namespace), which is what connecting checks.

A message is its length (u32, little-endian) and its bytes. Every wait has a deadline; a peer
that went away shows as its connection closing, which fails the wait at once instead of at
the deadline. A forked child (a DataLoader worker, say) would hold the connections open after
its parent died, so an ``os.register_at_fork`` hook closes the child's copies (the parent's
stay open: a connection closes with its last descriptor).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import selectors
import socket
import struct
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError

__all__ = ("NodeLinks",)

_LENGTH = struct.Struct("<I")
_ACCEPT_POLL_S = 0.2
"""How often a leader waiting for its node's connections looks in the store for a rank that
could not connect."""


class NodeLinks:
    """This rank's links within its node ``node`` (its ranks, the leader first): the leader's
    connection to each other rank, or this rank's to the leader. Made on every rank of the
    node at the same point; ``close`` when done."""

    def __init__(self, *, store: Any, key: str, rank: int, node: Sequence[int],
                 deadline: float) -> None:
        self.rank = rank
        self.leader = node[0]
        self._path: str | None = None
        self._peers: dict[int, socket.socket] = {}
        self._early: dict[int, bytearray] = {}
        """Bytes a peer sent beyond the message last read from it (the start of its next)."""
        _track(self)
        try:
            if rank == self.leader:
                self._accept(store, key, tuple(node[1:]), deadline)
            else:
                self._connect(store, key, deadline)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ construction

    def _accept(self, store: Any, key: str, members: tuple[int, ...], deadline: float
                ) -> None:
        token = secrets.token_hex(8)
        if sys.platform.startswith("linux"):
            address = f"\0ckpt_pipeline-{token}"
        else:
            address = self._path = os.path.join(tempfile.gettempdir(), f"ckpt-{token}.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address)
            listener.listen(len(members))
            store.set(f"{key}/address", address.encode())
            waiting = set(members)
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank(s) {sorted(waiting)} of the node did not connect "
                                       f"to its leader in time")
                if store.check([f"{key}/unreachable"]):
                    who = bytes(store.get(f"{key}/unreachable")).decode(errors="replace")
                    raise ConfigError(f"rank {who} could not connect to its node's leader, "
                                      f"rank {self.rank}, over a local socket",
                                      rank=self.rank, hint=_NOT_ONE_HOST)
                listener.settimeout(min(left, _ACCEPT_POLL_S))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(max(deadline - time.monotonic(), 0.01))
                (peer,) = _LENGTH.unpack(_exactly(conn, _LENGTH.size, "a connecting rank"))
                if peer not in waiting:
                    conn.close()
                    continue
                conn.settimeout(None)
                self._peers[peer] = conn
                waiting.discard(peer)
        finally:
            listener.close()
            self._unlink()

    def _connect(self, store: Any, key: str, deadline: float) -> None:
        named = f"{key}/address"
        store.wait([named], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
        address = bytes(store.get(named)).decode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(max(deadline - time.monotonic(), 0.1))
            conn.connect(address)
            conn.sendall(_LENGTH.pack(self.rank))
            conn.settimeout(None)
        except OSError as exc:
            conn.close()
            store.set(f"{key}/unreachable", str(self.rank).encode())
            raise ConfigError(f"rank {self.rank} could not connect to its node's leader, rank "
                              f"{self.leader}, over a local socket ({type(exc).__name__}: "
                              f"{exc})", rank=self.rank, hint=_NOT_ONE_HOST) from exc
        self._peers[self.leader] = conn

    # ------------------------------------------------------------ messages

    def send(self, to: int, data: bytes, deadline: float) -> None:
        """Send ``data`` to rank ``to`` (this rank's leader, or a rank of the leader's node),
        by ``deadline``."""
        conn = self._peers[to]
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            conn.sendall(_LENGTH.pack(len(data)) + data)
        except TimeoutError as exc:
            raise TimeoutError(f"rank {to} did not take a message in time") from exc
        except OSError as exc:
            raise ConnectionError(f"rank {to} closed its connection ({type(exc).__name__}): "
                                  f"it may have died") from exc

    def receive_all(self, sources: Sequence[int], deadline: float) -> list[bytes]:
        """The next message of each of ``sources``, waited for together, by ``deadline``:
        TimeoutError naming those that sent none, ConnectionError naming one that closed its
        connection."""
        if len(sources) == 1:  # one peer: its socket's own timeout, no selector to set up
            return [self._receive_one(sources[0], deadline)]
        buffers = {r: self._early.pop(r, bytearray()) for r in sources}
        done: dict[int, bytes] = {r: m for r in sources
                                  if (m := self._complete(r, buffers[r])) is not None}
        # A selector (epoll, kqueue, poll), not select(): a process of many ranks' gloo
        # connections holds descriptors beyond select's 1,024.
        with selectors.DefaultSelector() as selector:
            for r in sources:
                if r not in done:
                    selector.register(self._peers[r], selectors.EVENT_READ, r)
            while len(done) < len(sources):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank(s) {sorted(set(sources) - set(done))} sent "
                                       f"nothing in time")
                for key, _ in selector.select(left):
                    source = key.data
                    chunk = self._peers[source].recv(1 << 16)
                    if not chunk:
                        raise ConnectionError(f"rank {source} closed its connection: it may "
                                              f"have died")
                    buffers[source] += chunk
                    message = self._complete(source, buffers[source])
                    if message is not None:
                        done[source] = message
                        selector.unregister(self._peers[source])
        return [done[r] for r in sources]

    def _receive_one(self, source: int, deadline: float) -> bytes:
        conn = self._peers[source]
        buffer = self._early.pop(source, bytearray())
        while (message := self._complete(source, buffer)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank(s) [{source}] sent nothing in time")
            conn.settimeout(left)
            try:
                chunk = conn.recv(1 << 16)
            except (TimeoutError, BlockingIOError):
                continue
            if not chunk:
                raise ConnectionError(f"rank {source} closed its connection: it may have died")
            buffer += chunk
        return message

    def _complete(self, source: int, buffer: bytearray) -> bytes | None:
        """The message at the start of ``buffer`` once it is all there (what follows it is
        kept for the next read from ``source``), else None."""
        if len(buffer) < _LENGTH.size:
            return None
        end = _LENGTH.size + _LENGTH.unpack_from(buffer)[0]
        if len(buffer) < end:
            return None
        if len(buffer) > end:
            self._early[source] = buffer[end:]
        return bytes(buffer[_LENGTH.size:end])

    # ------------------------------------------------------------ the end

    def close(self) -> None:
        """Close every connection (the socket file too, where there is one). Never raises."""
        peers, self._peers = self._peers, {}
        for conn in peers.values():
            with contextlib.suppress(OSError):
                conn.close()
        self._unlink()

    def _unlink(self) -> None:
        path, self._path = self._path, None
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)


_live: weakref.WeakSet[NodeLinks] = weakref.WeakSet()
_live_guard = threading.Lock()
_fork_hook = False


def _track(links: NodeLinks) -> None:
    global _fork_hook
    with _live_guard:
        _live.add(links)
        if not _fork_hook and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_close_in_child)
            _fork_hook = True


def _close_in_child() -> None:
    """In a forked child: close the child's copies of every connection (the parent's stay
    open), so that the parent's death closes them for its peers. The lock is not taken: a
    child has one thread, and the lock may have been held by another thread at the fork."""
    for links in list(_live):
        links._path = None  # the parent's socket file, if any, is the parent's to remove
        links.close()
    _live.clear()


_NOT_ONE_HOST = ("the ranks given as one node must run on one host (and in one network "
                 "namespace): check LOCAL_WORLD_SIZE, nodes= or node_size=")


def _exactly(conn: socket.socket, size: int, who: str) -> bytes:
    out = bytearray()
    while len(out) < size:
        chunk = conn.recv(size - len(out))
        if not chunk:
            raise ConnectionError(f"{who} closed its connection")
        out += chunk
    return bytes(out)
