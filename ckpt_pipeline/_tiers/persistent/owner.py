"""Ownership of a persistent URL: one open of one job at a time (rank 0's side).

The owner object ``URL/owner`` (msgpack, never pickle) names the open that holds the URL: its
run id (random per open), host, pid, local root, lease and a heartbeat. Liveness, not
identity, decides who may hold it, so that a restarted job resumes from its URL even after
losing its local root:

- ``Ownership.acquire`` at open writes the object if there is none (a conditional create:
  S3's ``If-None-Match``, a directory's ``link``). One that is released, whose heartbeat is
  older than its holder's lease, or that ``takeover`` overrides, is replaced (a conditional
  update on the version that was read). A fresh one is watched for up to one lease: if it
  changes, its holder is alive and the open is refused (``PersistentInUseError``); if it does
  not, it is taken over. A takeover is logged (WARNING) and emitted (``PersistentTakenOver``).
- While it holds the URL, a thread refreshes the heartbeat every third of the lease, each
  write conditional on the version this open wrote last: one that finds another version
  means the URL was taken over (``lost``), and the thread stops.
- ``check`` re-reads the object before each commit object: a step is committed only while the
  URL is still this open's.
- ``release`` at a clean close marks the object released, so that the next job opens at once.

On a store without conditional writes (fsspec) each write compares, then writes: two jobs
taking a dead job's URL over at the same moment may both believe they won, until the first
``check`` or heartbeat of the loser, which then stops promoting.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..._format.documents import FORMAT_VERSION, decode_message, encode_message
from ..._logging import log
from ...errors import CheckpointError, CheckpointIntegrityError, PersistentInUseError
from ...events import Event, PersistentTakenOver
from .remote import Remote
from .retries import Conflict

__all__ = ("MAX_OWNER_BYTES", "OWNER_KEY", "OwnerRecord", "Ownership", "decode_owner",
           "encode_owner")

OWNER_KEY = "owner"
MAX_OWNER_BYTES = 64 * 1024
_POLL_MIN_S = 0.05
_POLL_MAX_S = 2.0


@dataclass(frozen=True, slots=True)
class OwnerRecord:
    """The content of the owner object."""

    run_id: str
    host: str
    pid: int
    root: str
    lease_s: float
    opened_at: float
    heartbeat_at: float
    beats: int = 0
    released: bool = False

    def describe(self, now: float) -> str:
        """The holder, for an error message or a log line."""
        return (f"run {self.run_id} on host {self.host} (pid {self.pid}, local root "
                f"{self.root}), last heartbeat {max(0.0, now - self.heartbeat_at):.1f} s ago")


def encode_owner(record: OwnerRecord) -> bytes:
    return encode_message({
        "format": FORMAT_VERSION, "kind": "owner", "run_id": record.run_id,
        "host": record.host, "pid": record.pid, "root": record.root,
        "lease_s": float(record.lease_s), "opened_at": float(record.opened_at),
        "heartbeat_at": float(record.heartbeat_at), "beats": record.beats,
        "released": record.released})


def decode_owner(raw: bytes, where: str) -> OwnerRecord:
    """Decode and check an owner object; CheckpointIntegrityError names ``where``."""
    doc = decode_message(raw, f"the owner object {where}")
    run_id, host, root = doc.get("run_id"), doc.get("host"), doc.get("root")
    pid, beats, released = doc.get("pid"), doc.get("beats"), doc.get("released")
    if doc.get("kind") != "owner" or type(doc.get("format")) is not int or not (
        isinstance(run_id, str) and run_id and isinstance(host, str) and host
        and isinstance(root, str) and root and type(pid) is int and type(beats) is int
        and type(released) is bool
    ):
        raise CheckpointIntegrityError(f"the owner object {where} is invalid: fields are "
                                       "missing or of the wrong type", path=where)
    return OwnerRecord(run_id, host, pid, root, _seconds(doc, "lease_s", where),
                       _seconds(doc, "opened_at", where), _seconds(doc, "heartbeat_at", where),
                       beats, released)


def _seconds(doc: dict[str, object], name: str, where: str) -> float:
    value = doc.get(name)
    if type(value) not in (int, float):
        raise CheckpointIntegrityError(f"the owner object {where} is invalid: {name} is "
                                       "missing or not a number", path=where)
    assert isinstance(value, (int, float))
    return float(value)


class Ownership:
    """This open's hold on a persistent URL (see the module docstring). Rank 0 only."""

    def __init__(self, remote: Remote, record: OwnerRecord, version: str | None) -> None:
        self.remote = remote
        self.record = record
        self._version = version
        self._lost: str | None = None
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def where(self) -> str:
        return f"{self.remote.url.rstrip('/')}/{OWNER_KEY}"

    @property
    def lost(self) -> str | None:
        """Why the URL is not this open's any more (naming the holder); None while it is."""
        return self._lost

    # ------------------------------------------------------------------ acquire

    @classmethod
    def acquire(cls, remote: Remote, *, root: str, lease_s: float, takeover: bool,
                emit: Callable[[Event], None], rank: int = 0,
                wait: Callable[[float], object] | None = None,
                watching: Callable[[float], None] | None = None) -> Ownership:
        """Take the URL for this open, or raise ``PersistentInUseError`` naming the live
        holder. Blocks for up to the holder's lease while watching it (``watching(lease)``
        is called as the watch begins). Runs in a worker
        thread."""
        sleep = wait if wait is not None else threading.Event().wait
        now = time.time()
        mine = OwnerRecord(secrets.token_hex(8), socket.gethostname(), os.getpid(), root,
                           float(lease_s), now, now)
        where = f"{remote.url.rstrip('/')}/{OWNER_KEY}"
        watched: tuple[str | None, bytes] | None = None
        watch_until = 0.0
        while True:
            found = remote.get_versioned(OWNER_KEY, MAX_OWNER_BYTES)
            if found is None:
                try:
                    version = remote.put_versioned(OWNER_KEY, encode_owner(mine), None)
                except Conflict:
                    continue  # another job created it first: look at it
                log.debug("ckpt.persist.owner_acquired", rank=rank, url=remote.url,
                          run_id=mine.run_id)
                return cls(remote, mine, version)
            raw, version = found
            holder = _decode_or_none(raw, where, rank)
            if holder is not None and holder.run_id == mine.run_id:
                return cls(remote, holder, version)  # a retried write of ours had landed
            now = time.time()
            lease = holder.lease_s if holder is not None else float(lease_s)
            free = takeover or (holder is not None and (
                holder.released or now - holder.heartbeat_at > holder.lease_s))
            if not free:
                if watched is not None and watched != (version, raw):
                    shown = ("a writer of another format" if holder is None
                             else holder.describe(now))
                    raise PersistentInUseError(
                        f"the persistent URL {remote.url} is held by {shown}, whose heartbeat "
                        "advances: another job is promoting to it", path=where, rank=rank,
                        hint="give each job its own persistent URL; if that job is dead or "
                             "must stop, stop it, or open with PersistentConfig(takeover=True)")
                if watched is None:
                    watched = (version, raw)
                    watch_until = time.monotonic() + lease
                    log.info("ckpt.persist.owner_watching", rank=rank, url=remote.url,
                             holder=None if holder is None else holder.describe(now),
                             lease_s=lease)
                    if watching is not None:
                        watching(lease)
                if time.monotonic() < watch_until:
                    sleep(min(_POLL_MAX_S, max(_POLL_MIN_S, lease / 10)))
                    continue
            record = replace(mine, opened_at=now, heartbeat_at=now)
            try:
                version = remote.put_versioned(OWNER_KEY, encode_owner(record), version)
            except Conflict:
                watched = None  # it changed under us: judge the new holder afresh
                continue
            if holder is None or not holder.released:
                age = -1.0 if holder is None else max(0.0, now - holder.heartbeat_at)
                emit(PersistentTakenOver(  # logged at WARNING as ckpt.persist.taken_over
                    step=-1, rank=rank, url=remote.url,
                    holder="" if holder is None else holder.run_id,
                    host="" if holder is None else holder.host,
                    pid=-1 if holder is None else holder.pid,
                    root="" if holder is None else holder.root,
                    heartbeat_age_s=age, forced=takeover))
            return cls(remote, record, version)

    # ------------------------------------------------------------------ while held

    def start_heartbeat(self) -> None:
        """Refresh the heartbeat every third of the lease in a daemon thread of its own
        (never on the event loop, never waited for by a save) until ``stop``."""
        self._thread = threading.Thread(target=self._beat_loop, daemon=True,
                                        name="ckpt-persist-heartbeat")
        self._thread.start()

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.record.lease_s / 3):
            if self.beat() is not None:
                return

    def beat(self) -> str | None:
        """One heartbeat: None while the URL is this open's, else why not."""
        with self._write_lock:
            if self._lost is not None or self._stop.is_set():
                return self._lost
            record = replace(self.record, heartbeat_at=time.time(),
                             beats=self.record.beats + 1)
            try:
                self._write(record)
            except CheckpointError as exc:  # the store: the next beat tries again
                log.warning("ckpt.persist.heartbeat_failed", rank=0, url=self.remote.url,
                            error=exc.message)
            return self._lost

    def check(self) -> str | None:
        """Before a commit object: re-read the owner object. None while it is this open's,
        else why not (naming the holder). A store error is raised."""
        if self._lost is not None:
            return self._lost
        found = self.remote.get_versioned(OWNER_KEY, MAX_OWNER_BYTES)
        holder = None if found is None else _decode_or_none(found[0], self.where, 0)
        if holder is None or holder.run_id != self.record.run_id or holder.released:
            self._lose(holder)
        return self._lost

    def stop(self) -> None:
        """Stop the heartbeat (without waiting for a beat in flight)."""
        self._stop.set()

    def release(self) -> None:
        """At a clean close: mark the owner object released, so that the next job opens at
        once. Failures are logged: the heartbeat has stopped, and the next job takes the URL
        over after one lease."""
        self._stop.set()
        with self._write_lock:
            if self._lost is not None:
                return
            try:
                self._write(replace(self.record, heartbeat_at=time.time(), released=True))
            except CheckpointError as exc:
                log.warning("ckpt.persist.release_failed", rank=0, url=self.remote.url,
                            error=exc.message)
                return
        log.debug("ckpt.persist.owner_released", rank=0, url=self.remote.url,
                  run_id=self.record.run_id)

    def _write(self, record: OwnerRecord) -> None:
        """Write ``record`` conditional on the version this open wrote last (under
        ``_write_lock``); another version means the URL was taken over."""
        data = encode_owner(record)
        try:
            self._version = self.remote.put_versioned(OWNER_KEY, data, self._version)
        except Conflict:
            found = self.remote.get_versioned(OWNER_KEY, MAX_OWNER_BYTES)
            if found is not None and found[0] == data:  # a retried write of ours had landed
                self._version = found[1]
            else:
                self._lose(None if found is None else _decode_or_none(found[0], self.where, 0))
                return
        self.record = record

    def _lose(self, holder: OwnerRecord | None) -> None:
        if self._lost is not None:
            return
        if holder is None:
            self._lost = f"the owner object {self.where} was removed or replaced"
        elif holder.run_id == self.record.run_id:
            self._lost = f"the owner object {self.where} was released"
        else:
            self._lost = (f"the persistent URL {self.remote.url} was taken over by "
                          f"{holder.describe(time.time())}")
        self._stop.set()


def _decode_or_none(raw: bytes, where: str, rank: int) -> OwnerRecord | None:
    try:
        return decode_owner(raw, where)
    except CheckpointError as exc:
        log.warning("ckpt.persist.owner_invalid", rank=rank, url=where, reason=exc.message)
        return None
