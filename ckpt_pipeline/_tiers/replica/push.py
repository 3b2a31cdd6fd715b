"""Sending copies of one save's shard to its holders, from the host buffer, as it is written.

A ``Push`` belongs to one save. ``open`` connects to each holder (worker thread, before the
first chunk is written). The chunk writer calls ``send`` for every checksum chunk right after
writing it locally, from its worker threads, with a view of the host buffer: the bytes go out
without a copy, and a streamed save frees its buffer segment only once they are sent, so host
memory stays what the save already holds, and a holder slower than the disk slows the save
down (backpressure: the slot is busy longer, and ``save()`` blocks or skips by ``when_busy``).
``finish`` (seal) sends the header, the preamble and the manifest; ``collect`` (commit)
waits for each holder's acknowledgement. A holder that fails at any point (refused, timed out,
connection lost) is dropped from this save with the reason, naming it; the others and the
local write go on.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field

from ..._crash import crash_point
from ..._format.region import checksum
from ..._logging import log
from ...errors import CheckpointError
from .wire import ProtocolError, connect, recv_message, send_data, send_message

__all__ = ("Peer", "Push", "PushOutcome")


@dataclass(frozen=True, slots=True)
class Peer:
    """Another rank's copy server."""

    rank: int
    node: str
    host: str
    port: int

    def describe(self) -> str:
        return f"rank {self.rank} on {self.node} ({self.host}:{self.port})"


@dataclass(slots=True)
class _Link:
    peer: Peer
    sock: socket.socket | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    error: str | None = None
    bytes: int = 0
    started: float = 0.0


@dataclass(frozen=True, slots=True)
class PushOutcome:
    """Which holders acknowledged a durable copy, and why the others did not."""

    acked: tuple[int, ...]
    errors: dict[int, str]
    seconds: dict[int, float]
    bytes: dict[int, int]


class Push:
    """The copies of one save's shard on their way (see the module docstring)."""

    def __init__(self, peers: list[Peer], *, token: str, step: int, save_id: str, rank: int,
                 timeout_s: float, commit: bytes | None = None) -> None:
        self.links = [_Link(peer) for peer in peers]
        self.token = token
        self.step = step
        self.save_id = save_id
        self.rank = rank
        self.timeout_s = timeout_s
        self.commit = commit
        """The commit record of a step committed already (a copy sent again after a
        restore): the holders publish it with the copy, there is no vote to wait for."""

    def open(self, limit: int) -> None:
        """Connect to every holder and announce the save (``limit``: a bound on the size of
        the shard file, known before its header is)."""
        for link in self.links:
            link.started = time.perf_counter()
            try:
                link.sock = connect(link.peer.host, link.peer.port, self.timeout_s)
                hello = {"op": "push", "token": self.token, "step": self.step,
                         "save_id": self.save_id, "source": self.rank, "limit": limit}
                if self.commit is not None:
                    hello["commit"] = self.commit
                send_message(link.sock, hello)
                recv_message(link.sock, expect="ready")  # or the reason it refuses
            except (OSError, CheckpointError) as exc:
                self._fail(link, _why(exc, "opening", self.timeout_s))

    def send(self, offset: int, data: memoryview, digest: int) -> None:
        """Send one chunk of the file to every holder still in the save (worker threads)."""
        for link in self.links:
            with link.lock:
                if link.sock is None:
                    continue
                try:
                    send_data(link.sock, offset, data, digest)
                    link.bytes += len(data)
                except OSError as exc:
                    self._fail(link, _peer_reason(link.sock) or _why(exc, "sending",
                                                                      self.timeout_s))
                    continue
            crash_point("replicate.sending")

    def finish(self, header: bytes, header_offset: int, preamble: bytes,
               manifest: bytes) -> None:
        """The rest of the file and the manifest: the holders check and publish the copy."""
        for link in self.links:
            with link.lock:
                if link.sock is None:
                    continue
                try:
                    send_data(link.sock, header_offset, memoryview(header), checksum(header))
                    send_data(link.sock, 0, memoryview(preamble), checksum(preamble))
                    send_message(link.sock, {"op": "end", "manifest": manifest,
                                             "size": header_offset + len(header)})
                    link.bytes += len(header) + len(preamble)
                except OSError as exc:
                    self._fail(link, _peer_reason(link.sock) or _why(exc, "sending",
                                                                      self.timeout_s))

    def end(self, manifest: bytes, size: int) -> None:
        """After every byte of the file went out with ``send``: the manifest and the file's
        size (a copy sent from a file on disk; a save's copy ends with ``finish``)."""
        for link in self.links:
            with link.lock:
                if link.sock is None:
                    continue
                try:
                    send_message(link.sock, {"op": "end", "manifest": manifest, "size": size})
                except OSError as exc:
                    self._fail(link, _peer_reason(link.sock) or _why(exc, "sending",
                                                                      self.timeout_s))

    def interrupt(self) -> None:
        """From another thread (a close): cut every connection at once, without waiting for
        the thread that uses it; its next call fails and drops the holder (which removes
        what arrived)."""
        for link in self.links:
            sock = link.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def collect(self) -> PushOutcome:
        """Wait for each holder's acknowledgement (bounded by the timeout); close."""
        acked: list[int] = []
        seconds: dict[int, float] = {}
        for link in self.links:
            with link.lock:
                sock = link.sock
                if sock is None:
                    continue
                try:
                    recv_message(sock, expect="ack")
                    acked.append(link.peer.rank)
                    seconds[link.peer.rank] = time.perf_counter() - link.started
                except (OSError, CheckpointError) as exc:
                    self._fail(link, _why(exc, "waiting for the acknowledgement of",
                                          self.timeout_s))
                else:
                    link.sock = None
                    with contextlib.suppress(OSError):
                        sock.close()
        return PushOutcome(tuple(acked),
                           {lk.peer.rank: lk.error for lk in self.links if lk.error},
                           seconds, {lk.peer.rank: lk.bytes for lk in self.links})

    def abort(self, why: str) -> None:
        """The save failed here: drop every connection (the holders remove what arrived)."""
        for link in self.links:
            with link.lock:
                if link.sock is not None:
                    self._fail(link, why, log_it=False)

    def failed(self, error: str) -> None:
        """Every holder still in the save failed for the same reason (before connecting)."""
        for link in self.links:
            if link.error is None:
                link.error = error

    def _fail(self, link: _Link, error: str, *, log_it: bool = True) -> None:
        """Called with ``link.lock`` held, or before any thread uses the link."""
        link.error = link.error or f"{link.peer.describe()}: {error}"
        if link.sock is not None:
            with contextlib.suppress(OSError):
                link.sock.close()
            link.sock = None
        if log_it:
            log.warning("ckpt.replicate.peer_failed", step=self.step, rank=self.rank,
                        peer=link.peer.rank, node=link.peer.node, error=link.error)


def _peer_reason(sock: socket.socket | None) -> str | None:
    """The error message a holder sent before it closed the connection, if it can be read."""
    if sock is None:
        return None
    try:
        sock.settimeout(1.0)
        recv_message(sock)
    except ProtocolError as exc:
        return exc.message
    except (OSError, CheckpointError):
        return None
    return None


def _why(exc: BaseException, doing: str, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout_s:g} s {doing} the copy"
    if isinstance(exc, ProtocolError):
        return exc.message
    return f"{doing} the copy failed: {type(exc).__name__}: {exc}"
