"""Promotion of committed steps to the persistent tier, and download at restore.

Each rank uploads its own committed files of a step (shard, manifest, commit record) from its
local root, in a thread of its own, one step after the other: never from the training's memory,
never on the event loop. Which steps are promoted, which are skipped and when a step is complete
are decided from what every rank reports in the first commit vote of each save (and in one more
exchange at close), so every rank takes the same decisions in the same order:

- every ``persist_every``-th committed step is assigned, unless some rank cannot reach the
  tier, or still has two promotions unfinished (one uploading, one queued): then it is
  skipped (``PersistSkipped``);
- a rank reports each finished upload once, with the checksum of every object; once every rank
  has reported a step, rank 0 checks the objects are there and writes ``step.commit`` last
  (``StepPersisted``), then applies ``persistent_keep``;
- a rank that failed (after the remote layer's retries) reports its error: every rank emits
  ``PersistFailed`` and rank 0 removes what was uploaded of the step;
- a rewind (``rewound``) is recorded in the tier by rank 0 (``rewinds.py``), which then takes
  the abandoned steps off it; a promotion of an abandoned step is never committed. While the
  tier cannot be reached the rewind stays pending, and is recorded before the next commit
  object.

The URL belongs to one open (``owner.Ownership``, rank 0's): before each commit object rank 0
re-reads the owner object, and checks that every object of the step is the one its rank
uploaded (the stamp the rank reported: an S3 ETag, a file's inode and modification time;
where a store has none, the content of each rank's commit record). A step whose objects are
another job's is not committed. Once the URL is another job's, rank 0 commits, prunes and
removes nothing more and says so in its next report: every rank then emits ``PersistFailed``
for its steps in flight, and for every step due later, and stops promoting (logged once, at
ERROR).

A step being uploaded is kept in the local tier until its upload ends (``protected``). Saves
come first: while a save of this rank writes its shard, uploads wait between parts
(``writing``), so the disk is shared in the gaps between saves, not during them.

The store never holds a job up (see ``connect`` and ``workers``): ``open`` waits at most
``OPEN_WAIT_S`` for it and opens from the local tier when it is unreachable, trying again in
the background; a restore waits at most ``LIST_WAIT_S`` for its steps; every thread that
waits on the store is a daemon, and ``close`` gives up on what did not end in time: such a
step never gets its commit object and is reported (``PersistFailed``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..._config_groups import PersistentConfig
from ..._format.names import parse_step_dir, step_dir_name
from ..._format.timeline import Lineage, Mark, Rewind, abandoned
from ..._logging import log
from ...errors import CheckpointError, CheckpointIntegrityError, PersistentInUseError
from ...events import (
    Event,
    PersistFailed,
    PersistPruned,
    PersistSkipped,
    ShardUploaded,
    StepPersisted,
)
from ...storage import Storage
from .connect import Connection
from .layout import (
    MAX_COMMIT_BYTES,
    STEP_COMMIT,
    StepRecord,
    decode_step_record,
    encode_step_record,
    rank_keys,
)
from .objects import ObjectSum
from .owner import Ownership
from .remote import Remote
from .retries import SMALL_TIMEOUT_S, UNAVAILABLE_HINT, RemoteError
from .rewinds import drop_commit_objects, read_tier_rewinds, record_rewinds, tier_marks
from .stream import ShardStream
from .urls import display_url as _display
from .urls import open_remote
from .workers import DaemonPool, bounded

__all__ = ("LIST_WAIT_S", "OPEN_WAIT_S", "Promoter", "complete_steps", "download_rank",
           "read_step_record")

_PAUSE_MAX_S = 30.0
_QUEUED_MAX = 2
"""Unfinished promotions a rank may have (one uploading, one waiting) before one is skipped."""
OPEN_WAIT_S = 10.0
"""How long ``open`` waits for the store before the pipeline opens from the local tier."""
LIST_WAIT_S = 60.0
"""How long a restore waits to reach the store and list its steps."""


class _Stopped(Exception):
    """Raised into an upload between two parts once the promoter is closed."""


@dataclass(slots=True)
class _Assigned:
    save_id: str
    committed_at: float
    reports: dict[int, dict[str, Any]]
    lineage: Lineage | None = None


class Promoter:
    """This rank's side of the persistent tier (see the module docstring)."""

    def __init__(self, storage: Storage, config: PersistentConfig,
                 emit: Callable[[Event], None], *, rank: int, world_size: int,
                 io_threads: int) -> None:
        self.storage = storage
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.io_threads = io_threads
        self._emit = emit
        self._spec = config.url
        self.remote: Remote | None = None
        self.url = _display(config.url)
        self._lock = threading.Lock()
        self._uploads = DaemonPool(1, f"ckpt-persist-r{self.rank}")
        self._meta = DaemonPool(1, f"ckpt-persist-meta-r{self.rank}")
        self._futures: list[tuple[bool, concurrent.futures.Future[None]]] = []  # (upload, f)
        self._connection: Connection[Remote] = Connection(
            self.url, self.rank, self._open_steps, self._connected, _close_quietly, emit)
        self._stopped = False
        # This rank's uploads: unfinished, and finished or failed but not reported yet.
        self._unfinished: dict[int, str] = {}
        self._finished: dict[int, dict[str, Any]] = {}
        self._failures: dict[int, str] = {}
        # Agreed state: the same on every rank.
        self._assigned: dict[int, _Assigned] = {}
        self._last_assigned = -1
        self._commits = 0
        self._newest: tuple[int, str, Lineage | None] | None = None
        self._busy: tuple[int, int] = (0, 0)  # (most unfinished promotions on a rank, rank)
        self._unreachable = ""  # the ranks that cannot reach the tier ("": none)
        self._committing: dict[int, str] = {}  # rank 0: steps whose commit object is due
        # Saves first: while a save of this rank writes its shard, uploads wait between parts.
        self._writing = 0
        self._quiet = threading.Condition()
        # Rank 0's hold on the URL; ``_lost_url``: agreed, why promotion stopped.
        self._owner: Ownership | None = None
        self._refused: str | None = None  # rank 0: why acquire() was refused
        self._acquiring = threading.Lock()
        self._opened = False  # open() has returned: a later connection acquires in background
        self._lost_url: str | None = None
        # Rewinds this pipeline knows of, and those rank 0 has yet to record in the tier.
        self._rewinds: dict[int, Rewind] = {}
        self._pending: dict[int, Rewind] = {}
        self._recorded: set[int] = set()

    # ------------------------------------------------------------------ open and close

    def open(self) -> None:
        """Open the persistent tier (``_open_steps``), waiting at most ``OPEN_WAIT_S``: a
        configuration or permission error raises a ConfigError here; an unreachable store
        does not keep the pipeline from opening from the local tier: it is tried again in
        the background (``PersistentUnavailable``, ``PersistentAvailable``; see
        ``connect``). Runs in a worker thread."""
        self._connection.start(OPEN_WAIT_S)
        with self._lock:
            self._opened = True
        if self.remote is not None:
            self._acquire_at_open()

    def _open_steps(self) -> Remote:
        """The steps of opening the persistent tier, at open and at every later attempt:
        open the root and list it once, so that a wrong URL or missing credentials fail at
        open, not at the first promotion. Runs in a daemon thread (``connect``)."""
        remote = open_remote(self._spec, threads=self.io_threads,
                             retries=self.config.retries,
                             options=self.config.options)
        retries, remote.retries = remote.retries, 0  # the connection's backoff retries it
        try:
            remote.gate = self._wait_for_quiet
            remote.list_steps()
            remote.retries = retries
            with self._lock:
                later = self._opened
            if later:  # a later attempt: the URL is taken before the tier counts as reached
                self.acquire(remote=remote)
        except BaseException:
            _close_quietly(remote)
            raise
        return remote

    def _connected(self, remote: Remote) -> None:
        self.url = remote.url
        self.remote = remote
        with self._lock:
            later = self._opened
        if later and self.rank == 0 and self._owner is None and self._refused is None:
            # reached by an attempt that began before open() returned: take the URL now
            threading.Thread(target=self._acquire_in_background, daemon=True,
                             name=f"ckpt-persist-acquire-r{self.rank}").start()

    def _acquire_at_open(self) -> None:
        """At open, with the store reachable: take the URL in a daemon thread, waiting for it
        at most ``OPEN_WAIT_S`` (longer only while a holder is watched: up to its lease),
        so that a live holder is refused here (``PersistentInUseError``) while a store that
        hangs or fails does not hold the open up: the acquisition goes on in the background,
        and rank 0 uploads and commits nothing until it succeeds."""
        until = [time.monotonic() + OPEN_WAIT_S]
        cond = threading.Condition()
        outcome: list[BaseException | None] = []

        def watching(lease: float) -> None:
            with cond:
                until[0] = max(until[0], time.monotonic() + lease + OPEN_WAIT_S)
                cond.notify_all()

        def first(error: BaseException | None) -> None:
            with cond:
                outcome.append(error)
                cond.notify_all()

        threading.Thread(target=self._acquire_in_background, args=(first, watching),
                         daemon=True, name=f"ckpt-persist-acquire-r{self.rank}").start()
        with cond:
            while not outcome and time.monotonic() < until[0]:
                cond.wait(until[0] - time.monotonic())
        if outcome and isinstance(outcome[0], PersistentInUseError):
            raise outcome[0]
        if not outcome or outcome[0] is not None:
            log.warning("ckpt.persist.acquire_pending", rank=self.rank, url=self.url,
                        error="no answer in time" if not outcome else str(outcome[0]),
                        action="taking the URL in the background; nothing is promoted "
                               "until then")

    def _acquire_in_background(
        self, first: Callable[[BaseException | None], None] | None = None,
        watching: Callable[[float], None] | None = None,
    ) -> None:
        """Take the URL, with backoff on store errors, until it is taken, refused (reported,
        so that every rank stops promoting) or the promoter closes. ``first`` hears how the
        first attempt ended (None: taken)."""
        delay = 1.0
        while not self._stopped:
            try:
                self.acquire(watching)
            except PersistentInUseError as exc:
                if first is not None:
                    first(exc)
                else:
                    log.error("ckpt.persist.refused", rank=self.rank, url=self.url,
                              error=exc.message, hint=exc.hint)
                return
            except CheckpointError as exc:
                log.warning("ckpt.persist.acquire_failed", rank=self.rank, url=self.url,
                            error=exc.message, retry_in_s=delay)
                if first is not None:
                    first(exc)
                    first = None
            else:
                if first is not None:
                    first(None)
                return
            with self._quiet:
                self._quiet.wait_for(lambda: self._stopped, timeout=delay)
            delay = min(60.0, delay * 2)

    def acquire(self, watching: Callable[[float], None] | None = None, *,
                remote: Remote | None = None) -> None:
        """Rank 0: take the URL for this open (``Ownership.acquire``: refused with
        ``PersistentInUseError`` while another job's heartbeat advances) and start its
        heartbeat. One step of opening, callable once the store is reachable. Runs in a
        worker thread."""
        with self._acquiring:
            if self.rank != 0 or self._owner is not None or self._refused is not None:
                return
            remote = remote if remote is not None else self.remote
            assert remote is not None
            self._acquire(remote, watching)

    def _acquire(self, remote: Remote, watching: Callable[[float], None] | None) -> None:
        try:
            owner = Ownership.acquire(
                remote, root=str(self.storage.root),
                lease_s=self.config.lease_s,
                takeover=self.config.takeover, emit=self._emit, rank=self.rank,
                watching=watching)
        except PersistentInUseError as exc:
            self._refused = exc.message  # reported, so that every rank stops promoting
            raise
        with self._quiet:  # against close(): a URL taken after it is let go at once
            closed = self._stopped
            if not closed:
                self._owner = owner
                owner.start_heartbeat()
        if closed:
            owner.release()

    def release(self) -> None:
        """Rank 0, at a clean close: release the URL (``Ownership.release``), waiting at
        most ``SMALL_TIMEOUT_S`` for the store (then the next job takes the URL over after
        one lease). Runs in a worker thread."""
        if self._owner is None:
            return
        try:
            bounded(self._owner.release, SMALL_TIMEOUT_S, f"ckpt-persist-release-r{self.rank}")
        except TimeoutError as exc:
            log.warning("ckpt.persist.release_failed", rank=self.rank, url=self.url,
                        error=str(exc))

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around a save's disk writes: uploads of this rank pause between parts meanwhile,
        so that a promotion never slows a save down (it only finishes later)."""
        with self._quiet:
            self._writing += 1
        try:
            yield
        finally:
            with self._quiet:
                self._writing -= 1
                if not self._writing:
                    self._quiet.notify_all()

    def _wait_for_quiet(self) -> None:
        """Before each part of an upload: wait while a save writes (at most
        ``_PAUSE_MAX_S`` at a time, so that back-to-back saves cannot starve uploads); once
        closed, stop the upload."""
        with self._quiet:
            self._quiet.wait_for(lambda: not self._writing or self._stopped,
                                 timeout=_PAUSE_MAX_S)
        if self._stopped:
            raise _Stopped

    def wait(self, timeout: float, *, uploads: bool = True) -> bool:
        """Wait until this rank's uploads (unless not ``uploads``) and rank 0's commit
        objects are done (True), or ``timeout`` passed (False). Runs in a worker thread."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._futures = [(u, f) for u, f in self._futures if not f.done()]
                futures = [f for u, f in self._futures if uploads or not u]
            if not futures:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            concurrent.futures.wait(futures, timeout=left)

    def close(self) -> None:
        """Stop: uploads in flight stop at their next part and rank 0 writes no more commit
        objects; a step whose promotion did not end is never committed (the next promotion,
        or rank 0's pruning, removes its objects) and is reported (``PersistFailed``). The
        threads still waiting on the store are daemons: they never keep the process alive."""
        with self._quiet:
            self._stopped = True
            self._quiet.notify_all()
            owner = self._owner
        self._connection.close()
        self._uploads.shutdown(wait=False, cancel_futures=True)
        self._meta.shutdown(wait=False, cancel_futures=True)
        if owner is not None:
            owner.stop()
        unfinished = {**{s: a.save_id for s, a in self._assigned.items()}, **self._committing}
        self._assigned.clear()
        for step, save_id in sorted(unfinished.items()):
            self._emit(PersistFailed(
                step=step, rank=self.rank, save_id=save_id, url=self.url,
                error="the promotion did not end before the pipeline closed (within "
                      f"persist_timeout_s={self.config.timeout_s:g} s at a clean "
                      "close); the step was not committed in the persistent tier and stays "
                      "in the local tier"))
        if self.remote is not None:
            _close_quietly(self.remote)

    # ------------------------------------------------------------------ agreement

    def report(self) -> dict[str, Any]:
        """What this rank tells the others in the commit vote (each outcome once)."""
        with self._lock:
            done = {str(s): d for s, d in self._finished.items()}
            failed = {str(s): e for s, e in self._failures.items()}
            self._finished.clear()
            self._failures.clear()
            report: dict[str, Any] = {"unfinished": len(self._unfinished), "done": done,
                                      "failed": failed,
                                      # rank 0 promotes only once it holds the URL
                                      "reachable": self.remote is not None and (
                                          self.rank != 0 or self._owner is not None)}
        lost = self._refused if self._owner is None else self._owner.lost
        if lost is not None:
            report["lost"] = lost
        return report

    def on_reports(self, reports: Sequence[Any]) -> None:
        """Every rank's ``report()`` of one exchange: record finished uploads, commit the
        steps every rank finished, give up the steps a rank failed. Same on every rank."""
        lost = reports[0].get("lost") if reports and isinstance(reports[0], dict) else None
        if isinstance(lost, str) and self._lost_url is None:
            self._stop_promoting(lost)
        if self._lost_url is not None:
            return
        busiest = (0, 0)
        failed: dict[int, dict[int, str]] = {}
        unreachable = []
        for rank, report in enumerate(reports):
            if not isinstance(report, dict):  # a rank without the tier: nothing completes
                busiest = max(busiest, (_QUEUED_MAX, rank), key=lambda b: b[0])
                continue
            if report.get("reachable") is False:
                unreachable.append(rank)
            unfinished = report.get("unfinished")
            if isinstance(unfinished, int):
                busiest = max(busiest, (unfinished, rank), key=lambda b: b[0])
            for key, value in _items(report.get("done")):
                step = _step(key)
                if step in self._assigned and isinstance(value, dict):
                    self._assigned[step].reports[rank] = value
            for key, value in _items(report.get("failed")):
                step = _step(key)
                if step in self._assigned:
                    failed.setdefault(step, {})[rank] = str(value)
        self._busy = busiest
        self._unreachable = "" if not unreachable else (
            f"rank{'s' if len(unreachable) > 1 else ''} "
            f"{', '.join(map(str, unreachable[:8]))}{', ...' if len(unreachable) > 8 else ''}")
        for step, errors in sorted(failed.items()):
            assigned = self._assigned.pop(step)
            error = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=assigned.save_id,
                                     url=self.url, error=error))
            if self.rank == 0:
                self._submit(self._meta, self._remove_step, step)
        for step in sorted(self._assigned):
            assigned = self._assigned[step]
            if len(assigned.reports) == self.world_size:
                del self._assigned[step]
                if self.rank == 0:
                    self._committing[step] = assigned.save_id
                    self._submit(self._meta, self._commit_step, step, assigned)

    def _stop_promoting(self, reason: str) -> None:
        """The URL is another job's (rank 0 said so): give up every step in flight and
        promote nothing more. Same on every rank."""
        self._lost_url = reason
        log.error("ckpt.persist.stopped", rank=self.rank, url=self.url, reason=reason,
                  hint="another job promotes to this URL; give each job its own persistent "
                       "URL. The local tier keeps every committed step")
        for step, assigned in sorted(self._assigned.items()):
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=assigned.save_id,
                                     url=self.url, error=f"not committed: {reason}"))
        self._assigned.clear()

    def committed(self, step: int, save_id: str, lineage: Lineage | None = None) -> None:
        """A step committed on every rank: assign it when it is due (same on every rank).
        ``lineage``: its commit records' (the commit object names it too)."""
        self._commits += 1
        self._newest = (step, save_id, lineage)
        if self._commits % self.config.every == 0:
            self._assign(step, save_id, lineage, closing=False)

    def closing(self) -> None:
        """At a clean close: promote the newest step committed since open too
        (``persist_on_close``)."""
        if self._newest is not None and self.config.on_close:
            self._assign(*self._newest, closing=True)

    def protected(self) -> set[int]:
        """Steps this rank is still uploading: the local retention keeps them until then."""
        with self._lock:
            return set(self._unfinished)

    def _assign(self, step: int, save_id: str, lineage: Lineage | None, *,
                closing: bool) -> None:
        if step <= self._last_assigned:
            return
        if self._lost_url is not None:  # never silent: each step due fails, naming why
            self._last_assigned = step
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=save_id,
                                     url=self.url, error=f"not promoted: {self._lost_url}"))
            return
        if self._unreachable:
            self._last_assigned = step  # reported once, not again at close
            self._emit(PersistSkipped(
                step=step, rank=self.rank,
                reason=f"the persistent tier {self.url} is unreachable from "
                       f"{self._unreachable} (retried in the background)"))
            return
        most, rank = self._busy
        if most >= _QUEUED_MAX and not closing:
            self._emit(PersistSkipped(
                step=step, rank=self.rank,
                reason=f"rank {rank} still has {most} earlier promotion(s) unfinished"))
            return
        self._last_assigned = step
        self._assigned[step] = _Assigned(save_id, time.monotonic(), {}, lineage)
        with self._lock:
            self._unfinished[step] = save_id
        self._submit(self._uploads, self._upload, step, save_id)

    def _submit(self, pool: DaemonPool, fn: Callable[..., None], *args: Any) -> None:
        try:
            future = pool.submit(fn, *args)
        except RuntimeError:  # closed
            return
        with self._lock:
            self._futures.append((pool is self._uploads, future))

    # ------------------------------------------------------------------ worker threads

    def _upload(self, step: int, save_id: str) -> None:
        """Upload this rank's files of ``step``, commit record last."""
        started = time.perf_counter()
        remote = self.remote
        dir_name = step_dir_name(step)
        try:
            if remote is None:  # not assigned while a rank cannot reach the tier
                raise RemoteError(f"{self.url} is not reachable", path=self.url,
                                  transient=True, hint=UNAVAILABLE_HINT)
            # Once the URL is known to be another job's, nothing more is written into it.
            lost = self._lost_url if self.rank != 0 else self._lost()
            if lost is not None:
                raise CheckpointError(f"not uploaded: {lost}")
            sums: dict[str, list[Any]] = {}
            stamps: dict[str, str | None] = {}
            for name, key in rank_keys(step, self.rank).items():
                rel = os.path.join(dir_name, name)
                sums[name] = remote.upload(self.storage, rel, key).to_msg()
                stamps[name] = remote.stamp(key)
            size = sum(int(s[0]) for s in sums.values())
            self._emit(ShardUploaded(step=step, rank=self.rank, save_id=save_id,
                                     url=self.url, bytes=size,
                                     seconds=time.perf_counter() - started))
            with self._lock:
                self._finished[step] = {"sums": sums, "stamps": stamps}
        except Exception as exc:
            if self._stopped:  # closed meanwhile: close() reports the step
                return
            error = exc.message if isinstance(exc, CheckpointError) else (
                f"{type(exc).__name__}: {exc}")
            log.warning("ckpt.persist.upload_failed", step=step, rank=self.rank, url=self.url,
                        error=error)
            with self._lock:
                self._failures[step] = error
        finally:
            with self._lock:
                self._unfinished.pop(step, None)

    def _commit_step(self, step: int, assigned: _Assigned) -> None:
        """Rank 0: check the URL is still this open's and every object of the step is the
        one its rank uploaded, then write ``step.commit`` last (not once closed: ``close``
        reports the step instead)."""
        try:
            self._write_commit(step, assigned)
        finally:
            self._committing.pop(step, None)

    def _write_commit(self, step: int, assigned: _Assigned) -> None:
        remote = self.remote
        assert remote is not None  # assigned only while every rank reaches the tier
        dir_name = step_dir_name(step)
        self._flush_rewinds()
        if abandoned(step, assigned.lineage, self.marks()):
            log.info("ckpt.persist.abandoned_not_committed", step=step, rank=self.rank,
                     url=self.url, save_id=assigned.save_id)
            self._remove_step(step)
            return
        try:
            lost = self._lost()
        except Exception as exc:
            lost = None
            error = exc.message if isinstance(exc, CheckpointError) else (
                f"{type(exc).__name__}: {exc}")
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=assigned.save_id,
                                     url=self.url, error=f"owner object: {error}"))
            return  # what it could not read is no reason to remove the step's objects
        if lost is not None:  # the objects may be the new holder's now: leave them
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=assigned.save_id,
                                     url=self.url, error=f"not committed: {lost}"))
            return
        try:
            objects, stamps = self._reported(step, assigned)
            self._check_objects(remote, dir_name, objects, stamps)
            record = StepRecord(step, assigned.save_id, self.world_size, objects,
                                lineage=assigned.lineage)
            if self._stopped:
                return
            remote.put_small(f"{dir_name}/{STEP_COMMIT}", encode_step_record(record))
        except Exception as exc:
            if self._stopped:
                return
            error = exc.message if isinstance(exc, CheckpointError) else (
                f"{type(exc).__name__}: {exc}")
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=assigned.save_id,
                                     url=self.url, error=f"commit object: {error}"))
            self._remove_step(step)
            return
        self._emit(StepPersisted(step=step, rank=self.rank, save_id=assigned.save_id,
                                 url=self.url,
                                 seconds=time.monotonic() - assigned.committed_at))
        self._sweep(step)
        self._prune(step)

    def _lost(self) -> str | None:
        """Rank 0: None while the URL is this open's (its owner object re-read), else why
        not."""
        if self._owner is None:
            return f"this open does not hold the persistent URL {self.url}"
        return self._owner.check()

    def _reported(self, step: int, assigned: _Assigned
                  ) -> tuple[dict[str, ObjectSum], dict[str, str | None]]:
        """Every rank's reported checksum and stamp of each of its objects of ``step``."""
        objects: dict[str, ObjectSum] = {}
        stamps: dict[str, str | None] = {}
        for rank, report in sorted(assigned.reports.items()):
            sums, marks = report.get("sums"), report.get("stamps")
            if not isinstance(sums, dict) or not isinstance(marks, dict):
                raise CheckpointIntegrityError(f"rank {rank} sent a malformed report")
            for name in rank_keys(step, rank):
                if name not in sums:
                    raise CheckpointIntegrityError(f"rank {rank} did not report {name}")
                objects[name] = ObjectSum.from_msg(sums[name])
                mark = marks.get(name)
                stamps[name] = mark if isinstance(mark, str) else None
        return objects, stamps

    def _check_objects(self, remote: Remote, dir_name: str, objects: dict[str, ObjectSum],
                       stamps: dict[str, str | None]) -> None:
        """Every object is there with its size, and is the one its rank uploaded: the same
        stamp, or (where the store gives none) a rank commit record of the same content, so
        that another job's objects of the same step number cannot pass."""
        present = remote.list_dir(dir_name)
        for name, expected in objects.items():
            if present.get(name) != expected.size:
                raise CheckpointIntegrityError(
                    f"{dir_name}/{name} is {present.get(name, 'missing')} bytes in the "
                    f"persistent tier, {expected.size} were uploaded")
        stored = remote.stamps(dir_name) if any(v is not None for v in stamps.values()) else {}
        for name, expected in objects.items():
            mark = stamps.get(name)
            if mark is not None:
                same = stored.get(name) == mark
            elif name.endswith(".commit"):
                data = remote.get_small(f"{dir_name}/{name}", expected.size)
                same = data is not None and ObjectSum.of(data, expected.part_bytes) == expected
            else:
                continue
            if not same:
                raise CheckpointIntegrityError(
                    f"{dir_name}/{name} in the persistent tier is not the object this run "
                    "uploaded: another job wrote it since")

    def _remove_step(self, step: int) -> None:
        """Rank 0: take a step off the persistent tier, its commit object first, and what
        killed uploads left of it. Nothing once the URL is another job's."""
        remote = self.remote
        if remote is None or self._owner is None or self._owner.lost is not None:
            return
        dir_name = step_dir_name(step)
        try:
            names = remote.list_dir(dir_name)
            if STEP_COMMIT in names:
                remote.delete([f"{dir_name}/{STEP_COMMIT}"])
            leftovers = remote.leftovers(dir_name)
            remote.delete([f"{dir_name}/{n}" for n in [*names, *leftovers]
                           if n != STEP_COMMIT])
        except Exception as exc:
            log.warning("ckpt.persist.remove_failed", step=step, rank=self.rank, url=self.url,
                        error=f"{type(exc).__name__}: {exc}")
            return
        if names or leftovers:
            self._emit(PersistPruned(step=step, rank=self.rank, url=self.url,
                                     complete=STEP_COMMIT in names))

    def _sweep(self, step: int) -> None:
        """Rank 0: remove what killed uploads left in a complete step's prefix (temporaries
        of another attempt at the same step). Failures are logged."""
        remote = self.remote
        assert remote is not None
        dir_name = step_dir_name(step)
        try:
            leftovers = remote.leftovers(dir_name)
            if leftovers:
                remote.delete([f"{dir_name}/{n}" for n in leftovers])
                log.info("ckpt.persist.leftovers_removed", step=step, rank=self.rank,
                         url=self.url, names=leftovers)
        except Exception as exc:
            log.warning("ckpt.persist.remove_failed", step=step, rank=self.rank, url=self.url,
                        error=f"{type(exc).__name__}: {exc}")

    def _prune(self, newest: int) -> None:
        """Rank 0, after committing ``newest``: keep the newest ``persistent_keep`` complete
        steps; remove the others, and unfinished promotions older than ``newest``, and what
        killed uploads left in the steps kept."""
        remote = self.remote
        assert remote is not None
        if self._owner is None or self._owner.lost is not None:
            return
        keep = self.config.keep
        try:
            steps = sorted((s for s in map(parse_step_dir, remote.list_steps())
                            if s is not None), reverse=True)
            complete = [s for s in steps if remote.exists(f"{step_dir_name(s)}/{STEP_COMMIT}")]
        except Exception as exc:
            log.warning("ckpt.persist.prune_failed", rank=self.rank, url=self.url,
                        error=f"{type(exc).__name__}: {exc}")
            return
        kept = set(complete if keep is None else complete[:keep])
        for step in steps:
            if step >= newest or step in self._assigned:
                continue
            if step in kept:
                self._sweep(step)
            else:
                self._remove_step(step)

    # ------------------------------------------------------------------ rewinds

    def rewound(self, rewinds: Sequence[Rewind]) -> bool:
        """The run was rewound (``rewinds``: this one, or those a local root records): on
        rank 0, record them in the tier and take the abandoned steps' commit objects off it.
        Returns whether the tier has them now (True on other ranks). When it cannot be
        reached they stay pending (logged), recorded before the next commit object; readers
        meanwhile ignore the abandoned steps by the local records. Worker thread."""
        with self._lock:
            for rewind in rewinds:
                if rewind.timeline not in self._rewinds:
                    self._rewinds[rewind.timeline] = rewind
                    if self.rank == 0:
                        self._pending[rewind.timeline] = rewind
        try:  # a hung store must not hold the restore up: then the rewind stays pending
            return bounded(self._flush_rewinds, LIST_WAIT_S, f"ckpt-persist-rewind-r{self.rank}")
        except TimeoutError as exc:
            log.warning("ckpt.persist.rewind_pending", rank=self.rank, url=self.url,
                        error=str(exc), action="the rewind is recorded in the local roots; "
                        "it is recorded in the tier before the next commit object")
            return False

    def marks(self) -> set[Mark]:
        """The marks of the rewinds this pipeline knows of."""
        with self._lock:
            return {r.mark for r in self._rewinds.values()}

    def _flush_rewinds(self) -> bool:
        with self._lock:
            pending = list(self._pending.values())
        if not pending:
            return True
        remote = self.remote
        try:
            if remote is None:
                raise CheckpointError("the persistent tier is not open")
            if self._owner is None or self._owner.lost is not None:
                raise CheckpointError("this open does not hold the persistent URL")
            # Recorded by this pipeline already (its drop failed), or new to the tier: the
            # abandoned commit objects go. One the tier recorded before is left alone.
            recorded = [r for r in pending if r.timeline in self._recorded]
            recorded += record_rewinds(remote, [r for r in pending if r not in recorded])
            self._recorded |= {r.timeline for r in recorded}
            gone: list[int] = []
            if recorded:
                records = complete_steps(remote, rank=self.rank)
                gone = drop_commit_objects(remote, records,
                                           tier_marks(records, pending) | self.marks())
        except Exception as exc:
            error = exc.message if isinstance(exc, CheckpointError) else (
                f"{type(exc).__name__}: {exc}")
            log.warning("ckpt.persist.rewind_pending", rank=self.rank, url=self.url,
                        timelines=[r.timeline for r in pending], error=error,
                        action="the rewind is recorded in the local roots; it is recorded "
                               "in the tier before the next commit object")
            return False
        with self._lock:
            for rewind in pending:
                self._pending.pop(rewind.timeline, None)
        for step in gone:  # before any upload of the new timeline can reuse the prefix
            self._remove_step(step)
        log.debug("ckpt.persist.rewind_recorded", rank=self.rank, url=self.url,
                  timelines=[r.timeline for r in pending], abandoned=gone)
        return True

    # ------------------------------------------------------------------ restore

    def complete_steps(self) -> dict[int, StepRecord]:
        """``complete_steps`` of this rank's persistent tier, within ``LIST_WAIT_S``: a
        RemoteError when the store cannot be reached in that time (the restore then goes on
        with the local tier and the copies); the newest steps read by then when the
        listing takes longer. Runs in a worker thread."""
        deadline = time.monotonic() + LIST_WAIT_S
        if not self._connection.reach(LIST_WAIT_S):
            raise RemoteError(
                f"the persistent tier {self.url} is unreachable: {self._connection.error}",
                path=self.url, transient=True, hint=UNAVAILABLE_HINT)
        remote = self.remote
        assert remote is not None
        found: list[StepRecord] = []
        try:
            bounded(lambda: complete_steps(remote, rank=self.rank, into=found),
                    max(0.0, deadline - time.monotonic()), f"ckpt-persist-list-r{self.rank}")
        except TimeoutError:
            log.warning("ckpt.recovery.persisted_partial", rank=self.rank, url=self.url,
                        steps=[r.step for r in found], wait_s=LIST_WAIT_S,
                        action="the restore considers the newest steps read in time")
        return {r.step: r for r in list(found)}

    def recorded_rewinds(self) -> list[Rewind]:
        """The rewinds the tier records (``timeline.rewinds``), within ``LIST_WAIT_S``: a
        RemoteError when the store is not reachable or does not answer in that time. Runs
        in a worker thread."""
        remote = self.remote
        if remote is None or not self._connection.reachable:
            raise RemoteError(f"the persistent tier {self.url} is unreachable", path=self.url,
                              transient=True, hint=UNAVAILABLE_HINT)
        try:
            return bounded(lambda: read_tier_rewinds(remote), LIST_WAIT_S,
                           f"ckpt-persist-rewinds-r{self.rank}")
        except TimeoutError as exc:
            raise RemoteError(f"reading the rewinds of {self.url}: {exc}", path=self.url,
                              transient=True, hint=UNAVAILABLE_HINT) from None

    def stream(self, record: StepRecord) -> ShardStream:
        """This rank's shard of ``record``'s step, downloading into its root while the
        restore reads it (``ShardStream``). Runs in a worker thread."""
        assert self.remote is not None
        return ShardStream(self.remote, self.storage, record, self.rank)


def complete_steps(remote: Remote, *, rank: int | None = None,
                   into: list[StepRecord] | None = None) -> dict[int, StepRecord]:
    """The steps complete in the persistent tier: a commit object that decodes and names its
    step. A step whose commit object is unreadable is logged and left out. The commit
    objects are read newest first, each appended to ``into`` as it is read (for a caller that
    stops waiting)."""
    out: dict[int, StepRecord] = {}
    steps = (parse_step_dir(name) for name in remote.list_steps())
    for step in sorted((s for s in steps if s is not None), reverse=True):
        try:
            record = read_step_record(remote, step)
        except CheckpointError as exc:
            log.warning("ckpt.recovery.persisted_invalid", step=step, rank=rank,
                        url=remote.url, reason=exc.message)
            continue
        if record is not None:
            out[step] = record
            if into is not None:
                into.append(record)
    return dict(sorted(out.items()))


def read_step_record(remote: Remote, step: int) -> StepRecord | None:
    """The commit object of ``step`` (None: there is none); CheckpointIntegrityError when it
    does not decode or is for another step."""
    key = f"{step_dir_name(step)}/{STEP_COMMIT}"
    where = f"{remote.url}/{key}"
    raw = remote.get_small(key, MAX_COMMIT_BYTES)
    if raw is None:
        return None
    record = decode_step_record(raw, where)
    if record.step != step:
        raise CheckpointIntegrityError(f"the commit object {where} is for step {record.step}",
                                       step=step, path=where)
    return record


def download_rank(remote: Remote, storage: Storage, record: StepRecord, rank: int
                  ) -> tuple[str, int]:
    """Download ``rank``'s files of ``record``'s step into ``storage``, each part checked
    against the commit object, published as a save publishes them (commit record last).
    Returns (path of the shard, bytes). Runs in a worker thread."""
    stream = ShardStream(remote, storage, record, rank)
    try:
        path, size, _ = stream.publish()
    except BaseException:
        stream.discard()
        raise
    return path, size


def _close_quietly(remote: Remote) -> None:
    with contextlib.suppress(Exception):
        remote.close()


def _items(value: Any) -> list[tuple[Any, Any]]:
    return list(value.items()) if isinstance(value, dict) else []


def _step(key: Any) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        return -1
