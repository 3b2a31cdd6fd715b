"""Promotion of committed steps to the persistent tier, and download at restore.

Each rank uploads its own committed files of a step (shard, manifest, commit record) from its
local root, in a thread of its own, one step after the other: never from the training's memory,
never on the event loop. Which steps are promoted, which are skipped and when a step is complete
are decided from what every rank reports in the first commit vote of each save (and in one more
exchange at close), so every rank takes the same decisions in the same order:

- every ``persist_every``-th committed step is assigned, unless some rank still has two
  promotions unfinished (one uploading, one queued): then it is skipped (``PersistSkipped``);
- a rank reports each finished upload once, with the checksum of every object; once every rank
  has reported a step, rank 0 checks the objects are there and writes ``step.commit`` last
  (``StepPersisted``), then applies ``persistent_keep``;
- a rank that failed (after the remote layer's retries) reports its error: every rank emits
  ``PersistFailed`` and rank 0 removes what was uploaded of the step;
- a rewind (``rewound``) is recorded in the tier by rank 0 (``rewinds.py``), which then takes
  the abandoned steps off it; a promotion of an abandoned step is never committed. While the
  tier cannot be reached the rewind stays pending, and is recorded before the next commit
  object.

A step being uploaded is kept in the local tier until its upload ends (``protected``). Saves
come first: while a save of this rank writes its shard, uploads wait between parts
(``writing``), so the disk is shared in the gaps between saves, not during them.
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
from .._format.timeline import Lineage, Mark, Rewind, abandoned
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
from .layout import (
    MAX_COMMIT_BYTES,
    STEP_COMMIT,
    StepRecord,
    decode_step_record,
    encode_step_record,
    rank_keys,
)
from .remote import ObjectSum, Remote, open_remote
from .rewinds import drop_commit_objects, record_rewinds, tier_marks
from .stream import ShardStream

__all__ = ("Promoter", "complete_steps", "download_rank", "read_step_record")

_PAUSE_MAX_S = 30.0
_QUEUED_MAX = 2
"""Unfinished promotions a rank may have (one uploading, one waiting) before one is skipped."""


@dataclass(slots=True)
class _Assigned:
    save_id: str
    committed_at: float
    reports: dict[int, dict[str, Any]]
    lineage: Lineage | None = None


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
        self.url = config.persistent
        self._lock = threading.Lock()
        self._uploads = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"ckpt-persist-r{self.rank}")
        self._meta = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"ckpt-persist-meta-r{self.rank}")
        self._futures: list[concurrent.futures.Future[None]] = []
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
        # Saves first: while a save of this rank writes its shard, uploads wait between parts.
        self._writing = 0
        self._quiet = threading.Condition()
        # Rewinds this pipeline knows of, and those rank 0 has yet to record in the tier.
        self._rewinds: dict[int, Rewind] = {}
        self._pending: dict[int, Rewind] = {}
        self._recorded: set[int] = set()

    # ------------------------------------------------------------------ open and close

    def open(self) -> None:
        """Open the persistent root and list it once, so that a wrong URL or missing
        credentials fail at open, not at the first promotion. Runs in a worker thread."""
        self.remote = open_remote(self._spec, threads=self.config.io_threads,
                                  retries=self.config.persist_retries,
                                  options=self.config.persistent_options)
        self.url = self.remote.url
        self.remote.gate = self._wait_for_quiet
        self.remote.list_steps()

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
        ``_PAUSE_MAX_S`` at a time, so that back-to-back saves cannot starve uploads)."""
        with self._quiet:
            self._quiet.wait_for(lambda: not self._writing, timeout=_PAUSE_MAX_S)

    def wait(self, timeout: float) -> bool:
        """Wait until this rank's uploads and rank 0's commit objects are done (True), or
        ``timeout`` passed (False). Runs in a worker thread."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                futures = [f for f in self._futures if not f.done()]
                self._futures = futures
            if not futures:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            concurrent.futures.wait(futures, timeout=left)

    def close(self) -> None:
        """Stop: an upload in flight is left to its thread and its objects are never
        committed (the next promotion, or rank 0's pruning, removes them)."""
        self._uploads.shutdown(wait=False, cancel_futures=True)
        self._meta.shutdown(wait=False, cancel_futures=True)
        if self.remote is not None:
            with contextlib.suppress(Exception):
                self.remote.close()

    # ------------------------------------------------------------------ agreement

    def report(self) -> dict[str, Any]:
        """What this rank tells the others in the commit vote (each outcome once)."""
        with self._lock:
            done = {str(s): d for s, d in self._finished.items()}
            failed = {str(s): e for s, e in self._failures.items()}
            self._finished.clear()
            self._failures.clear()
            return {"unfinished": len(self._unfinished), "done": done, "failed": failed}

    def on_reports(self, reports: Sequence[Any]) -> None:
        """Every rank's ``report()`` of one exchange: record finished uploads, commit the
        steps every rank finished, give up the steps a rank failed. Same on every rank."""
        busiest = (0, 0)
        failed: dict[int, dict[int, str]] = {}
        for rank, report in enumerate(reports):
            if not isinstance(report, dict):  # a rank without the tier: nothing completes
                busiest = max(busiest, (_QUEUED_MAX, rank), key=lambda b: b[0])
                continue
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
                    self._submit(self._meta, self._commit_step, step, assigned)

    def committed(self, step: int, save_id: str, lineage: Lineage | None = None) -> None:
        """A step committed on every rank: assign it when it is due (same on every rank).
        ``lineage``: its commit records' (the commit object names it too)."""
        self._commits += 1
        self._newest = (step, save_id, lineage)
        if self._commits % self.config.persist_every == 0:
            self._assign(step, save_id, lineage, closing=False)

    def closing(self) -> None:
        """At a clean close: promote the newest step committed since open too
        (``persist_on_close``)."""
        if self._newest is not None and self.config.persist_on_close:
            self._assign(*self._newest, closing=True)

    def protected(self) -> set[int]:
        """Steps this rank is still uploading: the local retention keeps them until then."""
        with self._lock:
            return set(self._unfinished)

    def _assign(self, step: int, save_id: str, lineage: Lineage | None, *,
                closing: bool) -> None:
        if step <= self._last_assigned:
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

    def _submit(self, pool: concurrent.futures.ThreadPoolExecutor,
                fn: Callable[..., None], *args: Any) -> None:
        try:
            future = pool.submit(fn, *args)
        except RuntimeError:  # closed
            return
        with self._lock:
            self._futures.append(future)

    # ------------------------------------------------------------------ worker threads

    def _upload(self, step: int, save_id: str) -> None:
        """Upload this rank's files of ``step``, commit record last."""
        started = time.perf_counter()
        remote = self.remote
        assert remote is not None
        dir_name = step_dir_name(step)
        try:
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
        """Rank 0: check every rank's objects are there, write ``step.commit`` last."""
        remote = self.remote
        assert remote is not None
        dir_name = step_dir_name(step)
        self._flush_rewinds()
        if abandoned(step, assigned.lineage, self.marks()):
            log.info("ckpt.persist.abandoned_not_committed", step=step, rank=self.rank,
                     url=self.url, save_id=assigned.save_id)
            self._remove_step(step)
            return
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
            record = StepRecord(step, assigned.save_id, self.world_size, objects,
                                lineage=assigned.lineage)
            remote.put_small(f"{dir_name}/{STEP_COMMIT}", encode_step_record(record))
        except Exception as exc:
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
        assert remote is not None
        dir_name = step_dir_name(step)
        try:
            names = remote.list_dir(dir_name)
            if STEP_COMMIT in names:
                remote.delete([f"{dir_name}/{STEP_COMMIT}"])
            remote.delete([f"{dir_name}/{n}" for n in names if n != STEP_COMMIT])
        except Exception as exc:
            log.warning("ckpt.persist.remove_failed", step=step, rank=self.rank, url=self.url,
                        error=f"{type(exc).__name__}: {exc}")
            return
        if names:
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
        return self._flush_rewinds()

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
        """``complete_steps`` of this rank's persistent tier. Runs in a worker thread."""
        assert self.remote is not None
        return complete_steps(self.remote, rank=self.rank)

    def stream(self, record: StepRecord) -> ShardStream:
        """This rank's shard of ``record``'s step, downloading into its root while the
        restore reads it (``ShardStream``). Runs in a worker thread."""
        assert self.remote is not None
        return ShardStream(self.remote, self.storage, record, self.rank)


def complete_steps(remote: Remote, *, rank: int | None = None) -> dict[int, StepRecord]:
    """The steps complete in the persistent tier: a commit object that decodes and names its
    step. A step whose commit object is unreadable is logged and left out."""
    out: dict[int, StepRecord] = {}
    for name in remote.list_steps():
        step = parse_step_dir(name)
        if step is None:
            continue
        try:
            record = read_step_record(remote, step)
        except CheckpointError as exc:
            log.warning("ckpt.recovery.persisted_invalid", step=step, rank=rank,
                        url=remote.url, reason=exc.message)
            continue
        if record is not None:
            out[step] = record
    return out


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


def _items(value: Any) -> list[tuple[Any, Any]]:
    return list(value.items()) if isinstance(value, dict) else []


def _step(key: Any) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        return -1
