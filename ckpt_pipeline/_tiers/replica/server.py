"""The copy server of one rank: receives copies of other ranks' shards, and serves them back.

One listening TCP socket per rank, an accept thread, and a thread per connection (a handful:
each rank sends to ``replicas`` holders per save, and a restore fetches one shard per missing
rank). Every connection starts with a hello that carries the job's token (agreed at open, never
written to disk) and an op:

- ``push``: a rank sends a copy of its shard while its own write runs (``push.py``): data
  frames, then the manifest. The copy is checked (``Incoming.verify``), published without a
  commit record, and acknowledged. Its commit record is written only when the step commits
  (``Receptions.settle``, from this rank's commit stage, after the first vote); a copy of a
  step that fails, or that arrives after its step was settled, is removed.
  A push of a step committed already (a copy sent again after a restore, to a holder that
  lacked it) carries the commit record in its hello: the copy is published with it, once
  verified, as a fetched shard is.
- ``fetch``: at restore, a rank whose shard is missing or corrupt asks for the copy held
  here; it gets the manifest and commit record, then the shard as data frames, each range
  the shard's checksums cover sent as one frame (``fetch.py`` checks them on arrival).
- ``range``: a reshard reads a saved rank's shard, under whichever name this root holds it
  (the rank's own files, or a copy): the manifest and commit record, then the bytes of each
  range it asks for (``ranged.py`` verifies them by the shard's checksum blocks).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..._crash import crash_point
from ..._format.documents import decode_commit
from ..._format.filesets import FileSet
from ..._format.header import ShardHeader
from ..._format.limits import MAX_SMALL_FILE_BYTES
from ..._format.names import step_dir_name
from ..._format.region import checksum
from ..._format.scan import StepStatus, scan_any_name, scan_files
from ..._format.steps import read_small
from ..._logging import log
from ...errors import CheckpointError, ConfigError
from ...events import Event, ReplicaStored
from ...storage import Storage
from .incoming import Incoming
from .wire import (
    PIECE_BYTES,
    ProtocolError,
    copy_frames,
    piece_buffer,
    recv_data,
    recv_message,
    send_data,
    send_message,
    tune,
)

__all__ = ("CopyServer", "Receptions")

_MAX_SHARD_BYTES = 1 << 50
_SETTLED_KEPT = 64  # settled steps remembered, to refuse copies that arrive after their step


@dataclass(slots=True)
class _Reception:
    step: int
    save_id: str
    source: int
    incoming: Incoming | None = None
    stored: bool = False
    abandoned: bool = False
    committed: bool = False


class Receptions:
    """The copies this rank is receiving or holds uncommitted, by (step, save id, source)."""

    def __init__(self, storage: Storage, rank: int) -> None:
        self.storage = storage
        self.rank = rank
        self.lock = threading.Lock()
        self._open: dict[tuple[int, str, int], _Reception] = {}
        self._settled: dict[tuple[int, str], None] = {}

    def begin(self, step: int, save_id: str, source: int) -> _Reception:
        with self.lock:
            key = (step, save_id, source)
            if (step, save_id) in self._settled:
                raise ProtocolError(f"step {step} (save {save_id}) is settled here already: "
                                    "the copy came too late")
            if key in self._open:
                raise ProtocolError(f"a copy of rank {source}'s shard of step {step} is "
                                    "being received already")
            reception = _Reception(step, save_id, source)
            self._open[key] = reception
            return reception

    def finish(self, reception: _Reception, error: str | None, *,
               committed: bool = False) -> bool:
        """The connection's part is over: stored (True), or failed and removed (False).
        ``committed``: its commit record came with it (a copy sent again after a restore):
        it is the holder's for good, no longer tracked."""
        with self.lock:
            if error is None and not reception.abandoned:
                reception.stored = True
                if committed:
                    reception.committed = True
                    self._open.pop((reception.step, reception.save_id, reception.source),
                                   None)
                return True
            reception.abandoned = True
            self._open.pop((reception.step, reception.save_id, reception.source), None)
        if reception.incoming is not None:
            reception.incoming.discard()
        return False

    def settle(self, step: int, save_id: str, commit: Iterable[int],
               record: Callable[[int], bytes]) -> dict[int, str]:
        """The step's first vote is in: write the commit record of each stored copy whose
        source is in ``commit`` (``record(source)`` gives its bytes), remove every other copy
        of the step. Returns {source: error} for the copies in ``commit`` that could not be
        committed here. Runs in a worker thread."""
        wanted = set(commit)
        with self.lock:
            self._settled[(step, save_id)] = None
            while len(self._settled) > _SETTLED_KEPT:
                del self._settled[next(iter(self._settled))]
            mine = [r for key, r in self._open.items() if key[:2] == (step, save_id)]
            for reception in mine:
                if not reception.stored:
                    reception.abandoned = True  # its thread removes it when it gets there
        failed: dict[int, str] = {}
        for source in sorted(wanted - {r.source for r in mine if r.stored}):
            failed[source] = f"rank {self.rank} holds no verified copy"
        for reception in mine:
            if not reception.stored:
                continue
            incoming = reception.incoming
            assert incoming is not None
            if reception.source not in wanted:
                self._drop(reception)
                continue
            try:
                incoming.publish_commit(record(reception.source))
                reception.committed = True
            except CheckpointError as exc:
                failed[reception.source] = f"rank {self.rank} could not commit it: {exc}"
                self._drop(reception)
        return failed

    def forget(self, step: int, save_id: str) -> None:
        """The step is over (committed or failed everywhere): stop tracking its copies."""
        with self.lock:
            for key in [k for k in self._open if k[:2] == (step, save_id)]:
                del self._open[key]

    def drop(self, step: int, save_id: str) -> None:
        """The step failed after its copies were committed: remove them (record first)."""
        with self.lock:
            mine = [r for key, r in self._open.items() if key[:2] == (step, save_id)]
            for reception in mine:
                reception.abandoned = True
        for reception in mine:
            if reception.stored:
                self._drop(reception)
        self.forget(step, save_id)

    def abandon_all(self) -> None:
        """At close: every copy not settled yet is removed (the scrub would remove it too)."""
        with self.lock:
            pending = [r for r in self._open.values() if not r.committed]
            for reception in pending:
                reception.abandoned = True
            self._open.clear()
        for reception in pending:
            if reception.stored:
                self._drop(reception)

    def _drop(self, reception: _Reception) -> None:
        reception.stored = False
        if reception.incoming is not None:
            reception.incoming.discard()


class CopyServer:
    """Listens for copy connections of the other ranks (see the module docstring)."""

    def __init__(self, storage: Storage, rank: int, *, bind_host: str, advertise_host: str,
                 timeout_s: float, emit: Callable[[Event], None]) -> None:
        self.storage = storage
        self.rank = rank
        self.timeout_s = timeout_s
        self._emit = emit
        self.receptions = Receptions(storage, rank)
        self.token: str | None = None
        self.sources: frozenset[int] = frozenset()
        """Ranks whose copies this rank takes (from the placement)."""
        self.world_size = 0
        try:
            self._sock = socket.create_server((bind_host, 0), backlog=128)
        except OSError as exc:
            raise ConfigError(f"the copy server of rank {rank} cannot listen on "
                              f"{bind_host!r}: {exc}", rank=rank,
                              hint="set ReplicationConfig(host=) to an address of this host") from exc
        self._sock.settimeout(0.2)
        self.address = (advertise_host, int(self._sock.getsockname()[1]))
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"ckpt-copy-server-r{rank}")
        self._accept.start()

    def close(self) -> None:
        """Stop accepting; wait (bounded) for the connections in progress; remove every copy
        that was not committed."""
        self._stop.set()
        with contextlib.suppress(OSError):  # wakes the accept at once, not at its next poll
            self._sock.shutdown(socket.SHUT_RDWR)
        self._accept.join(timeout=5)
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            threads = list(self._threads)
        deadline = time.monotonic() + 5
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.receptions.abandon_all()

    # ------------------------------------------------------------------ connections

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name=f"ckpt-copy-conn-r{self.rank}")
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                tune(conn, self.timeout_s)
                try:
                    hello = recv_message(conn)
                    self._check_hello(hello)
                    if hello["op"] == "push":
                        self._receive(conn, hello)
                    elif hello["op"] == "fetch":
                        self._send_copy(conn, hello)
                    elif hello["op"] == "range":
                        self._send_ranges(conn, hello)
                    else:
                        raise ProtocolError(f"unknown op {hello['op']!r}")
                except (CheckpointError, OSError, ValueError) as exc:
                    error = exc.message if isinstance(exc, CheckpointError) else (
                        f"{type(exc).__name__}: {exc}")
                    log.warning("ckpt.replicate.refused", rank=self.rank, error=error)
                    with contextlib.suppress(OSError):
                        send_message(conn, {"op": "error", "error": error})
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _check_hello(self, hello: dict[str, Any]) -> None:
        token = hello.get("token")
        if self.token is None or not isinstance(token, str) or not hmac.compare_digest(
            token, self.token
        ):
            raise ProtocolError("the connection is not from this job (wrong token)")

    def _receive(self, conn: socket.socket, hello: dict[str, Any]) -> None:
        started = time.perf_counter()
        step, save_id, source, limit = (hello.get(k) for k in ("step", "save_id", "source",
                                                                "limit"))
        if not (isinstance(step, int) and isinstance(save_id, str) and isinstance(source, int)
                and isinstance(limit, int) and step >= 0 and 0 < limit <= _MAX_SHARD_BYTES):
            raise ProtocolError("a push without step, save id, source and size bound")
        if source not in self.sources:
            raise ProtocolError(f"rank {self.rank} does not hold copies of rank {source}")
        commit = hello.get("commit")
        if commit is not None:
            self._check_commit(commit, step, source, save_id)
        reception = self.receptions.begin(step, save_id, source)
        error: str | None = "the connection ended early"
        try:
            reception.incoming = Incoming(self.storage, step_dir_name(step),
                                          FileSet(source, self.rank), limit)
            send_message(conn, {"op": "ready"})
            with piece_buffer(PIECE_BYTES) as piece:
                while True:
                    message = recv_message(conn)
                    if message["op"] == "end":
                        break
                    if message["op"] != "data":
                        raise ProtocolError(f"unexpected {message['op']!r} in a push")
                    recv_data(conn, message, reception.incoming.received,
                              reception.incoming.write, piece)
                    crash_point("replicate.receiving")
            manifest, size = message.get("manifest"), message.get("size")
            if not isinstance(manifest, bytes) or not isinstance(size, int) or not (
                0 < size <= limit
            ):
                raise ProtocolError("the push ended without a manifest and the file's size")
            reception.incoming.received.size = size
            reception.incoming.verify(manifest, step=step, source=source, save_id=save_id,
                                      world_size=self.world_size)
            with self.receptions.lock:
                if reception.abandoned:
                    raise ProtocolError(f"step {step} was settled while its copy arrived")
            reception.incoming.publish(manifest, commit)
            crash_point("replicate.stored")
            error = None
        except (CheckpointError, OSError) as exc:
            error = exc.message if isinstance(exc, CheckpointError) else (
                f"{type(exc).__name__}: {exc}")
            raise
        finally:
            stored = self.receptions.finish(reception, error, committed=commit is not None)
        if not stored:
            raise ProtocolError(f"step {step} was settled while its copy arrived")
        seconds = time.perf_counter() - started
        self._emit(ReplicaStored(step=step, rank=self.rank, save_id=save_id, source=source,
                                 path=reception.incoming.path, bytes=size, seconds=seconds))
        send_message(conn, {"op": "ack"})

    def _check_commit(self, commit: Any, step: int, source: int, save_id: str) -> None:
        """The commit record a push of a committed step carries must be that step's."""
        if not isinstance(commit, bytes) or len(commit) > MAX_SMALL_FILE_BYTES:
            raise ProtocolError("a push with a malformed commit record")
        try:
            record = decode_commit(commit, f"rank {source}'s commit record of step {step}")
        except CheckpointError as exc:
            raise ProtocolError(f"a push with a malformed commit record: {exc.message}"
                                ) from exc
        if (record.step, record.rank, record.save_id, record.world_size) != (
            step, source, save_id, self.world_size
        ):
            raise ProtocolError(f"the commit record pushed with rank {source}'s copy of step "
                                f"{step} is for another save")

    def _send_copy(self, conn: socket.socket, hello: dict[str, Any]) -> None:
        step, save_id, source = (hello.get(k) for k in ("step", "save_id", "source"))
        if not (isinstance(step, int) and isinstance(save_id, str) and isinstance(source, int)):
            raise ProtocolError("a fetch without step, save id and source")
        dir_name = step_dir_name(step)
        status = scan_files(self.storage, FileSet(source, self.rank), step, dir_name)
        header, fd, size = self._describe(conn, status, step, save_id, source)
        frames = copy_frames(header.checks(), size)
        try:
            with piece_buffer(max((e - s for s, e, _ in frames), default=1)) as area:
                self._send_frames(conn, fd, frames, area, source, step)
        finally:
            self.storage.close(fd)
        send_message(conn, {"op": "end"})

    def _describe(self, conn: socket.socket, status: StepStatus, step: int, save_id: str,
                  source: int) -> tuple[ShardHeader, int, int]:
        """Send the manifest and commit record of ``status``, a valid copy of the save asked
        for, and open its shard: (header, descriptor, size)."""
        files = status.files or FileSet(source)
        if not status.valid or status.save_id != save_id or status.header is None:
            raise ProtocolError(f"rank {self.rank} holds no valid copy of rank {source}'s "
                                f"shard of step {step} (save {save_id}): "
                                f"{status.reason or 'another save'}")
        manifest = read_small(self.storage, os.path.join(status.dir_name, files.manifest))
        commit = read_small(self.storage, os.path.join(status.dir_name, files.commit))
        send_message(conn, {"op": "meta", "size": status.shard_size, "manifest": manifest,
                            "commit": commit})
        fd, size = self.storage.open_read(os.path.join(status.dir_name, files.shard),
                                          status.shard_size)
        return status.header, fd, size

    def _send_ranges(self, conn: socket.socket, hello: dict[str, Any]) -> None:
        """A reshard's reads of a saved rank's shard, under whichever name this root holds it
        (the rank's own files, or a copy): the manifest and commit record, then the bytes of
        each ``read`` the reader asks for, as data frames of at most ``PIECE_BYTES`` in order,
        until it says ``end``. The reader verifies them by the shard's checksum blocks."""
        step, save_id, source = (hello.get(k) for k in ("step", "save_id", "source"))
        if not (isinstance(step, int) and isinstance(save_id, str) and isinstance(source, int)):
            raise ProtocolError("a range read without step, save id and source")
        status = scan_any_name(self.storage, source, step, step_dir_name(step), save_id)
        _, fd, size = self._describe(conn, status, step, save_id, source)
        try:
            with piece_buffer(PIECE_BYTES) as area:
                while (message := recv_message(conn))["op"] != "end":
                    if message["op"] != "read":
                        raise ProtocolError(f"unexpected {message['op']!r} in a range read")
                    offset, length = message.get("offset"), message.get("length")
                    if not (type(offset) is int and type(length) is int and offset >= 0
                            and length > 0 and offset + length <= size):
                        raise ProtocolError(f"a read of {length!r} bytes at {offset!r}, "
                                            f"outside the {size}-byte shard")
                    for start in range(offset, offset + length, PIECE_BYTES):
                        buf = area[:min(offset + length, start + PIECE_BYTES) - start]
                        self.storage.pread_into(fd, buf, start)
                        send_data(conn, start, buf, checksum(buf))
        finally:
            self.storage.close(fd)

    def _send_frames(self, conn: socket.socket, fd: int,
                     frames: list[tuple[int, int, int | None]], area: memoryview,
                     source: int, step: int) -> None:
        """Each frame read into ``area``, checked against the shard's checksum, sent."""
        for start, end, digest in frames:
            buf = area[:end - start]
            self.storage.pread_into(fd, buf, start)
            actual = checksum(buf)
            if digest is not None and actual != digest:
                raise ProtocolError(
                    f"rank {self.rank}'s copy of rank {source}'s shard of step {step} is "
                    f"corrupt on its disk: bytes [{start}, {end}) do not match the "
                    "shard's checksum")
            send_data(conn, start, buf, actual)
