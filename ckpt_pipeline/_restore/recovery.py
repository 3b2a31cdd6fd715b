"""The recovery coordinator of one rank: scan, agree across ranks, load and verify, fall back.

Loading is split in three so that the sync face can apply the state on the caller's thread
(its CUDA streams): ``load_latest`` (event loop: read, verify, check against the live state,
agree), ``apply`` (caller's thread: into the live objects, undone on failure), ``finish`` (event
loop: vote on every rank's apply, move newer unusable steps aside, report). When ``finish``
raises after a successful apply (another rank's apply failed, or the agreement did), the caller
undoes the apply (``AppliedState.undo()``, on its own thread): a failed restore changes nothing.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch

from .._config_groups import RestoreOptions
from .._crash import crash_point
from .._format import scan as _recovery
from .._format.names import step_dir_name
from .._format.shard import TensorRecord
from .._format.timeline import Rewind
from .._lineage import Timeline, forget_rewind, read_rewinds, write_rewind
from .._logging import log
from .._threads import in_thread
from .._tree import find_mesh, to_dtensor
from ..coordination import Coordinator
from ..coordination._agree import (
    Candidates,
    agree_barrier,
    agree_candidates,
    agree_outcome,
    gather_outcome,
)
from ..errors import (
    CheckpointError,
    CheckpointIntegrityError,
    RestoreError,
    StateError,
    StorageError,
)
from ..events import (
    CheckpointRejected,
    CheckpointRestored,
    CheckpointRewound,
    Event,
    ForeignFilesSetAside,
    ShardDownloaded,
    ShardFetched,
)
from ..handle import RejectedStep, RestoreResult
from ..storage import Storage
from ..train_state import TrainState
from .apply import apply_state
from .read import device_bytes, read_shard
from .rewind import TimelineView, agree_timeline
from .rollback import AppliedState, BackupCopies

if TYPE_CHECKING:
    from .._tiers.persistent.layout import StepRecord
    from .._tiers.persistent.promote import Promoter
    from .._tiers.persistent.stream import ShardStream
    from .._tiers.replica.replication import Replication
from .validate import validate_state

__all__ = ("AppliedState", "Loaded", "Recovery")

_log = log
_PERSISTENT = "persistent"
"""Where a shard came from at restore: the persistent tier."""


@dataclass(slots=True)
class Loaded:
    """A verified candidate, ready to be applied to the live state."""

    step: int
    save_id: str
    path: str
    tree: dict[str, Any]
    tensors: list[torch.Tensor]
    train_state: TrainState
    bytes: int
    started: float
    rejected: tuple[RejectedStep, ...]
    valid_by_rank: dict[int, tuple[int, ...]]
    copies: BackupCopies | None = None
    """Host copies of the live tensors, prefetched for the rollback backup."""
    scanned: frozenset[tuple[int, str]] = frozenset()
    """(step, directory) of every step this restore's scan saw: only those, when newer than
    the restored step, are moved aside (never a step created after the scan)."""
    restore_rng: bool = True
    """Whether ``apply`` loads the RNG states saved with the step."""
    fetched: dict[int, int] | None = None
    """{rank: holder} of the ranks whose shard came from a copy (every rank's, after the
    load vote)."""
    downloaded: tuple[int, ...] = ()
    """The ranks whose shard came from the persistent tier."""
    foreign_by_rank: dict[int, tuple[str, ...]] | None = None
    """{rank: save ids} of every rank's files of the step of other saves, set aside."""
    held_copies: dict[int, tuple[int, ...]] | None = None
    """{source: ranks holding a valid copy of its shard of the step} (the agreement's)."""
    rewind: Rewind | None = None
    """The rewind this restore makes (steps of the current timeline newer than it exist)."""
    timeline: int = 0
    """The timeline the run goes on as after this restore."""
    rewound: frozenset[tuple[int, str]] = frozenset()
    """(step, directory) of this rank's valid steps that the restore abandons: moved aside
    as rewound (the others newer than the restored step as rejected)."""


class Recovery:
    """Finds the newest step that every rank holds and verifies, and loads it."""

    def __init__(self, storage: Storage, coordinator: Coordinator, config: RestoreOptions,
                 emit: Callable[[Event], None], replication: Replication | None = None,
                 promoter: Promoter | None = None, timeline: Timeline | None = None) -> None:
        self.timeline = timeline if timeline is not None else Timeline()
        self.replication = replication
        self.promoter = promoter
        self._persisted: dict[int, StepRecord] = {}
        self._tier_listed = False
        """Whether this restore's listing of the persistent tier succeeded."""
        self._fetched_dirs: frozenset[tuple[int, str]] = frozenset()
        self.storage = storage
        self.coordinator = coordinator
        self.config = config
        self.rank = coordinator.rank
        self._emit = emit

    async def load_latest(self, state: Mapping[str, Any],
                          limiter: anyio.CapacityLimiter, *, step: int | None = None,
                          restore_rng: bool | None = None) -> Loaded | None:
        """Scan, agree on candidates, and read the newest one that verifies on every rank
        (with ``step``: that step only, or RestoreError).

        Raises RestoreError when steps exist but none loads, StateError when the live state
        does not fit the checkpoint (a usage error: nothing is rejected then).
        """
        wanted = step
        started = time.perf_counter()
        self._fetched_dirs = frozenset()
        statuses = await in_thread(limiter, _recovery.scan, self.storage, self.rank)
        copies = await in_thread(limiter, _recovery.scan_replicas, self.storage, self.rank)
        rejected: list[RejectedStep] = []
        for seen in statuses:
            if seen.complete and not seen.valid:
                rejected.append(self._reject(seen.step, seen.path, seen.reason or "?"))
        for copy in copies:
            if copy.complete and not copy.valid:
                _log.warning("ckpt.recovery.copy_invalid", step=copy.step, rank=self.rank,
                             source=copy.source, path=copy.path, reason=copy.reason)
        self._persisted = await self._list_persisted(limiter)
        view = await self._agree_timeline(statuses, copies, limiter)
        held_dirs = {(s.step, s.dir_name): view.abandons(s.step, s.lineage)
                     for s in [*statuses, *copies] if s.valid}
        scanned = frozenset((st.step, st.dir_name) for st in statuses)
        statuses, copies = self._current(view, statuses), self._current(view, copies)
        self._persisted = {step: r for step, r in self._persisted.items()
                           if not view.abandons(step, r.lineage)}
        valid = {s.step: s for s in statuses if s.valid}
        held = [(c.step, c.files.source, c.save_id or "", c.world_size or 0)
                for c in copies if c.valid and c.files is not None]
        persisted = [(r.step, r.save_id, r.world_size) for r in self._persisted.values()]
        agreed = await agree_candidates(
            self.coordinator, {step: (s.save_id or "", s.world_size or 0)
                               for step, s in valid.items()},
            held_any=any(s.complete for s in statuses) or bool(held) or bool(persisted),
            copies=held, persisted=persisted)
        self._check_world_size(agreed)
        candidates = agreed.steps
        if wanted is not None:
            candidates = tuple((s, i) for s, i in agreed.steps if s == wanted)
            if not candidates:
                listed = ", ".join(str(s) for s, _ in agreed.steps[:20]) or "none"
                raise RestoreError(
                    f"step {wanted} cannot be restored: it is not held and valid for every "
                    f"rank (steps that are: {listed})", step=wanted, rank=self.rank,
                    path=str(self.storage.root),
                    hint="pick one of those steps (ckpt-pipeline ls ROOT)")
        failed: set[int] = set()  # candidates every rank rejected: corruption, not a rewind
        for step, save_id in candidates:
            status = valid.get(step)
            if status is not None and status.save_id != save_id:
                status = None
            error: CheckpointError | None = None
            loaded: Loaded | None = None
            source: int | str | None = None
            foreign: tuple[str, ...] = ()
            try:
                foreign = await self._set_aside_foreign(step, save_id, valid.get(step),
                                                        copies, limiter)
                loaded, source = await self._load_step(
                    step, save_id, status, agreed.holders.get((step, self.rank), ()), state,
                    started, rejected, agreed, limiter)
                loaded.scanned = scanned
                # Steps fetched for an earlier candidate that then failed elsewhere are newer
                # than this one: they are moved aside with the others.
                loaded.scanned |= self._fetched_dirs
            except CheckpointError as exc:
                error = exc
            fatal = isinstance(error, StateError)
            failures, any_fatal, extras = await gather_outcome(
                self.coordinator, step, save_id, None if error is None else error.message,
                what="restore load", fatal=fatal,
                extra={"fetched": source if isinstance(source, int) else None,
                       "downloaded": source == _PERSISTENT, "foreign": list(foreign)})
            if any_fatal:
                if error is not None and fatal:
                    raise error  # the live state does not fit: a usage error, nothing rejected
                raise RestoreError(
                    f"step {step} does not fit the live state on rank(s) "
                    f"{sorted(failures)}: {_listing(failures)}", step=step, rank=self.rank,
                    hint="restore into the same state layout that was saved")
            if not failures and loaded is not None:
                loaded.fetched = {r: e["fetched"] for r, e in enumerate(extras)
                                  if isinstance(e, dict) and isinstance(e.get("fetched"), int)}
                loaded.downloaded = tuple(r for r, e in enumerate(extras)
                                          if isinstance(e, dict) and e.get("downloaded") is True)
                loaded.foreign_by_rank = _foreign_by_rank(extras)
                loaded.held_copies = {src: hs for (s, src), hs in agreed.holders.items()
                                      if s == step}
                self._log_unresolved(agreed, newer_than=step)
                loaded.restore_rng = (self.config.restore_rng if restore_rng is None
                                      else restore_rng)
                self._note_rewind(loaded, view, held_dirs, failed)
                return loaded
            path = status.path if status is not None else ""
            rejected.append(self._reject(step, path, _listing(failures)))
            failed.add(step)
        if not agreed.held_any:
            return None
        self._log_unresolved(agreed, newer_than=-1)
        missing = self._missing_shards(agreed)
        unresolved = self._unresolved(agreed)
        by_rank = "; ".join(f"rank {r}: {list(steps) or 'none'}"
                            for r, steps in sorted(agreed.valid_by_rank.items()))
        listing = "; ".join(f"step {r.step}: {r.reason}" for r in rejected)
        raise RestoreError(
            f"no checkpoint could be loaded on every rank (valid steps by rank: {by_rank}"
            + (f"; missing everywhere: {missing}" if missing else "")
            + (f"; {unresolved}" if unresolved else "")
            + (f"; rejected: {listing}" if listing else "") + ")", rank=self.rank,
            path=str(self.storage.root),
            hint="inspect with `ckpt-pipeline verify`; move the roots aside to start fresh")

    async def _set_aside_foreign(self, step: int, save_id: str,
                                 own: _recovery.StepStatus | None,
                                 copies: list[_recovery.StepStatus],
                                 limiter: anyio.CapacityLimiter) -> tuple[str, ...]:
        """Set this rank's files of ``step`` that are of another save than ``save_id`` aside
        (its own shard, and the copies it holds): another run's root came back with the same
        step numbers. They are kept under a labelled name (``ForeignFilesSetAside``), never
        loaded; the rank's shard then comes from a copy or the persistent tier. Returns the
        other saves' ids."""
        sets: list[_recovery.FileSet] = []
        ids: set[str] = set()
        dir_name = step_dir_name(step)
        if own is not None and own.save_id != save_id:
            sets.append(_recovery.FileSet(self.rank))
            ids.add(own.save_id or "?")
            dir_name = own.dir_name
        for copy in copies:
            if copy.step == step and copy.valid and copy.save_id != save_id and copy.files:
                sets.append(copy.files)
                ids.add(copy.save_id or "?")
                dir_name = copy.dir_name
        if not sets:
            return ()
        moved = await in_thread(limiter, functools.partial(
            _recovery.set_aside_files, self.storage, step, dir_name, self.rank, sets,
            foreign=True))
        if moved is None:
            return ()
        foreign = tuple(sorted(ids))
        self._emit(ForeignFilesSetAside(step=step, rank=self.rank, save_id=save_id,
                                        foreign_save_ids=foreign, path=moved[0],
                                        files=moved[1]))
        return foreign

    @staticmethod
    def _unresolved(agreed: Candidates) -> str:
        """Why the newest step no save id could be agreed on for was left out ("" if
        none)."""
        if not agreed.unresolved:
            return ""
        step = max(agreed.unresolved)
        return f"step {step}: {agreed.unresolved[step]}"

    def _log_unresolved(self, agreed: Candidates, *, newer_than: int) -> None:
        for step, why in sorted(agreed.unresolved.items(), reverse=True):
            if step > newer_than:
                _log.warning("ckpt.recovery.step_unresolved", step=step, rank=self.rank,
                             reason=why)

    @staticmethod
    def _missing_shards(agreed: Candidates) -> str:
        """For the newest step any rank holds: the ranks whose shard no rank holds."""
        newest = max((s for steps in agreed.valid_by_rank.values() for s in steps),
                     default=None)
        if newest is None:
            return ""
        lacking = [r for r, steps in sorted(agreed.valid_by_rank.items())
                   if newest not in steps and not agreed.copies_of(newest, r)]
        if not lacking or any(step == newest for step, _ in agreed.persisted):
            return ""
        return (f"step {newest}: the shard of rank(s) {lacking} (no own file, no copy on "
                "any rank, not in the persistent tier)")

    async def _load_step(self, step: int, save_id: str, status: _recovery.StepStatus | None,
                         holders: tuple[int, ...], state: Mapping[str, Any], started: float,
                         rejected: list[RejectedStep], agreed: Candidates,
                         limiter: anyio.CapacityLimiter) -> tuple[Loaded, int | str | None]:
        """Read this rank's shard of the step from the nearest place that holds it: its own
        root; when that is missing or does not verify, a copy fetched from a holder; then the
        persistent tier. Returns the load and where the shard came from: None (its own), the
        holder's rank, or ``_PERSISTENT``."""
        record = self._persisted.get(step)
        if record is not None and record.save_id != save_id:
            record = None
        if status is not None:
            try:
                return await self._read_candidate(status, state, started, rejected, agreed,
                                                  limiter), None
            except (CheckpointIntegrityError, StorageError) as exc:
                if not holders and record is None:
                    raise
                _log.warning("ckpt.recovery.own_shard_bad", step=step, rank=self.rank,
                             path=status.path, reason=exc.message,
                             action=f"fetching a copy from rank(s) {list(holders)}" if holders
                             else "downloading it from the persistent tier")
        elif not holders and record is None:
            raise CheckpointIntegrityError("this rank holds no matching save, no rank holds a "
                                           "copy of its shard, and the persistent tier does "
                                           "not have it", step=step, rank=self.rank)
        if holders:
            try:
                status, holder = await self._fetch(step, save_id, holders, limiter)
                return await self._read_candidate(status, state, started, rejected, agreed,
                                                  limiter), holder
            except (CheckpointIntegrityError, StorageError) as exc:
                if record is None:
                    raise
                _log.warning("ckpt.recovery.copies_bad", step=step, rank=self.rank,
                             reason=exc.message,
                             action="downloading it from the persistent tier")
        assert record is not None
        return await self._download(record, state, started, rejected, agreed,
                                    limiter), _PERSISTENT

    async def _list_persisted(self, limiter: anyio.CapacityLimiter) -> dict[int, StepRecord]:
        """The steps complete in the persistent tier ({} without one, or when it cannot be
        listed: that is logged, and restore goes on with the other tiers)."""
        if self.promoter is None:
            return {}
        self._tier_listed = False
        try:
            found = await in_thread(limiter, self.promoter.complete_steps)
        except CheckpointError as exc:
            _log.warning("ckpt.recovery.persistent_unreachable", rank=self.rank,
                         url=self.promoter.url, error=exc.message)
            return {}
        self._tier_listed = True
        return found

    async def _download(self, record: StepRecord, state: Mapping[str, Any], started: float,
                        rejected: list[RejectedStep], agreed: Candidates,
                        limiter: anyio.CapacityLimiter) -> Loaded:
        """Load this rank's shard of ``record``'s step from the persistent tier: it downloads
        into the rank's root (its own files of the step moved aside first) while the load
        reads it, every read waiting for its bytes, so that checksums and host-to-device
        copies overlap the download (``ShardStream``). Once all is read, the files are
        published as a save publishes them, and the step stays in the local tier."""
        promoter = self.promoter
        assert promoter is not None
        step = record.step
        await self._move_own_aside(step, limiter)
        stream: ShardStream | None = None
        try:
            stream = await in_thread(limiter, promoter.stream, record)
            status = await in_thread(limiter, stream.status)
            loaded = await self._read_candidate(status, state, started, rejected, agreed,
                                                limiter, stream=stream)
            path, size, seconds = await in_thread(limiter, stream.publish)
        except BaseException as exc:
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await in_thread(limiter, stream.discard)
            if isinstance(exc, CheckpointError):  # named by the stream (step, rank)
                _log.warning("ckpt.recovery.download_failed", step=step, rank=self.rank,
                             url=promoter.url, error=exc.message)
            raise
        self._fetched_dirs |= {(step, status.dir_name)}
        self._emit(ShardDownloaded(step=step, rank=self.rank, save_id=record.save_id,
                                   url=promoter.url, path=path, bytes=size, seconds=seconds))
        return loaded

    async def _move_own_aside(self, step: int, limiter: anyio.CapacityLimiter) -> None:
        dirs = await in_thread(limiter, _recovery.step_dirs, self.storage)
        if step in dirs:
            moved = await in_thread(limiter, functools.partial(
                _recovery.quarantine, self.storage, step, dirs[step], self.rank,
                own_only=True))
            if moved is not None:
                _log.warning("ckpt.recovery.moved_aside", step=step, rank=self.rank,
                             path=moved)

    async def _fetch(self, step: int, save_id: str, holders: tuple[int, ...],
                     limiter: anyio.CapacityLimiter) -> tuple[_recovery.StepStatus, int]:
        """Fetch this rank's shard of ``step`` from the first holder whose copy checks out,
        into this rank's root (its own files of the step moved aside first)."""
        replication = self.replication
        if replication is None:
            raise CheckpointIntegrityError("copies exist but this pipeline cannot fetch them",
                                           step=step, rank=self.rank)
        dir_name = step_dir_name(step)
        await self._move_own_aside(step, limiter)
        errors: list[str] = []
        for holder in holders:
            try:
                size, seconds = await in_thread(limiter, replication.fetch, holder, step,
                                                save_id)
            except CheckpointError as exc:
                errors.append(exc.message)
                _log.warning("ckpt.recovery.fetch_failed", step=step, rank=self.rank,
                             peer=holder, error=exc.message)
                continue
            status = await in_thread(limiter, _recovery.scan_files, self.storage,
                                     _recovery.FileSet(self.rank), step, dir_name)
            if not status.valid:
                errors.append(f"the copy from rank {holder}: {status.reason}")
                continue
            self._fetched_dirs |= {(step, dir_name)}
            self._emit(ShardFetched(step=step, rank=self.rank, save_id=save_id, peer=holder,
                                    path=status.path, bytes=size, seconds=seconds))
            return status, holder
        raise CheckpointIntegrityError(
            f"no copy of this rank's shard could be fetched ({'; '.join(errors)})",
            step=step, rank=self.rank, path=str(self.storage.root))

    def _check_world_size(self, agreed: Candidates) -> None:
        """Refuse when the newest step any rank holds was saved by another world size."""
        newest = max((s for steps in agreed.valid_by_rank.values() for s in steps),
                     default=None)
        if newest is not None and newest in agreed.world_sizes:
            saved = agreed.world_sizes[newest]
            raise RestoreError(
                f"step {newest} was saved by {saved} rank(s), this job has "
                f"{self.coordinator.world_size}", step=newest, rank=self.rank,
                path=str(self.storage.root),
                hint=f"restore with {saved} ranks (resharding is not supported)")

    async def _read_candidate(self, status: _recovery.StepStatus, state: Mapping[str, Any],
                              started: float, rejected: list[RejectedStep],
                              agreed: Candidates, limiter: anyio.CapacityLimiter, *,
                              stream: ShardStream | None = None) -> Loaded:
        assert status.header is not None
        header = status.header
        meshes = _live_meshes(header.tensors, state, status)
        devices = [_target_device(rec, meshes) for rec in header.tensors]
        # The rollback backup of the live state is copied to host memory while the shard is
        # read (in a thread of its own): as long as a large part of the read, it then costs
        # the restore almost nothing (see BackupCopies).
        copies = BackupCopies()
        reading = device_bytes(header, devices)  # GPU memory the read below allocates
        prefetch = threading.Thread(target=_prefetch, args=(copies, state, self.rank, reading),
                                    name="ckpt-restore-backup", daemon=True)
        prefetch.start()
        try:
            shard = await read_shard(
                self.storage, status, self.rank, devices=devices,
                threads=self.config.io_threads, limiter=limiter,
                shard_file=None if stream is None else stream.shard_file,
                arrived=None if stream is None else stream.wait)
        finally:
            await anyio.to_thread.run_sync(prefetch.join, abandon_on_cancel=True)
        tree, train_state = _recovery.decode_contents(status, self.rank)
        tensors = [t if rec.dist is None
                   else to_dtensor(t, rec.dist, *meshes[rec.dist.mesh_shape])
                   for t, rec in zip(shard.tensors, header.tensors)]
        # Everything that can be checked before touching a live object (a StateError here is
        # fatal on every rank, and nothing is rejected).
        await in_thread(limiter, functools.partial(validate_state, state, tree, tensors,
                                                   step=status.step, rank=self.rank))
        return Loaded(step=status.step, save_id=header.save_id, path=status.path, tree=tree,
                      tensors=tensors, train_state=train_state,
                      bytes=status.shard_size, started=started, rejected=tuple(rejected),
                      valid_by_rank=dict(agreed.valid_by_rank), copies=copies)

    def apply(self, loaded: Loaded, state: MutableMapping[str, Any]) -> AppliedState:
        """Load into the live objects and the RNG states; runs on the caller's thread (its CUDA
        streams). On failure every change is undone before it raises (a CheckpointError);
        on success the result can undo it until it is released (see ``finish``)."""
        rng = loaded.train_state.rng if loaded.restore_rng else None
        try:
            return apply_state(state, loaded.tree, loaded.tensors, step=loaded.step,
                               rank=self.rank, rng=rng, copies=loaded.copies)
        finally:
            loaded.tensors = []
            loaded.copies = None

    async def finish(self, loaded: Loaded, apply_error: CheckpointError | None,
                     limiter: anyio.CapacityLimiter) -> RestoreResult:
        """Vote on the apply; move this rank's newer, unusable steps aside; wait for all ranks.

        Every rank must call it, also when its apply failed (``apply_error``; that rank has
        undone it already): then every rank raises instead of going on with a state that
        differs between ranks. Whenever it raises, the caller undoes its own apply.
        """
        try:
            failures, _ = await agree_outcome(
                self.coordinator, loaded.step, loaded.save_id,
                None if apply_error is None else apply_error.message, what="restore apply")
        except CheckpointError as exc:
            if apply_error is not None:
                raise apply_error from exc
            raise
        if apply_error is not None:
            raise apply_error
        if failures:
            raise RestoreError(f"loading step {loaded.step} failed on rank(s) "
                               f"{sorted(failures)}: {_listing(failures)}", step=loaded.step,
                               rank=self.rank, hint="every rank rolls its live state back "
                                                    "to what it was before the restore")
        if loaded.rewind is not None:
            await self._record_rewind(loaded, limiter)
        dirs = await in_thread(limiter, _recovery.step_dirs, self.storage)
        for step, dir_name in sorted(dirs.items()):
            rewound = (step, dir_name) in loaded.rewound
            if (step > loaded.step or rewound) and (step, dir_name) in loaded.scanned:
                moved = await in_thread(limiter, functools.partial(
                    _recovery.quarantine, self.storage, step, dir_name, self.rank,
                    rewound_to=loaded.step if rewound else None))
                if moved is not None:
                    _log.warning("ckpt.recovery.moved_aside", step=step, rank=self.rank,
                                 path=moved, rewound_to=loaded.step if rewound else None)
        resending = await self._clear_lacking_copies(loaded, limiter)
        await agree_barrier(self.coordinator, what="restore done", step=loaded.step)
        self.timeline.timeline = loaded.timeline
        self.timeline.head = (loaded.step, loaded.save_id)
        self._resend_copies(loaded, resending)
        seconds = time.perf_counter() - loaded.started
        self._emit(CheckpointRestored(step=loaded.step, rank=self.rank, save_id=loaded.save_id,
                                      path=loaded.path, bytes=loaded.bytes, seconds=seconds))
        return RestoreResult(step=loaded.step, save_id=loaded.save_id, path=loaded.path,
                             train_state=loaded.train_state, bytes=loaded.bytes,
                             seconds=seconds, rejected=loaded.rejected,
                             valid_by_rank=loaded.valid_by_rank,
                             fetched=dict(loaded.fetched or {}),
                             downloaded=loaded.downloaded,
                             foreign=dict(loaded.foreign_by_rank or {}),
                             resending=resending)

    async def _clear_lacking_copies(self, loaded: Loaded, limiter: anyio.CapacityLimiter
                                    ) -> dict[int, tuple[int, ...]]:
        """{holder: sources} of the restored step's copies that their holders lack (see
        ``Replication.copies_lacking``; the same on every rank). Before the barrier, so that
        no copy is sent before its holder is ready: this rank, as a holder, moves aside what
        it has of a copy it lacks a valid one of (a corrupt copy would block the new one's
        names)."""
        if self.replication is None:
            return {}
        lacking = self.replication.copies_lacking(loaded.step, loaded.held_copies or {})
        mine = [_recovery.FileSet(src, self.rank) for src in lacking.get(self.rank, ())]
        if not mine:
            return lacking
        try:  # best-effort: the restore is done on every rank; a copy that stays blocked
            # fails at its holder, and its source reports it (ReplicaRestoreFailed)
            dirs = await in_thread(limiter, _recovery.step_dirs, self.storage)
            moved = None if loaded.step not in dirs else await in_thread(
                limiter, functools.partial(_recovery.set_aside_files, self.storage,
                                           loaded.step, dirs[loaded.step], self.rank, mine,
                                           foreign=False))
        except CheckpointError as exc:
            _log.warning("ckpt.recovery.copies_not_cleared", step=loaded.step,
                         rank=self.rank, error=exc.message)
            return lacking
        if moved is not None:
            _log.warning("ckpt.recovery.moved_aside", step=loaded.step, rank=self.rank,
                         path=moved[0], reason="copies that did not check out, sent again")
        return lacking

    def _resend_copies(self, loaded: Loaded, lacking: Mapping[int, tuple[int, ...]]) -> None:
        """Start sending this rank's shard of the restored step to the holders that lack
        it, in the background: the restore does not wait for it."""
        holders = sorted(h for h, sources in lacking.items() if self.rank in sources)
        if self.replication is None or not holders:
            return
        _log.info("ckpt.recovery.resending", step=loaded.step, rank=self.rank,
                  holders=holders)
        self.replication.resend(loaded.step, loaded.save_id, holders)

    async def _agree_timeline(self, statuses: list[_recovery.StepStatus],
                              copies: list[_recovery.StepStatus],
                              limiter: anyio.CapacityLimiter) -> TimelineView:
        """Every rank's marks and steps (``rewind.py``): the same view on every rank."""
        rewinds = await in_thread(limiter, read_rewinds, self.storage)
        if self.promoter is not None:
            rewinds += await self._tier_rewinds(limiter)
        return await agree_timeline(
            self.coordinator, own=[s for s in statuses if s.valid],
            copies=[c for c in copies if c.valid], persisted=self._persisted,
            rewinds=rewinds, known=() if self.promoter is None else self.promoter.marks(),
            timeline=self.timeline.timeline)

    async def _tier_rewinds(self, limiter: anyio.CapacityLimiter) -> list[Rewind]:
        """The rewinds the persistent tier records ([] and a log line when it cannot be
        read: the local records still count)."""
        promoter = self.promoter
        assert promoter is not None
        if not self._tier_listed:  # unreachable in this restore: not waited for twice
            return []
        try:
            return await in_thread(limiter, promoter.recorded_rewinds)
        except CheckpointError as exc:
            _log.warning("ckpt.recovery.tier_rewinds_unreadable", rank=self.rank,
                         url=promoter.url, error=exc.message)
            return []

    def _current(self, view: TimelineView, statuses: list[_recovery.StepStatus]
                 ) -> list[_recovery.StepStatus]:
        """``statuses`` less the valid ones of an abandoned timeline (logged)."""
        out = []
        for status in statuses:
            if status.valid and view.abandons(status.step, status.lineage):
                _log.info("ckpt.recovery.abandoned_skipped", step=status.step, rank=self.rank,
                          save_id=status.save_id, source=status.source, path=status.path)
                continue
            out.append(status)
        return out

    @staticmethod
    def _note_rewind(loaded: Loaded, view: TimelineView,
                     held_dirs: Mapping[tuple[int, str], bool], failed: Set[int]) -> None:
        """Whether restoring ``loaded`` rewinds the run, and which of this rank's steps it
        abandons (the same decision on every rank: the view and ``failed``, the candidates
        every rank rejected, are). ``held_dirs``: {(step, directory): abandoned already} of
        the rank's valid files (own or copies). A rejected candidate is moved aside as
        rejected, kept for inspection, as before lineage."""
        loaded.rewind = view.rewind_for(loaded.step, loaded.save_id, failed)
        loaded.timeline = view.top + 1
        loaded.rewound = frozenset(
            key for key, gone in held_dirs.items() if key[0] not in failed
            and (gone or (loaded.rewind is not None and key[0] > loaded.step)))

    async def _record_rewind(self, loaded: Loaded, limiter: anyio.CapacityLimiter) -> None:
        """Record the rewind in every tier before anything is moved aside: this rank's file in
        its root, a vote (a rank that could not write it fails the restore on every rank, each
        removing its own record: nothing changed), rank 0's record in the persistent tier
        (pending, logged, when unreachable), then a barrier, so that no rank moves a step
        aside before the records are durable (any one of them is enough for a recovery)."""
        rewind = loaded.rewind
        assert rewind is not None
        error: CheckpointError | None = None
        path = ""
        try:
            path = await in_thread(limiter, write_rewind, self.storage, self.rank, rewind)
        except CheckpointError as exc:
            error = exc
        failures, _ = await agree_outcome(
            self.coordinator, loaded.step, loaded.save_id,
            None if error is None else error.message, what="restore rewind")
        if failures:
            if path:
                await in_thread(limiter, forget_rewind, self.storage, self.rank, rewind)
            raise RestoreError(
                f"the rewind to step {loaded.step} could not be recorded on rank(s) "
                f"{sorted(failures)}: {_listing(failures)}", step=loaded.step, rank=self.rank,
                path=str(self.storage.root),
                hint="every rank rolls its live state back; free space in the root (a rewind "
                     "record is a few hundred bytes) and restore again")
        self._emit(CheckpointRewound(step=rewind.step, rank=self.rank, save_id=rewind.save_id,
                                     timeline=rewind.timeline,
                                     abandoned=tuple(s for s, _ in rewind.abandoned),
                                     path=path))
        if self.promoter is not None:
            await in_thread(limiter, self.promoter.rewound, [rewind])
        await agree_barrier(self.coordinator, what="restore rewind", step=rewind.step)
        crash_point("restore.rewind_recorded")

    def _reject(self, step: int, path: str, reason: str) -> RejectedStep:
        self._emit(CheckpointRejected(step=step, rank=self.rank, path=path, reason=reason))
        return RejectedStep(step, path, reason)


def _prefetch(copies: BackupCopies, state: Mapping[str, Any], rank: int,
              reading: Mapping[int, int]) -> None:
    """Best-effort: a failure here only means the backup is copied when it is taken."""
    try:
        copies.prefetch(state, device_reserved=reading)
    except Exception as exc:
        copies.clear()
        _log.debug("ckpt.recovery.prefetch_failed", rank=rank,
                   error=f"{type(exc).__name__}: {exc}")


def _live_meshes(records: tuple[TensorRecord, ...], state: Mapping[str, Any],
                 status: _recovery.StepStatus) -> dict[tuple[int, ...], tuple[Any, torch.device]]:
    """The live mesh and local device for each mesh shape the checkpoint's DTensors use."""
    meshes: dict[tuple[int, ...], tuple[Any, torch.device]] = {}
    for record in records:
        if record.dist is None or record.dist.mesh_shape in meshes:
            continue
        found = find_mesh(state, record.dist.mesh_shape)
        if found is None:
            raise StateError(
                f"the checkpoint holds a DTensor on a mesh of shape "
                f"{list(record.dist.mesh_shape)}, the live state has no DTensor on such a mesh",
                step=status.step, path=record.path,
                hint="shard the model the same way (fully_shard) before restoring")
        meshes[record.dist.mesh_shape] = found
    return meshes


def _target_device(record: TensorRecord,
                   meshes: Mapping[tuple[int, ...], tuple[Any, torch.device]]) -> torch.device:
    """Where a loaded tensor goes: its DTensor's live device, or the device it was saved from
    when this machine has it (another CUDA device when not), else the CPU."""
    if record.dist is not None:
        return torch.device(meshes[record.dist.mesh_shape][1])
    if record.device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(record.device)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    return torch.device("cpu")


def _foreign_by_rank(extras: list[Any]) -> dict[int, tuple[str, ...]]:
    out: dict[int, tuple[str, ...]] = {}
    for rank, extra in enumerate(extras):
        ids = extra.get("foreign") if isinstance(extra, dict) else None
        if isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids):
            out[rank] = tuple(ids)
    return out


def _listing(failures: Mapping[int, str]) -> str:
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
