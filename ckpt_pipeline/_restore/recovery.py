"""The recovery coordinator of one rank: agree across ranks (``agreement.py``), get and verify
this rank's shard of each candidate (``sourcing.py``), fall back, apply.

Loading is split in three so that the sync face can apply the state on the caller's thread
(its CUDA streams): ``load_latest`` (event loop: read, verify, check against the live state,
agree), ``apply`` (caller's thread: into the live objects, undone on failure), ``finish`` (event
loop: vote on every rank's apply, move newer unusable steps aside, report). When ``finish``
raises after a successful apply (another rank's apply failed, or the agreement did), the caller
undoes the apply (``AppliedState.undo()``, on its own thread): a failed restore changes nothing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, MutableMapping, Set
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from .._config_groups import RestoreOptions
from .._crash import crash_point
from .._format.filesets import FileSet
from .._format.steps import step_dirs
from .._format.tidy import quarantine, set_aside_files
from .._lineage import Timeline, forget_rewind, write_rewind
from .._logging import log
from .._threads import in_thread
from ..coordination import Coordinator
from ..coordination._agree import agree_barrier, agree_outcome, gather_shared
from ..coordination._runs import Runs
from ..errors import CheckpointError, ConfigError, CoordinationError, RestoreError
from ..events import CheckpointRejected, CheckpointRestored, CheckpointRewound, Event
from ..handle import Missing, RejectedStep, Reshard, RestoreResult
from ..storage import Storage
from .agreement import Agreement, WorldSizeChanged
from .agreement import listing as _listing
from .apply import apply_state
from .reshard import PeerSource, TierSource, reshard_latest
from .rewind import TimelineView
from .rollback import AppliedState
from .sourcing import Loaded, Sourcing
from .validate import LayoutChanged

if TYPE_CHECKING:
    from .._tiers.persistent.promote import Promoter
    from .._tiers.replica.replication import Replication

__all__ = ("AppliedState", "Loaded", "Recovery")

_log = log

_T = TypeVar("_T")


class Recovery:
    """Finds the newest step that every rank holds and verifies, and loads it."""

    def __init__(self, storage: Storage, coordinator: Coordinator, config: RestoreOptions,
                 emit: Callable[[Event], None], replication: Replication | None = None,
                 promoter: Promoter | None = None, timeline: Timeline | None = None) -> None:
        self.timeline = timeline if timeline is not None else Timeline()
        self.replication = replication
        self.promoter = promoter
        self.storage = storage
        self.coordinator = coordinator
        self.config = config
        self.rank = coordinator.rank
        self._emit = emit
        self.agreement = Agreement(storage, coordinator, config, self._reject, promoter,
                                   self.timeline)
        self.sourcing = Sourcing(storage, config, self.rank, emit, replication, promoter)

    def use_memory(self, storage: Storage) -> None:
        """Consider the memory tier's steps (``storage``: its root) too, read first where it
        holds them."""
        self.agreement.memory_storage = storage
        self.sourcing.memory_storage = storage

    async def load_latest(self, state: Mapping[str, Any],
                          limiter: anyio.CapacityLimiter, *, step: int | None = None,
                          restore_rng: bool | None = None,
                          missing: Missing = "refuse",
                          reshard: Reshard | None = None) -> Loaded | None:
        """Scan, agree on candidates, and read the newest one that verifies on every rank
        (with ``step``: that step only, or RestoreError).

        Raises RestoreError when steps exist but none loads, StateError when the live state
        does not fit the checkpoint (a usage error: nothing is rejected then).
        """
        started = time.perf_counter()
        self.sourcing.fetched_dirs = frozenset()
        if missing not in ("refuse", "keep"):
            raise ConfigError(f"missing={missing!r} is not a choice",
                              hint='use "refuse" (the default) or "keep"')
        self.sourcing.keep_missing = missing == "keep"
        rng = self.config.restore_rng if restore_rng is None else restore_rng
        choices = _reshard_choices(reshard)
        try:
            agreed = await self.agreement.agree(limiter, step)
        except WorldSizeChanged as changed:  # every rank sees it: the agreement's view
            return await reshard_latest(
                self.storage, self.coordinator, state, limiter,
                saved_world=changed.saved_world, step=step, started=started,
                keep_missing=self.sourcing.keep_missing,
                in_flight=self.config.reshard_bytes_in_flight,
                threads=self.config.io_threads, choices=choices, rng=rng,
                tier=self._tier_source(), peers=self._peer_source())

        async def load(at: int, save_id: str
                       ) -> tuple[Loaded | None, CheckpointError | None, dict[str, Any]]:
            return await self.sourcing.candidate(at, save_id, agreed, state, started, limiter)

        try:
            found = await self.agreement.first_loaded(agreed, load)
        except CoordinationError:  # a rank dead or stuck: no further exchange
            raise
        except CheckpointError as exc:  # every rank raises here when one does (its vote)
            layout = await gather_shared(self.coordinator, isinstance(exc, LayoutChanged),
                                         what="restore layout", step=exc.step)
            if not all(layout.distinct()):
                raise
            _log.info("ckpt.recovery.layout_changed", rank=self.rank, step=exc.step,
                      error=exc.message, hint="resharding onto the live layout")
            return await reshard_latest(
                self.storage, self.coordinator, state, limiter,
                saved_world=self.coordinator.world_size, step=step, started=started,
                keep_missing=self.sourcing.keep_missing,
                in_flight=self.config.reshard_bytes_in_flight,
                threads=self.config.io_threads, choices=choices, rng=rng,
                tier=self._tier_source(), peers=self._peer_source())
        if found is None:
            return None
        loaded, extras, failed = found
        loaded.fetched = _by_rank(extras, lambda e: e["fetched"] if isinstance(
            e, dict) and isinstance(e.get("fetched"), int) else None)
        loaded.downloaded = tuple(extras.indices(
            lambda e: isinstance(e, dict) and e.get("downloaded") is True))
        loaded.foreign_by_rank = _by_rank(extras, _foreign)
        loaded.from_memory = tuple(extras.indices(
            lambda e: isinstance(e, dict) and e.get("memory") is True))
        loaded.held_copies = {src: hs for (s, src), hs in agreed.candidates.holders.items()
                              if s == loaded.step}
        loaded.restore_rng = rng
        self._note_rewind(loaded, agreed.view, agreed.held_dirs, failed)
        if loaded.not_restored or loaded.not_in_checkpoint:
            log.info("ckpt.recovery.partial", step=loaded.step, rank=self.rank,
                     not_restored=list(loaded.not_restored),
                     not_in_checkpoint=list(loaded.not_in_checkpoint),
                     hint="saved entries the live state lacks are not restored; with "
                          "missing='keep' the live state's new entries keep their values")
        return loaded

    def _peer_source(self) -> PeerSource | None:
        """The live ranks' roots as a reshard's source, through replication's copy servers
        (None in a single process, or without the opening's peers)."""
        replication = self.replication
        if replication is None or self.coordinator.world_size == 1:
            return None
        return PeerSource(replication.open_saved, serves=replication.server is not None)

    def _tier_source(self) -> TierSource | None:
        """The persistent tier as a reshard's source, with the steps the agreement listed
        there (None without a tier, or when it could not be reached)."""
        promoter = self.promoter
        if promoter is None or promoter.remote is None or not self.agreement.persisted:
            return None
        return TierSource(promoter.url, promoter.remote, self.agreement.persisted)

    def apply(self, loaded: Loaded, state: MutableMapping[str, Any]) -> AppliedState:
        """Load into the live objects and the RNG states; runs on the caller's thread (its CUDA
        streams). On failure every change is undone before it raises (a CheckpointError);
        on success the result can undo it until it is released (see ``finish``)."""
        rng = loaded.train_state.rng if loaded.restore_rng else None
        try:
            return apply_state(state, loaded.tree, loaded.tensors, step=loaded.step,
                               rank=self.rank, rng=rng, copies=loaded.copies,
                               keep_missing=bool(loaded.not_in_checkpoint or loaded.excluded),
                               prewrites=loaded.prewrites)
        finally:
            loaded.tensors = []
            loaded.copies = None
            loaded.prewrites = None

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
        dirs = await in_thread(limiter, step_dirs, self.storage)
        for step, dir_name in sorted(dirs.items()):
            rewound = (step, dir_name) in loaded.rewound
            if (step > loaded.step or rewound) and (step, dir_name) in loaded.scanned:
                moved = await in_thread(limiter, functools.partial(
                    quarantine, self.storage, step, dir_name, self.rank,
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
                             from_memory=loaded.from_memory, resending=resending,
                             not_restored=loaded.not_restored,
                             not_in_checkpoint=loaded.not_in_checkpoint,
                             resharded_from=loaded.resharded_from, excluded=loaded.excluded)

    async def _clear_lacking_copies(self, loaded: Loaded, limiter: anyio.CapacityLimiter
                                    ) -> dict[int, tuple[int, ...]]:
        """{holder: sources} of the restored step's copies that their holders lack (see
        ``Replication.copies_lacking``; the same on every rank; none for a step resharded
        from another layout, whose copies stay as that job placed them). Before the barrier,
        so that no copy is sent before its holder is ready: this rank, as a holder, moves
        aside what it has of a copy it lacks a valid one of (a corrupt copy would block the
        new one's names)."""
        if self.replication is None or loaded.resharded_from is not None:
            return {}  # a resharded step's copies are placed for the world that saved it
        lacking = self.replication.copies_lacking(loaded.step, loaded.held_copies or {})
        mine = [FileSet(src, self.rank) for src in lacking.get(self.rank, ())]
        if not mine:
            return lacking
        try:  # best-effort: the restore is done on every rank; a copy that stays blocked
            # fails at its holder, and its source reports it (ReplicaRestoreFailed)
            dirs = await in_thread(limiter, step_dirs, self.storage)
            moved = None if loaded.step not in dirs else await in_thread(
                limiter, functools.partial(set_aside_files, self.storage,
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


def _by_rank(extras: Runs[Any], read: Callable[[Any], _T | None]) -> dict[int, _T]:
    """{rank: read(its extra)} for the ranks whose extra ``read`` makes something of (not
    None): ``read`` called once a run of equal extras, O(runs + ranks named)."""
    out: dict[int, _T] = {}
    for start, stop, extra in extras.runs():
        value = read(extra)
        if value is not None:
            out.update(dict.fromkeys(range(start, stop), value))
    return out


def _foreign(extra: Any) -> tuple[str, ...] | None:
    """The foreign save ids a rank's extra names (None: none)."""
    ids = extra.get("foreign") if isinstance(extra, dict) else None
    if isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids):
        return tuple(ids)
    return None


def _reshard_choices(reshard: Reshard | None) -> Reshard:
    """``reshard``, checked (None: the defaults)."""
    if reshard is None:
        return Reshard()
    if not isinstance(reshard, Reshard):
        raise ConfigError(f"reshard={reshard!r} is not a Reshard",
                          hint='for example reshard=cp.Reshard(rng="rank0", exclude=("loader",))')
    if reshard.rng not in ("live", "rank0"):
        raise ConfigError(f"Reshard(rng={reshard.rng!r}) is not a choice",
                          hint='use "live" (the default: not restored) or "rank0"')
    if isinstance(reshard.exclude, str) or not all(
            isinstance(name, str) for name in reshard.exclude):
        raise ConfigError(f"Reshard(exclude={reshard.exclude!r}) must be a tuple of names",
                          hint='for example exclude=("loader",)')
    if reshard.per_rank is not None and not callable(reshard.per_rank):
        raise ConfigError("Reshard(per_rank=...) must be callable",
                          hint="per_rank(path, values) returns the value this rank restores")
    return reshard
