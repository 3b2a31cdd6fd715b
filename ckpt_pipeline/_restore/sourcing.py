"""Sourcing, the second half of a restore's load: this rank's shard of an agreed candidate,
from the nearest place that has it (``ShardSources``: its own root; when that is missing or
does not verify, a copy fetched from a holder; then the persistent tier), read onto the live
state's devices and checked against the live state before anything is applied.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch

from .._config_groups import RestoreOptions
from .._format.filesets import FileSet
from .._format.header import TensorRecord
from .._format.names import step_dir_name
from .._format.scan import StepStatus, decode_contents
from .._format.steps import step_dirs
from .._format.tidy import quarantine, set_aside_files
from .._format.timeline import Rewind
from .._logging import log
from .._threads import in_thread
from .._tiers.base import LocatedShard, ShardSource, ShardSources, SourceFailure
from .._tiers.persistent.source import TierDownload
from .._tiers.replica.source import FetchedCopy
from .._tree import find_mesh, live_meshes, to_dtensor, unmatched_meshes
from ..coordination._agree import Candidates
from ..errors import CheckpointError, CheckpointIntegrityError
from ..events import Event, ForeignFilesSetAside, ShardDownloaded, ShardFetched
from ..handle import RejectedStep
from ..storage import Storage
from ..train_state import TrainState
from .agreement import Agreed
from .backups import BackupCopies
from .inplace import Prewrites
from .read import device_bytes, read_shard
from .root_source import RootFiles
from .validate import LayoutChanged, validate_state

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._tiers.persistent.layout import StepRecord
    from .._tiers.persistent.promote import Promoter
    from .._tiers.replica.replication import Replication

__all__ = ("Loaded", "Sourcing", "prefetch_backup")

_log = log


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
    valid_by_rank: Mapping[int, tuple[int, ...]]
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
    from_memory: tuple[int, ...] = ()
    """The ranks whose shard came from the memory tier."""
    not_restored: tuple[str, ...] = ()
    """Saved top-level entries the live state does not have (a subset was restored)."""
    not_in_checkpoint: tuple[str, ...] = ()
    """Top-level entries of the live state the step lacks, left as they are (missing="keep")."""
    foreign_by_rank: dict[int, tuple[str, ...]] | None = None
    """{rank: save ids} of every rank's files of the step of other saves, set aside."""
    held_copies: dict[int, tuple[int, ...]] | None = None
    """{source: ranks holding a valid copy of its shard of the step} (the agreement's)."""
    rewind: Rewind | None = None
    """The rewind this restore makes (steps of the current timeline newer than it exist)."""
    timeline: int = 0
    """The timeline the run goes on as after this restore."""
    resharded_from: int | None = None
    """The number of ranks that saved the step, when it was resharded (``reshard.py``)."""
    prewrites: Prewrites | None = None
    """Live tensors the reshard read straight into, with their bits from before
    (``inplace.py``): undone unless the apply takes them over."""
    excluded: tuple[str, ...] = ()
    """Top-level entries a reshard leaves as they are (``Reshard.exclude``)."""
    rewound: frozenset[tuple[int, str]] = frozenset()
    """(step, directory) of this rank's valid steps that the restore abandons: moved aside
    as rewound (the others newer than the restored step as rejected)."""

class Sourcing:
    """Gets this rank's shard of each candidate the agreement hands it (see the module
    docstring), moving the rank's files of other saves aside first."""

    def __init__(self, storage: Storage, config: RestoreOptions, rank: int,
                 emit: Callable[[Event], None], replication: Replication | None,
                 promoter: Promoter | None) -> None:
        self.storage = storage
        self.config = config
        self.rank = rank
        self.replication = replication
        self.promoter = promoter
        self._emit = emit
        self.keep_missing = False
        """This restore's ``missing="keep"``: the live state's new entries are left alone."""
        self.memory_storage: Storage | None = None
        """The memory tier's root (``memory=``), read first where it holds the step."""
        self.fetched_dirs: frozenset[tuple[int, str]] = frozenset()
        """(step, directory) of the steps this restore fetched or downloaded into the root
        (reset by each restore)."""

    async def candidate(self, step: int, save_id: str, agreed: Agreed,
                        state: Mapping[str, Any], started: float,
                        limiter: anyio.CapacityLimiter
                        ) -> tuple[Loaded | None, CheckpointError | None, dict[str, Any]]:
        """This rank's load of candidate ``step`` (a ``CandidateLoad``): the load or its
        error, and what the other ranks hear of it (the holder it was fetched from, whether
        it was downloaded, the foreign saves set aside)."""
        loaded: Loaded | None = None
        error: CheckpointError | None = None
        shard: LocatedShard | None = None
        foreign: tuple[str, ...] = ()
        try:
            foreign = await self._set_aside_foreign(step, save_id, agreed.valid.get(step),
                                                    agreed.copies, limiter)
            loaded, shard = await self._load_step(
                step, save_id, agreed.own(step, save_id), agreed.in_memory(step, save_id),
                agreed.candidates.holders.get((step, self.rank), ()), agreed.persisted, state,
                started, agreed.rejected, agreed.candidates, limiter)
            loaded.scanned = agreed.scanned
            # Steps fetched for an earlier candidate that then failed elsewhere are newer
            # than this one: they are moved aside with the others.
            loaded.scanned |= self.fetched_dirs
        except CheckpointError as exc:
            error = exc
        return loaded, error, {
            "fetched": shard.holder if shard is not None and shard.kind == "copy" else None,
            "downloaded": shard is not None and shard.kind == "persistent",
            "memory": shard is not None and shard.kind == "memory",
            "foreign": list(foreign)}

    async def _load_step(self, step: int, save_id: str, status: StepStatus | None,
                         memory: StepStatus | None, holders: tuple[int, ...], persisted: Mapping[int, StepRecord],
                         state: Mapping[str, Any], started: float,
                         rejected: list[RejectedStep], agreed: Candidates,
                         limiter: anyio.CapacityLimiter) -> tuple[Loaded, LocatedShard]:
        """Read this rank's shard of the step from the nearest place that holds it
        (``sources``). Returns the load and the shard as its place had it."""
        record = persisted.get(step)
        if record is not None and record.save_id != save_id:
            record = None
        sources = self.sources(step, save_id, status, holders, record, limiter, memory)
        if not sources.sources:
            raise CheckpointIntegrityError("this rank holds no matching save, no rank holds a "
                                           "copy of its shard, and the persistent tier does "
                                           "not have it", step=step, rank=self.rank)

        async def read(shard: LocatedShard) -> Loaded:
            return await self._read_candidate(shard, state, started, rejected, agreed,
                                              limiter)

        return await sources.read(read)

    def sources(self, step: int, save_id: str, status: StepStatus | None,
                holders: tuple[int, ...], record: StepRecord | None,
                limiter: anyio.CapacityLimiter, memory: StepStatus | None = None
                ) -> ShardSources:
        """The places this rank's shard of ``step`` is read from, nearest first: the memory
        tier (``memory``), its own files (``status``, when they are of the save), a copy
        fetched from one of
        ``holders``, the persistent tier (``record``). A fetch or a download moves the rank's
        own files of the step aside first, and lands under its own names."""
        places: list[ShardSource] = []
        if memory is not None and self.memory_storage is not None:
            places.append(RootFiles(self.memory_storage, FileSet(self.rank), step,
                                    memory.dir_name, limiter, status=memory, memory=True))
        if status is not None:
            places.append(RootFiles(self.storage, FileSet(self.rank), step,
                                    status.dir_name, limiter, status=status))
        move_aside = functools.partial(self._move_own_aside, step, limiter)
        if holders:
            fetch = None if self.replication is None else self.replication.fetch
            places.append(FetchedCopy(self.storage, self.rank, step, save_id, holders, fetch,
                                      limiter, before=move_aside,
                                      landed=functools.partial(self._fetched, save_id)))
        if record is not None:
            promoter = self.promoter
            assert promoter is not None
            places.append(TierDownload(functools.partial(promoter.stream, record), limiter,
                                       keep=True, before=move_aside,
                                       landed=functools.partial(self._downloaded, record)))
        return ShardSources(tuple(places), failed=functools.partial(self._failed, step, status))

    def _failed(self, step: int, status: StepStatus | None, failure: SourceFailure,
                following: ShardSource | None) -> None:
        """The log line of a place that did not give the shard (``ShardSources.failed``)."""
        kind, reason = failure.source.kind, failure.error.message
        if kind == "persistent":
            url = "" if self.promoter is None else self.promoter.url
            _log.warning("ckpt.recovery.download_failed", step=step, rank=self.rank, url=url,
                         error=reason)
        elif following is None:
            return
        elif kind == "memory":
            _log.warning("ckpt.recovery.memory_shard_bad", step=step, rank=self.rank,
                         reason=reason, action=following.action)
        elif kind == "own":
            _log.warning("ckpt.recovery.own_shard_bad", step=step, rank=self.rank,
                         path="" if status is None else status.path, reason=reason,
                         action=following.action)
        else:
            _log.warning("ckpt.recovery.copies_bad", step=step, rank=self.rank, reason=reason,
                         action=following.action)

    def _fetched(self, save_id: str, shard: LocatedShard, size: int, seconds: float) -> None:
        """A copy fetched from its holder is in this rank's root."""
        status = shard.status
        assert shard.holder is not None
        self.fetched_dirs |= {(status.step, status.dir_name)}
        self._emit(ShardFetched(step=status.step, rank=self.rank, save_id=save_id,
                                peer=shard.holder, path=status.path, bytes=size,
                                seconds=seconds))

    def _downloaded(self, record: StepRecord, shard: LocatedShard, path: str, size: int,
                    seconds: float) -> None:
        """The shard downloaded from the persistent tier is published in this rank's root."""
        promoter = self.promoter
        assert promoter is not None
        self.fetched_dirs |= {(record.step, shard.status.dir_name)}
        self._emit(ShardDownloaded(step=record.step, rank=self.rank, save_id=record.save_id,
                                   url=promoter.url, path=path, bytes=size, seconds=seconds))

    async def _set_aside_foreign(self, step: int, save_id: str,
                                 own: StepStatus | None,
                                 copies: list[StepStatus],
                                 limiter: anyio.CapacityLimiter) -> tuple[str, ...]:
        """Set this rank's files of ``step`` that are of another save than ``save_id`` aside
        (its own shard, and the copies it holds): another run's root came back with the same
        step numbers. They are kept under a labelled name (``ForeignFilesSetAside``), never
        loaded; the rank's shard then comes from a copy or the persistent tier. Returns the
        other saves' ids."""
        sets: list[FileSet] = []
        ids: set[str] = set()
        dir_name = step_dir_name(step)
        if own is not None and own.save_id != save_id:
            sets.append(FileSet(self.rank))
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
            set_aside_files, self.storage, step, dir_name, self.rank, sets,
            foreign=True))
        if moved is None:
            return ()
        foreign = tuple(sorted(ids))
        self._emit(ForeignFilesSetAside(step=step, rank=self.rank, save_id=save_id,
                                        foreign_save_ids=foreign, path=moved[0],
                                        files=moved[1]))
        return foreign

    async def _move_own_aside(self, step: int, limiter: anyio.CapacityLimiter) -> None:
        dirs = await in_thread(limiter, step_dirs, self.storage)
        if step in dirs:
            moved = await in_thread(limiter, functools.partial(
                quarantine, self.storage, step, dirs[step], self.rank,
                own_only=True))
            if moved is not None:
                _log.warning("ckpt.recovery.moved_aside", step=step, rank=self.rank,
                             path=moved)

    async def _read_candidate(self, shard: LocatedShard, state: Mapping[str, Any],
                              started: float, rejected: list[RejectedStep],
                              agreed: Candidates, limiter: anyio.CapacityLimiter) -> Loaded:
        """Read ``shard`` onto the live state's devices (the rollback backup prefetched
        meanwhile) and check it against the live state."""
        status = shard.status
        assert status.header is not None
        header = status.header
        meshes = _live_meshes(header.tensors, state, status)
        devices = [_target_device(rec, meshes) for rec in header.tensors]
        # The rollback backup of the live state is copied to host memory while the shard is
        # read (in a thread of its own): as long as a large part of the read, it then costs
        # the restore almost nothing (see BackupCopies).
        copies = BackupCopies()
        reading = device_bytes(header, devices)  # GPU memory the read below allocates
        prefetch = threading.Thread(target=prefetch_backup,
                                    args=(copies, state, self.rank, reading),
                                    name="ckpt-restore-backup", daemon=True)
        prefetch.start()
        try:
            read = await read_shard(
                shard.storage or self.storage, status, self.rank, devices=devices,
                threads=self.config.io_threads, limiter=limiter,
                shard_file=shard.shard_file, arrived=shard.arrived)
        finally:
            await in_thread(None, prefetch.join, abandon_on_cancel=True)
        tree, train_state = decode_contents(status, self.rank)
        tensors = [t if rec.dist is None
                   else to_dtensor(t, rec.dist, *meshes[rec.dist.mesh_shape])
                   for t, rec in zip(read.tensors, header.tensors)]
        # Everything that can be checked before touching a live object (a StateError here is
        # fatal on every rank, and nothing is rejected).
        left_out, kept = await in_thread(limiter, functools.partial(
            validate_state, state, tree, tensors, step=status.step, rank=self.rank,
            keep_missing=self.keep_missing))
        return Loaded(step=status.step, save_id=header.save_id, path=status.path, tree=tree,
                      tensors=tensors, train_state=train_state,
                      bytes=status.shard_size, started=started, rejected=tuple(rejected),
                      valid_by_rank=agreed.valid_by_rank, copies=copies,
                      not_restored=left_out, not_in_checkpoint=kept)


def prefetch_backup(copies: BackupCopies, state: Mapping[str, Any], rank: int,
                    reading: Mapping[int, int]) -> None:
    """Copy the rollback backup of ``state`` into ``copies`` (a thread of its own, while a
    restore reads). Best-effort: a failure here only means the backup is copied when it is
    taken."""
    try:
        copies.prefetch(state, device_reserved=reading)
    except Exception as exc:
        copies.clear()
        _log.debug("ckpt.recovery.prefetch_failed", rank=rank,
                   error=f"{type(exc).__name__}: {exc}")


def _live_meshes(records: tuple[TensorRecord, ...], state: Mapping[str, Any],
                 status: StepStatus) -> dict[tuple[int, ...], tuple[Any, torch.device]]:
    """The live mesh and local device for each mesh shape the checkpoint's DTensors use."""
    meshes: dict[tuple[int, ...], tuple[Any, torch.device]] = {}
    for record in records:
        if record.dist is None or record.dist.mesh_shape in meshes:
            continue
        found = find_mesh(state, record.dist.mesh_shape)
        if found is None:
            raise LayoutChanged(
                f"the checkpoint holds a DTensor on a mesh of shape "
                f"{list(record.dist.mesh_shape)}, the live state has no DTensor on such a mesh",
                step=status.step, path=record.path,
                hint="shard the model the same way (fully_shard) before restoring")
        meshes[record.dist.mesh_shape] = found
    saved = None if status.header is None else status.header.meshes
    if saved:
        live = live_meshes(state)
        unmatched = unmatched_meshes(saved, live)
        if unmatched:
            shape, names = unmatched[0]
            named = sorted(list(n) for s, n in live if s == shape and n is not None)
            raise LayoutChanged(
                f"the checkpoint holds DTensors on a mesh of shape {list(shape)} with "
                f"dimensions named {list(names or ())}; the live state's meshes of that shape "
                f"are named {named or 'nothing'}",
                step=status.step, path=str(status.path),
                hint="name the mesh's dimensions as when saving; otherwise the restore "
                     "reshards, and values saved per rank need Reshard(exclude=...) or "
                     "per_rank=")
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
