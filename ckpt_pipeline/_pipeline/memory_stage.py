"""The memory stage: with the memory tier (``memory=``), where a save commits.

Between ``copy`` and ``write_data``: the save's buffer is a shared-memory file that holds the
shard already (``_save/shm_pool.py``), so the stage hashes the data region where it lies, writes
the header after it, renames the file into the step's directory of the memory root, publishes
the manifest, and commits with the other ranks (the commit protocol of the disk, on a control
channel of its own, so that it never waits behind a write-through's votes). Then it keeps the
newest ``keep`` memory steps and gives the other buffers back. A save due for disk (every
``disk_every``-th, unless some rank's disk is still busy: ``WriteThroughVote``) goes on to the
disk stages with its buffer pinned; every other save leaves the pipeline here.

At close, the newest memory step goes to disk if it is not there (``flush``), and the rank's
memory files are removed once it is (``close``), unless ``keep_files``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import anyio

from .._config_groups import MemoryConfig, WriteOptions
from .._format.documents import Manifest, encode_manifest
from .._format.names import manifest_name, step_dir_name
from .._format.publish import PendingFiles
from .._format.region import checksum
from .._format.steps import committed_steps
from .._format.tidy import scrub, tidy_step_dir
from .._lineage import Timeline
from .._logging import log
from .._save.commit import commit
from .._save.job import SaveJob, Sealed, stage_error
from .._save.shm_pool import MemoryPool, MemorySlot
from .._save.write_data import hash_data
from .._threads import in_thread
from .._tiers.memory.shm import free_bytes
from .._tiers.memory.steps import (
    Topology,
    clear_slots,
    drop_files,
    read_topology,
    remove_rank_files,
    seal_shard,
    slot_dir,
    try_lock,
    write_topology,
)
from .._tiers.memory.vote import WriteThroughVote
from ..coordination import Coordinator
from ..errors import RootInUseError, StorageError
from ..events import Event, MemoryCommitted, MemoryPruned, SnapshotTaken, WriteThroughSkipped
from ..handle import CommitInfo
from ..storage import Storage
from .ledger import Ledger

__all__ = ("MemoryStage",)


class MemoryStage:
    """The memory tier of one pipeline on one rank (see the module docstring)."""

    def __init__(self, config: MemoryConfig, storage: Storage, pool: MemoryPool,
                 coordinator: Coordinator, options: WriteOptions, ledger: Ledger,
                 emit: Callable[[Event], None], limiter: anyio.CapacityLimiter,
                 timeline: Timeline, *, world_size: int) -> None:
        self.config = config
        self.storage = storage
        self.pool = pool
        self.coordinator = coordinator
        self.options = options
        self.ledger = ledger
        self._emit = emit
        self.limiter = limiter
        self.timeline = timeline
        self.rank = coordinator.rank
        self.world_size = world_size
        self.commits = 0
        """Memory commits that carried (the same count on every rank)."""
        self.skipped = 0
        self.held: dict[int, SaveJob] = {}
        """This run's memory steps whose buffer holds them, by step."""
        self.writing = 0
        """Write-throughs of this rank in the disk stages (not yet settled)."""
        self.newest: SaveJob | None = None
        """This run's newest memory step (its job is ``committed`` once it is on disk too)."""
        self._retaining = anyio.Lock()
        self._lock: int | None = None

    # -- open and close --------------------------------------------------------------------

    async def open(self, device: int | None) -> None:
        """Clear what a crash left (buffers being filled, uncommitted files), record where
        this rank runs, and make the buffers now when their size is given."""
        storage, limiter = self.storage, self.limiter
        await in_thread(limiter, storage.ensure_root)
        self._lock = await in_thread(limiter, try_lock, storage, self.rank)
        if self._lock is None:
            raise RootInUseError(
                f"rank {self.rank}'s files in the memory tier {storage.root} are in use by "
                "another open pipeline", rank=self.rank, path=str(storage.root),
                hint="give each job a memory directory of its own (memory='/dev/shm/<job>'), "
                     "or close the other pipeline")
        await in_thread(limiter, clear_slots, storage, slot_dir(self.rank))
        await in_thread(limiter, scrub, storage, self.rank)
        await in_thread(limiter, self._check_topology, Topology.here(self.world_size, device))
        if self.config.slot_bytes is not None:
            await in_thread(limiter, lambda: self.pool.reserve(
                self.config.slot_bytes or 0, register=device is not None))

    def _check_topology(self, here: Topology) -> None:
        """Drop this rank's memory steps when it ran elsewhere when it wrote them (another
        host, boot, world size or GPU: a memory restore then is refused, recovery goes to
        disk), then record where it runs now. Worker thread."""
        steps = committed_steps(self.storage, self.rank)
        recorded = read_topology(self.storage, self.rank)
        changed = None if not steps else (
            "no topology recorded" if recorded is None else here.differs(recorded))
        if changed is not None:
            log.warning("ckpt.memory.topology_changed", rank=self.rank,
                        path=str(self.storage.root), change=changed, steps=sorted(steps),
                        hint="these memory steps are dropped, not restored; recovery uses "
                             "the disk")
            for dir_name in steps.values():
                drop_files(self.storage, dir_name, self.rank, None)
        write_topology(self.storage, self.rank, here)

    def flush(self) -> SaveJob | None:
        """At close: the newest memory step, to be written through when it is not on disk
        (the same on every rank: every rank made the same memory commits)."""
        job = self.newest
        if job is None or job.committed or job.slot is None:
            return None
        job.write_through = True
        job.leaves = False
        job.error = None
        self.pool.pin_disk(job.slot)
        self.writing += 1
        return job

    async def close(self, disk: Storage) -> None:
        """After the stages: unmap the buffers; remove this rank's memory files when the
        newest memory step is committed on disk (``disk``) too, else keep them: it is
        restorable only from memory (a step restored from memory and not saved since, or a
        write-through that failed)."""
        self.pool.close()
        try:
            await self._clean_up(disk)
        finally:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None

    async def _clean_up(self, disk: Storage) -> None:
        if self.config.keep_files:
            return
        try:
            newest = await in_thread(self.limiter, _newest_memory_only, self.storage, disk,
                                     self.rank)
            if newest is not None:
                log.warning("ckpt.memory.kept_at_close", rank=self.rank, step=newest,
                            path=str(self.storage.root),
                            hint="the newest memory step is not on disk; its files stay for "
                                 "the next run to restore")
                return
            await in_thread(self.limiter, remove_rank_files, self.storage, self.rank)
            with contextlib.suppress(OSError):
                os.rmdir(self.storage.root)  # the last rank of the job to close
        except Exception as exc:
            log.warning("ckpt.memory.cleanup_failed", rank=self.rank,
                        error=f"{type(exc).__name__}: {exc}", path=str(self.storage.root))

    # -- the stage -------------------------------------------------------------------------

    async def run(self, job: SaveJob) -> None:
        """Seal the save's shard in memory and commit it there (see the module docstring)."""
        if job.error is None:
            try:
                await self._seal(job)
            except Exception as exc:  # this rank still votes, with its error
                job.error = stage_error(job, "memory", exc, str(self.storage.root))
                job.failed_stage = "memory"
        vote = WriteThroughVote(due=self.commits % self.config.disk_every == 0,
                                busy=self.writing > 0)
        files = job.memory_files if job.memory_files is not None else PendingFiles()
        await commit(job, self.storage, self.coordinator, limiter=self.limiter,
                     participants=[vote], lineage=self.timeline.lineage(), files=files)
        if job.error is not None:
            return
        slot = job.slot
        assert isinstance(slot, MemorySlot) and job.sealed is not None
        job.memory_committed = True
        self.commits += 1
        self.pool.keep(slot)
        self.held[job.step] = job
        self.newest = job
        write = vote.decision == "write"
        if write:
            job.write_through = True
            self.pool.pin_disk(slot)
            self.writing += 1
        self.pool.release(slot)  # the save's own hold: kept (and pinned) from here
        path = os.path.join(str(self.storage.root), files.dir_name)
        seconds = time.perf_counter() - job.requested_at
        self.ledger.committed(job.step)
        self._emit(MemoryCommitted(
            step=job.step, rank=self.rank, save_id=job.save_id, path=path,
            bytes=job.sealed.shard_size, seconds=seconds, write_through=write,
            shm_used=self.pool.allocated_bytes, shm_free=_free(self.storage)))
        job.control.resolve(CommitInfo(step=job.step, rank=self.rank, save_id=job.save_id,
                                       path=path, bytes=job.sealed.shard_size, seconds=seconds,
                                       tier="memory"))
        if vote.decision == "skip":
            self.skipped += 1
            self._emit(WriteThroughSkipped(step=job.step, rank=self.rank, save_id=job.save_id,
                                           busy_ranks=vote.busy_ranks, skipped=self.skipped))
        await self.retain()
        if not write:
            job.leaves = True
            self.ledger.settle(job.control)

    async def _seal(self, job: SaveJob) -> None:
        written = await hash_data(job, chunk_bytes=self.options.chunk_bytes,
                                  threads=self.options.io_threads, limiter=self.limiter)
        job.written = written
        if written.copy_seconds is not None:
            self._emit(SnapshotTaken(step=job.step, rank=self.rank, save_id=job.save_id,
                                     bytes=job.data_bytes, seconds=written.copy_seconds))
        slot = job.slot
        assert isinstance(slot, MemorySlot) and slot.shm is not None
        files = PendingFiles(step_dir_name(job.step))
        job.memory_files = files
        rel, size, preamble = await in_thread(
            self.limiter, seal_shard, self.storage, slot.shm.fd, slot.rel, job.step, job.rank,
            written.header, job.data.data_end)
        self.pool.moved(slot, rel)
        manifest = encode_manifest(Manifest(
            step=job.step, rank=job.rank, world_size=job.world_size, save_id=job.save_id,
            shard_size=size, header_checksum=checksum(written.header),
            data_bytes=job.data_bytes))
        await in_thread(self.limiter, files.publish_small, self.storage,
                        manifest_name(job.rank), manifest)
        job.sealed = Sealed(size, preamble, manifest)

    async def undo(self, job: SaveJob) -> None:
        """A save that failed before its memory commit carried: its memory files go (the
        commit record first), its buffer gets its free name back."""
        files, slot = job.memory_files, job.slot
        if files is None or job.memory_committed:
            return
        job.memory_files = None
        await in_thread(self.limiter, files.remove, self.storage)
        if isinstance(slot, MemorySlot) and slot.rel != slot.home:
            await in_thread(self.limiter, self.storage.move, slot.rel, slot.home)
            self.pool.moved(slot, slot.home)
            with contextlib.suppress(StorageError):
                await in_thread(self.limiter, tidy_step_dir, self.storage, files.dir_name)

    def written_through(self, job: SaveJob) -> None:
        """A write-through left the disk stages (committed there or failed)."""
        if not job.write_through:
            return
        job.write_through = False  # (its buffer was unpinned once written: release_slot)
        self.writing = max(0, self.writing - 1)

    async def after_restore(self, step: int) -> None:
        """A restore loaded ``step``: this rank's newer memory steps are of an abandoned
        history; they go (as the disk's are moved aside)."""
        async with self._retaining:
            steps = await in_thread(self.limiter, committed_steps, self.storage, self.rank)
            for newer, dir_name in sorted(steps.items()):
                if newer > step:
                    await self._drop_step(newer, dir_name)
            if self.newest is not None and self.newest.step > step:
                self.newest = None

    async def retain(self) -> None:
        """Keep the newest ``keep`` memory steps (of any run) and those a write-through still
        reads; drop the others, giving this run's buffers back."""
        async with self._retaining:
            try:
                steps = await in_thread(self.limiter, committed_steps, self.storage, self.rank)
            except Exception as exc:
                log.warning("ckpt.memory.list_failed", rank=self.rank,
                            error=f"{type(exc).__name__}: {exc}")
                return
            keep = set(sorted(steps, reverse=True)[:self.config.keep])
            for step, dir_name in sorted(steps.items()):
                job = self.held.get(step)
                if step in keep or (job is not None and job.write_through):
                    continue
                try:
                    await self._drop_step(step, dir_name)
                except Exception as exc:
                    log.warning("ckpt.memory.prune_failed", step=step, rank=self.rank,
                                error=f"{type(exc).__name__}: {exc}")

    async def _drop_step(self, step: int, dir_name: str) -> None:
        """Remove this rank's files of a memory step (commit record first); a buffer of this
        run gets its free name back and is free again (``MemoryPruned``)."""
        job = self.held.get(step)
        slot = None if job is None else job.slot
        home = slot.home if isinstance(slot, MemorySlot) else None
        await in_thread(self.limiter, drop_files, self.storage, dir_name, self.rank, home)
        if slot is not None and home is not None:
            self.pool.moved(slot, home)
            self.pool.unkeep(slot)
            self.pool.unpin_disk(slot)
        self.held.pop(step, None)
        self._emit(MemoryPruned(step=step, rank=self.rank,
                                path=os.path.join(str(self.storage.root), dir_name)))


def _free(storage: Storage) -> int:
    try:
        return free_bytes(str(storage.root))
    except OSError:
        return -1


def _newest_memory_only(memory: Storage, disk: Storage, rank: int) -> int | None:
    """The newest memory step of ``rank`` when the disk root lacks its commit record."""
    steps = committed_steps(memory, rank)
    if not steps:
        return None
    newest = max(steps)
    return None if newest in committed_steps(disk, rank) else newest
