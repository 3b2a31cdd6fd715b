"""A saved rank's shard held in another live rank's root, read in byte ranges over the data plane.

A reshard needs only some ranges of each saved rank's shard. Where this rank's root lacks a
saved rank's files and another live rank's root holds them (its own files, or a copy
replication left there), the reshard reads them from that rank's copy server (the ``range``
op, ``server.py``) rather than fetching the whole shard first: the manifest and commit
record arrive first and are checked as any shard's are, with the header, which is read as a
range and checked against the manifest (``check_arriving``); then each range the reshard
plans is asked for and arrives as data frames (each with the xxh3 it was sent with), and is
verified by the shard's checksum blocks (``_reshard/ranges.py``) before any of its bytes is
used. Nothing is written to the root.

The reading threads share the shard: each takes a connection from a small pool (one more
is opened when none is free), and one that failed is closed, not returned. A pooled
connection that fails a read (the server gives up on one that sat idle past its timeout,
as while the reshard planned) is closed and the read made again, once, on a new connection.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import threading

from ..._format.documents import decode_commit
from ..._format.filesets import FileSet
from ..._format.names import step_dir_name
from ..._format.scan import StepStatus, check_arriving
from ...errors import CheckpointError, CheckpointIntegrityError
from .push import Peer
from .wire import (
    PIECE_BYTES,
    ProtocolError,
    Received,
    connect,
    recv_data,
    recv_message,
    send_message,
)

__all__ = ("PeerShard",)


class _Connection:
    """One open ``range`` connection, and the buffer its frames arrive through."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.area = mmap.mmap(-1, PIECE_BYTES)
        self.piece = memoryview(self.area)

    def close(self, *, polite: bool) -> None:
        with contextlib.suppress(OSError):
            if polite:
                send_message(self.sock, {"op": "end"})
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(BufferError):
            self.piece.release()
            self.area.close()


class PeerShard:
    """Saved rank ``source``'s shard of ``step`` (save ``save_id``, ``world_size`` ranks), in
    ``peer``'s root, as a ``RangeSource`` (``open_read``, ``pread_into``, ``close``).
    ``bytes`` counts what was read over the network. Thread-safe. Raises CheckpointError
    naming the peer when the shard cannot be had."""

    def __init__(self, peer: Peer, *, token: str, step: int, save_id: str, source: int,
                 world_size: int, timeout_s: float) -> None:
        self.peer = peer
        self.token = token
        self.step = step
        self.save_id = save_id
        self.source = source
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.bytes = 0
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._meta: dict[str, object] | None = None
        first = self._connect()  # sets _meta: what every later connection must describe
        self._idle.append(first)
        assert self._meta is not None
        size = self._meta.get("size")
        manifest, commit = self._meta.get("manifest"), self._meta.get("commit")
        if not (isinstance(size, int) and size > 0 and isinstance(manifest, bytes)
                and isinstance(commit, bytes)):
            self.close(0)
            raise self._error(ProtocolError("the shard's description is malformed"))
        self.size: int = size
        self._manifest: bytes = manifest
        self._commit: bytes = commit

    @property
    def root(self) -> str:
        return f"rank {self.peer.rank}'s root ({self.peer.host}:{self.peer.port})"

    def status(self) -> StepStatus:
        """The shard's files checked as a restore checks any shard's: the commit record (of
        this save), the manifest against it, the header against the manifest."""
        try:
            record = decode_commit(self._commit, f"{self.root}: commit record")
            if (record.step, record.rank, record.save_id, record.world_size) != (
                self.step, self.source, self.save_id, self.world_size
            ):
                raise CheckpointIntegrityError("its commit record is for another save")
            return check_arriving(self, self.step, step_dir_name(self.step), self.source,
                                  commit_raw=self._commit, manifest_raw=self._manifest,
                                  shard_file=FileSet(self.source).shard)
        except CheckpointError as exc:
            raise self._error(exc) from exc

    def open_read(self, rel: str, expected_size: int | None = None) -> tuple[int, int]:
        if expected_size is not None and expected_size != self.size:
            raise self._error(ProtocolError(f"the shard is {self.size} bytes, its manifest "
                                            f"says {expected_size}"))
        return 0, self.size

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> None:
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        if offset < 0 or offset + len(view) > self.size:
            raise self._error(ProtocolError(f"bytes [{offset}, {offset + len(view)}) lie "
                                            f"beyond the {self.size}-byte shard"))
        if not view:
            return
        connection, reused = self._take()
        try:
            self._read(connection, view, offset)
        except (CheckpointError, OSError) as exc:
            connection.close(polite=False)
            if not reused:
                raise self._error(exc) from exc
            # perhaps an idle connection the server gave up on (its timeout): once more, on
            # a new one; what is really wrong fails again there
            connection = self._connect()
            try:
                self._read(connection, view, offset)
            except (CheckpointError, OSError) as again:
                connection.close(polite=False)
                raise self._error(again) from again
        with self._lock:
            self._idle.append(connection)
            self.bytes += len(view)

    def close(self, fd: int) -> None:
        """Close every connection (each told ``end``)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close(polite=True)

    def _read(self, connection: _Connection, view: memoryview, offset: int) -> None:
        """Ask for bytes [offset, offset + len(view)) and take the frames into ``view``, in
        order, each checked against the xxh3 it came with."""
        end = offset + len(view)
        send_message(connection.sock, {"op": "read", "offset": offset, "length": len(view)})
        received = Received(end)
        at = offset

        def write(piece: memoryview, where: int) -> None:
            view[where - offset:where - offset + len(piece)] = piece

        while at < end:
            message = recv_message(connection.sock, expect="data")
            if message.get("offset") != at:
                raise ProtocolError(f"a data frame at {message.get('offset')!r}, expected "
                                    f"one at {at}")
            recv_data(connection.sock, message, received, write, connection.piece)
            at = offset + received.bytes

    def _take(self) -> tuple[_Connection, bool]:
        """An idle connection (True: it served earlier, and may have been idle longer than
        the server waits), else a new one."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _connect(self) -> _Connection:
        """A new ``range`` connection. The shard's description it starts with is kept from
        the first; every later one must be the same (the same file, the same manifest and
        commit record), or the connection is refused."""
        try:
            sock = connect(self.peer.host, self.peer.port, self.timeout_s)
        except OSError as exc:
            raise self._error(exc) from exc
        connection = _Connection(sock)
        try:
            send_message(sock, {"op": "range", "token": self.token, "step": self.step,
                                "save_id": self.save_id, "source": self.source})
            meta = recv_message(sock, expect="meta")
            if self._meta is None:
                self._meta = meta
            elif meta != self._meta:
                raise ProtocolError("another connection describes another shard file")
            return connection
        except (CheckpointError, OSError) as exc:
            connection.close(polite=False)
            raise self._error(exc) from exc

    def _error(self, exc: BaseException) -> CheckpointIntegrityError:
        """``exc`` as the error naming this shard and its peer (once: one that already does
        is returned as it is)."""
        if isinstance(exc, _PeerError):
            return exc
        what = exc.message if isinstance(exc, CheckpointError) else (
            f"{type(exc).__name__}: {exc}")
        return _PeerError(
            f"reading rank {self.source}'s shard from {self.peer.describe()} failed: {what}",
            step=self.step, rank=self.source, path=self.root)


class _PeerError(CheckpointIntegrityError):
    """A ``PeerShard``'s failure, named once (its message says which shard and which peer)."""
