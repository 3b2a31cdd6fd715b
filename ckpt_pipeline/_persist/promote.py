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
  ``PersistFailed`` and rank 0 removes what was uploaded of the step.

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

from .._format.names import parse_step_dir, step_dir_name
from .._logging import log
from ..config import PipelineConfig
from ..errors import CheckpointError, CheckpointIntegrityError
from ..events import (
    Event,
    PersistFailed,
    PersistPruned,
    PersistSkipped,
    ShardUploaded,
    StepPersisted,
)
from ..storage import Storage
from .connect import Connection
from .layout import (
    MAX_COMMIT_BYTES,
    STEP_COMMIT,
    StepRecord,
    decode_step_record,
    encode_step_record,
    rank_keys,
)
from .remote import UNAVAILABLE_HINT, ObjectSum, Remote, RemoteError, _display, open_remote
from .stream import ShardStream
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


class Promoter:
    """This rank's side of the persistent tier (see the module docstring)."""

    def __init__(self, storage: Storage, config: PipelineConfig,
                 emit: Callable[[Event], None]) -> None:
        assert config.persistent is not None
        self.storage = storage
        self.config = config
        self.rank = config.rank
        self.world_size = config.world_size
        self._emit = emit
        self._spec = config.persistent
        self.remote: Remote | None = None
        self.url = _display(config.persistent)
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
        self._newest: tuple[int, str] | None = None
        self._busy: tuple[int, int] = (0, 0)  # (most unfinished promotions on a rank, rank)
        self._unreachable = ""  # the ranks that cannot reach the tier ("": none)
        self._committing: dict[int, str] = {}  # rank 0: steps whose commit object is due
        # Saves first: while a save of this rank writes its shard, uploads wait between parts.
        self._writing = 0
        self._quiet = threading.Condition()

    # ------------------------------------------------------------------ open and close

    def open(self) -> None:
        """Open the persistent tier (``_open_steps``), waiting at most ``OPEN_WAIT_S``: a
        configuration or permission error raises a ConfigError here; an unreachable store
        does not keep the pipeline from opening from the local tier: it is tried again in
        the background (``PersistentUnavailable``, ``PersistentAvailable``; see
        ``connect``). Runs in a worker thread."""
        self._connection.start(OPEN_WAIT_S)

    def _open_steps(self) -> Remote:
        """The steps of opening the persistent tier, at open and at every later attempt:
        open the root and list it once, so that a wrong URL or missing credentials fail at
        open, not at the first promotion. Runs in a daemon thread (``connect``)."""
        remote = open_remote(self._spec, threads=self.config.io_threads,
                             retries=self.config.persist_retries,
                             options=self.config.persistent_options)
        retries, remote.retries = remote.retries, 0  # the connection's backoff retries it
        try:
            remote.gate = self._wait_for_quiet
            remote.list_steps()
            remote.retries = retries
        except BaseException:
            _close_quietly(remote)
            raise
        return remote

    def _connected(self, remote: Remote) -> None:
        self.url = remote.url
        self.remote = remote

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
        self._connection.close()
        self._uploads.shutdown(wait=False, cancel_futures=True)
        self._meta.shutdown(wait=False, cancel_futures=True)
        unfinished = {**{s: a.save_id for s, a in self._assigned.items()}, **self._committing}
        self._assigned.clear()
        for step, save_id in sorted(unfinished.items()):
            self._emit(PersistFailed(
                step=step, rank=self.rank, save_id=save_id, url=self.url,
                error="the promotion did not end before the pipeline closed (within "
                      f"persist_timeout_s={self.config.persist_timeout_s:g} s at a clean "
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
            return {"unfinished": len(self._unfinished), "done": done, "failed": failed,
                    "reachable": self.remote is not None}

    def on_reports(self, reports: Sequence[Any]) -> None:
        """Every rank's ``report()`` of one exchange: record finished uploads, commit the
        steps every rank finished, give up the steps a rank failed. Same on every rank."""
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

    def committed(self, step: int, save_id: str) -> None:
        """A step committed on every rank: assign it when it is due (same on every rank)."""
        self._commits += 1
        self._newest = (step, save_id)
        if self._commits % self.config.persist_every == 0:
            self._assign(step, save_id, closing=False)

    def closing(self) -> None:
        """At a clean close: promote the newest step committed since open too
        (``persist_on_close``)."""
        if self._newest is not None and self.config.persist_on_close:
            self._assign(*self._newest, closing=True)

    def protected(self) -> set[int]:
        """Steps this rank is still uploading: the local retention keeps them until then."""
        with self._lock:
            return set(self._unfinished)

    def _assign(self, step: int, save_id: str, *, closing: bool) -> None:
        if step <= self._last_assigned:
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
        self._assigned[step] = _Assigned(save_id, time.monotonic(), {})
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
            sums: dict[str, list[Any]] = {}
            for name, key in rank_keys(step, self.rank).items():
                local = os.path.join(str(self.storage.root), dir_name, name)
                sums[name] = remote.upload(local, key).to_msg()
            size = sum(int(s[0]) for s in sums.values())
            self._emit(ShardUploaded(step=step, rank=self.rank, save_id=save_id,
                                     url=self.url, bytes=size,
                                     seconds=time.perf_counter() - started))
            with self._lock:
                self._finished[step] = sums
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
        """Rank 0: check every rank's objects are there, write ``step.commit`` last (not
        once closed: ``close`` reports the step instead)."""
        try:
            self._write_commit(step, assigned)
        finally:
            self._committing.pop(step, None)

    def _write_commit(self, step: int, assigned: _Assigned) -> None:
        remote = self.remote
        assert remote is not None  # assigned only while every rank reaches the tier
        dir_name = step_dir_name(step)
        try:
            objects: dict[str, ObjectSum] = {}
            for rank, sums in sorted(assigned.reports.items()):
                for name in rank_keys(step, rank):
                    if name not in sums:
                        raise CheckpointIntegrityError(f"rank {rank} did not report {name}")
                    objects[name] = ObjectSum.from_msg(sums[name])
            present = remote.list_dir(dir_name)
            for name, expected in objects.items():
                if present.get(name) != expected.size:
                    raise CheckpointIntegrityError(
                        f"{dir_name}/{name} is {present.get(name, 'missing')} bytes in the "
                        f"persistent tier, {expected.size} were uploaded")
            record = StepRecord(step, assigned.save_id, self.world_size, objects)
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
        self._prune(step)

    def _remove_step(self, step: int) -> None:
        """Rank 0: take a step off the persistent tier, its commit object first."""
        remote = self.remote
        if remote is None:
            return
        dir_name = step_dir_name(step)
        try:
            names = remote.list_dir(dir_name)
            if STEP_COMMIT in names:
                remote.delete([f"{dir_name}/{STEP_COMMIT}"])
            remote.delete([f"{dir_name}/{n}" for n in names if n != STEP_COMMIT])
            leftovers = remote.remove_leftovers(dir_name)
        except Exception as exc:
            log.warning("ckpt.persist.remove_failed", step=step, rank=self.rank, url=self.url,
                        error=f"{type(exc).__name__}: {exc}")
            return
        if names or leftovers:
            self._emit(PersistPruned(step=step, rank=self.rank, url=self.url,
                                     complete=STEP_COMMIT in names))

    def _prune(self, newest: int) -> None:
        """Rank 0, after committing ``newest``: keep the newest ``persistent_keep`` complete
        steps; remove the others, and unfinished promotions older than ``newest``."""
        remote = self.remote
        assert remote is not None
        keep = self.config.persistent_keep
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
            if step in kept or step >= newest or step in self._assigned:
                continue
            self._remove_step(step)

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
