"""The work of each save stage, in order, as the runner calls it (``StageRunner``).

Each method takes the job one step further, on the pipeline's event loop, its blocking work
in worker threads under the pipeline's limiter, and emits the stage's event:

1. ``copy``: queue the host copies that the training thread left to the pipeline (from the
   device staging buffers); a save with no device copies is in host memory already.
2. ``write_data``: hash and write each tensor's bytes to the temporary shard as its copy
   lands; give the host buffer back.
3. ``seal``: the shard header, fsync, publish under the final name; the manifest.
4. ``commit``: every rank's vote, then the commit record (this resolves the handle).
5. ``retain``: prune older steps by the retention policy (not those being uploaded to the
   persistent tier); report what could not be pruned.

A committed step that is due is handed to the persistent tier (``Promoter``) after commit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, get_args

import anyio

from .._config_groups import WriteOptions, retention_metrics
from .._format.layout import padded_to
from .._format.markers import clear_marker, write_marker
from .._lineage import Timeline
from .._logging import log, warn_unless_shown
from .._save.buffers import HostPool
from .._save.commit import commit
from .._save.job import SaveJob
from .._save.retain import Pruned, PruneFailed, prune, prune_rewound
from .._save.seal import seal
from .._save.shm_pool import MemoryPool, MemorySlot
from .._save.write_data import write_data
from .._threads import in_thread
from .._tiers.base import CommitParticipant
from .._tiers.persistent.promote import Promoter
from .._tiers.replica.replication import Replication
from .._tiers.replica.vote import Replicas, ReplicaVote
from ..coordination import Coordinator
from ..errors import CheckpointWarning, SaveError
from ..events import (
    CheckpointCommitted,
    CheckpointPruned,
    Event,
    ReplicationDegraded,
    RetentionFailed,
    SaveStage,
    ShardDataWritten,
    ShardReplicated,
    ShardSealed,
    SnapshotTaken,
)
from ..handle import CommitInfo
from ..retention import RetentionPolicy
from ..storage import Storage
from .ledger import Ledger
from .memory_stage import MemoryStage

__all__ = ("STAGES", "Stages")

STAGES: tuple[SaveStage, ...] = get_args(SaveStage)
"""The stages in order (``SaveStage``: their one vocabulary)."""

class Stages:
    """The five stages' work for one pipeline (see the module docstring)."""

    def __init__(self, options: WriteOptions, retention: RetentionPolicy, storage: Storage,
                 coordinator: Coordinator, ledger: Ledger, pool: HostPool | MemoryPool,
                 emit: Callable[[Event], None], limiter: anyio.CapacityLimiter,
                 replication: Replication | None = None,
                 promoter: Promoter | None = None, timeline: Timeline | None = None,
                 memory: MemoryStage | None = None) -> None:
        self.options = options
        self.retention = retention
        self.retention_metrics = retention_metrics(retention)
        self.rank = coordinator.rank
        self.storage = storage
        self.coordinator = coordinator
        self.ledger = ledger
        self.pool = pool
        self._emit = emit
        self.limiter = limiter
        self.replication = replication
        self.promoter = promoter
        self.timeline = timeline if timeline is not None else Timeline()
        """What each commit record names as its parent and timeline (moved on by commits)."""
        self.memory_tier = memory
        """The memory tier (``memory=``): its stage runs between copy and write_data."""

    def _uploads_paused(self) -> contextlib.AbstractContextManager[None]:
        """The persistent tier's uploads wait while this save writes (see ``Promoter``)."""
        if self.promoter is None:
            return contextlib.nullcontext()
        return self.promoter.writing()

    def release_slot(self, job: SaveJob) -> None:
        """Give the job's host buffer (and any device staging it holds) back.

        A memory save's buffer is the step in memory: once committed there, the memory tier
        keeps it (a write-through only unpins it here); before, it goes back once its files
        in memory are undone (``undo_memory``)."""
        if job.snapshot is not None:
            job.snapshot.enqueued.set()  # a streamed copy that never ran: wait_snapshot returns
            job.snapshot.discard_host_copies()  # staging buffers of a save that failed
        if job.memory_committed:
            if job.slot is not None and isinstance(self.pool, MemoryPool):
                self.pool.unpin_disk(job.slot)
            return
        if job.memory_files is not None:  # sealed in memory, not committed: undo first
            return
        if job.slot is not None:
            self.pool.release(job.slot)
            job.slot = None

    async def undo_memory(self, job: SaveJob) -> None:
        """A failed memory save: take its files out of the memory root, free its buffer."""
        if self.memory_tier is not None:
            await self.memory_tier.undo(job)
        self.release_slot(job)

    async def memory(self, job: SaveJob) -> None:
        assert self.memory_tier is not None
        await self.memory_tier.run(job)

    async def copy(self, job: SaveJob) -> None:
        started = time.perf_counter()
        snap = job.snapshot
        assert snap is not None
        if job.host_buffer is not None:  # may wait for the pool: not on the I/O threads
            await in_thread(None, self._bind_host_buffer, job)
        if snap.deferred:  # copies to the host from device staging buffers: off the caller
            await in_thread(self.limiter, snap.launch_host_copies)
        if snap.streaming or snap.has_device_copies:
            # write_data writes each piece once its copy is done, checks the versions and
            # reports the snapshot (a streamed one is copied there, a buffer at a time).
            return
        self._emit(SnapshotTaken(step=job.step, rank=self.rank, save_id=job.save_id,
                                 bytes=job.data_bytes, seconds=time.perf_counter() - started))

    def _bind_host_buffer(self, job: SaveJob) -> None:
        """A save that started without a host buffer (its CUDA tensors wait in device
        staging): take one from the pool, waiting or making it here, and bind it."""
        assert job.host_buffer is not None and job.snapshot is not None
        nbytes, pinned = job.host_buffer
        started = time.perf_counter()
        slot = self.pool.acquire(nbytes, pinned=pinned, block=True)
        assert slot is not None
        job.slot, job.host_buffer = slot, None
        if isinstance(slot, MemorySlot):  # the data region fills the buffer: it is the shard
            job.data = padded_to(job.data, slot.buffer.numel())
        job.snapshot.bind(slot.buffer, job.data.gaps)
        log.info("ckpt.snapshot.host_buffer_bound", step=job.step, rank=self.rank,
                  waited_s=round(time.perf_counter() - started, 4))

    async def write_data(self, job: SaveJob) -> None:
        started = time.perf_counter()
        if self.replication is not None:
            job.push = self.replication.push_for(job.step, job.save_id)
        with self._uploads_paused():
            written = await write_data(job, self.storage, chunk_bytes=self.options.chunk_bytes,
                                       threads=self.options.io_threads, limiter=self.limiter,
                                       direct_io=self.options.direct_io)
        job.written = written
        self.release_slot(job)  # the bytes are in the file now: the next save may copy
        if written.copy_seconds is not None:
            self._emit(SnapshotTaken(step=job.step, rank=self.rank, save_id=job.save_id,
                                     bytes=job.data_bytes, seconds=written.copy_seconds))
        self._emit(ShardDataWritten(step=job.step, rank=self.rank, save_id=job.save_id,
                                    bytes=job.data_bytes, header_bytes=len(written.header),
                                    seconds=time.perf_counter() - started))

    async def seal(self, job: SaveJob) -> None:
        started = time.perf_counter()
        with self._uploads_paused():
            job.sealed = await seal(job, self.storage, limiter=self.limiter)
        if job.push is not None and job.written is not None:
            await in_thread(self.limiter, job.push.finish, job.written.header,
                            job.data.data_end, job.sealed.preamble, job.sealed.manifest)
        self._emit(ShardSealed(step=job.step, rank=self.rank, save_id=job.save_id,
                               path=os.path.join(str(self.storage.root), job.files.dir_name),
                               bytes=job.shard_size, seconds=time.perf_counter() - started))

    async def commit(self, job: SaveJob) -> None:
        lineage = self.timeline.lineage()
        copies = None if self.replication is None else ReplicaVote(
            self.replication, job.push, step=job.step, save_id=job.save_id, rank=self.rank,
            limiter=self.limiter)
        participants: list[CommitParticipant[Any, Any]] = [
            p for p in (copies, self.promoter) if p is not None]
        await commit(job, self.storage, self.coordinator, limiter=self.limiter,
                     participants=participants, metrics=self.retention_metrics,
                     lineage=lineage)
        job.push = None
        if job.error is not None:
            return
        seconds = time.perf_counter() - job.requested_at
        path = os.path.join(str(self.storage.root), job.files.dir_name)
        job.committed = True
        self.timeline.committed(job.step, job.save_id)
        replicas = Replicas() if copies is None else copies.replicas()
        pushed = replicas.pushed
        if pushed is not None and self.replication is not None:
            for holder in pushed.acked:
                peer = self.replication.peers[holder]
                self._emit(ShardReplicated(step=job.step, rank=self.rank, save_id=job.save_id,
                                           peer=holder, node=peer.node,
                                           bytes=pushed.bytes.get(holder, 0),
                                           seconds=pushed.seconds.get(holder, 0.0)))
        degraded = None
        if replicas.missing:
            self._emit(ReplicationDegraded(step=job.step, rank=self.rank, save_id=job.save_id,
                                           missing=replicas.missing, reasons=replicas.reasons))
            listing = "; ".join(f"rank {s}'s copy on rank {h}: {why}" for (s, h), why in
                                zip(replicas.missing, replicas.reasons, strict=True))
            degraded = SaveError(
                f"step {job.step} committed without {len(replicas.missing)} of its copies "
                f"({listing})", step=job.step, rank=self.rank, path=path,
                hint="the step is restorable; a node lost now may take it with it. Check "
                     "the named peers (disk, network)",
                ranks=tuple(sorted({h for _s, h in replicas.missing})))
        self.ledger.committed(job.step, degraded=degraded)
        if degraded is not None:  # a failure for the policy: as visible as one
            warn_unless_shown(
                f"ckpt_pipeline: {degraded}. The failure policy counts it as a failed save: "
                f"{self.ledger.policy_note(failed=False)}. (This warning stands in for the "
                "ckpt.replicate.degraded log line, which no logging handler shows: configure "
                "logging, or filter ckpt_pipeline.CheckpointWarning.)", CheckpointWarning,
                logging.WARNING)
        info = CommitInfo(step=job.step, rank=self.rank, save_id=job.save_id, path=path,
                          bytes=job.shard_size, seconds=seconds,
                          replica_holders=replicas.holders,
                          missing_replicas=replicas.missing)
        self._emit(CheckpointCommitted(step=job.step, rank=self.rank, save_id=job.save_id,
                                       path=path, bytes=job.shard_size, seconds=seconds))
        job.control.resolve(info)
        if self.promoter is not None:
            self.promoter.committed(job.step, job.save_id, lineage)

    async def retain(self, job: SaveJob) -> None:
        """Prune older steps. Never fails the save: it is committed already.

        A step that cannot be removed is reported (``RetentionFailed``, and a marker in the
        root that ``ckpt-pipeline ls`` shows); a step pruned later loses its marker.
        """
        started = time.perf_counter()
        pruned: list[Pruned] = []
        rewound: list[Pruned] = []
        try:
            failed: list[PruneFailed] = []
            try:
                protect = set() if self.promoter is None else self.promoter.protected()
                pruned, failed = await in_thread(self.limiter, prune, self.storage, self.rank,
                                                 self.retention, job.step,
                                                 protect)
            except Exception as exc:  # the root could not even be listed
                failed = [PruneFailed(-1, str(self.storage.root),
                                      f"{type(exc).__name__}: {exc}")]
            for item in failed:
                self._emit(RetentionFailed(step=item.step, rank=self.rank,
                                           committed_step=job.step, path=item.path,
                                           error=item.error))
            await self._record_prunes(pruned, failed)
            rewound = await self._prune_rewound(job)
        finally:
            if self.memory_tier is not None and job.memory_committed:
                self.memory_tier.written_through(job)
                await self.memory_tier.retain()
            self.ledger.settle(job.control)
        for done in [*pruned, *rewound]:
            self._emit(CheckpointPruned(step=done.step, rank=self.rank, path=done.path,
                                        bytes=done.bytes,
                                        seconds=time.perf_counter() - started))

    async def _prune_rewound(self, job: SaveJob) -> list[Pruned]:
        """Remove the steps a rewind older than this commit moved aside (``prune_rewound``);
        a failure is reported as ``RetentionFailed``, without a marker (nothing of the
        current timeline is left behind)."""
        try:
            removed, failed = await in_thread(self.limiter, prune_rewound, self.storage,
                                              self.rank, job.step)
        except Exception as exc:
            removed, failed = [], [PruneFailed(-1, str(self.storage.root),
                                               f"{type(exc).__name__}: {exc}")]
        for item in failed:
            self._emit(RetentionFailed(step=item.step, rank=self.rank, committed_step=job.step,
                                       path=item.path, error=item.error))
        return removed

    async def _record_prunes(self, pruned: list[Pruned], failed: list[PruneFailed]) -> None:
        """Leave a marker for each step that could not be pruned, drop those of pruned ones."""
        for step, write in ([(f.step, f) for f in failed if f.step >= 0]
                            + [(p.step, None) for p in pruned]):
            try:
                if write is not None:
                    await in_thread(self.limiter, write_marker, self.storage, self.rank, step,
                                    write.error)
                else:
                    await in_thread(self.limiter, clear_marker, self.storage, self.rank, step)
            except Exception as exc:
                log.error("ckpt.retain.marker_failed", step=step, rank=self.rank,
                          error=f"{type(exc).__name__}: {exc}")
