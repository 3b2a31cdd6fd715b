"""Admission: the part of ``save()`` that runs on the training thread.

``plan`` validates the request and builds a frozen :class:`SavePlan` (flatten the state, capture
the RNG states, encode the tree, lay out the data region, check every limit a reader
enforces); ``acquire`` takes a host buffer (waiting or not, by the ``when_busy`` policy);
``start`` claims the step, starts the copies and builds the job the stages take over.
Bad input raises in ``plan``, before anything is copied or written.

With device staging, a save whose host buffer is not ready (still being made, or every one
busy) does not wait for it on the training thread: ``acquire`` answers ``LATER``, the save's
CUDA tensors go to the staging buffer, and the copy stage takes the host buffer (``SaveJob.
host_buffer``). The training thread then waits at most for the staging buffer, which the
previous save holds until its copies to the host are queued.

Without it (``device_staging=None``, the default), the same holds for a save whose host
buffers are not made yet (a fresh job's first save, or one that comes while they are being
made): its CUDA tensors go to a transient staging buffer (the *bridge*), allocated only where
the GPU has room for it and freed once its copies to the host are queued. A save that finds the
bridge held, or no room for it, waits for its host buffer as before. ``device_staging=False``
never stages.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._config_groups import SnapshotOptions
from .._format.documents import encode_tree
from .._format.layout import DataLayout, padded_to, plan_layout
from .._format.limits import DTYPE_NAMES
from .._gc import gc_paused
from .._save.buffers import DeviceStaging, HostPool, Slot
from .._save.checks import check_byte_copyable, check_save
from .._save.control import HandleControl
from .._save.copy import NoStagingError, item_sources, take_snapshot
from .._save.copy_streamed import begin_streamed_snapshot
from .._save.job import SaveJob
from .._save.shm_pool import MemoryPool, MemorySlot
from .._tree import FlatState, flatten_state
from ..errors import (
    CheckpointError,
    ForkedProcessError,
    PoolBusyError,
    StateError,
    StepOrderError,
    StorageError,
)
from ..events import Event, SaveFailed, SaveRequested, SaveSkipped
from ..train_state import RNGState, TrainState
from .ledger import Ledger

__all__ = ("LATER", "Admission", "Later", "SavePlan")


class Later:
    """``Admission.acquire``'s answer for a save that takes its host buffer in the pipeline."""

    __slots__ = ()


LATER = Later()


@dataclass(frozen=True, slots=True)
class SavePlan:
    """A validated save, before it has a host buffer."""

    step: int
    started: float
    flat: FlatState
    tree: bytes
    train_state: dict[str, Any]
    layout: DataLayout
    pinned: bool
    streamed: bool


class Admission:
    """The training-thread part of ``save()`` and ``wait_snapshot()`` (see module docstring)."""

    def __init__(self, options: SnapshotOptions, rank: int, world_size: int, root: str,
                 ledger: Ledger, pool: HostPool | MemoryPool, staging: DeviceStaging | None,
                 emit: Callable[[Event], None], *, bridge: DeviceStaging | None = None) -> None:
        self.options = options
        self.rank = rank
        self.world_size = world_size
        self.root = root
        self.ledger = ledger
        self.pool = pool
        self.staging = staging
        self.bridge = bridge
        """Transient staging for saves whose host buffers are not made yet (module docstring)."""
        self._emit = emit
        self.run_id = ""
        self.pid = os.getpid()
        self._refused: dict[int, CheckpointError] = {}
        """{step: why no buffer could be made for it} (the memory tier's room), until the
        save is failed with it."""

    def check_process(self) -> None:
        """Refuse use from a forked child: the pipeline's thread and loop stayed in its parent."""
        if os.getpid() != self.pid:
            raise ForkedProcessError(
                f"this pipeline was created by process {self.pid}; process {os.getpid()} is "
                "a fork of it and cannot use it", rank=self.rank, path=self.root,
                hint="open a pipeline in the child (on another root or rank), or use it from "
                     "the parent only")

    def plan(self, step: int, state: Mapping[str, Any],
             train_state: TrainState | None) -> SavePlan:
        """Validate, capture RNG, flatten and encode, lay out, check the limits."""
        with gc_paused():
            return self._plan(step, state, train_state)

    def _plan(self, step: int, state: Mapping[str, Any],
              train_state: TrainState | None) -> SavePlan:
        started = time.perf_counter()
        self.ledger.check_not_restoring("save()", step)
        self.ledger.raise_if_failures_due(step)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StepOrderError(f"step must be a non-negative int, got {step!r}",
                                 rank=self.rank)
        self.ledger.check_step_order(step)
        ts = train_state if train_state is not None else TrainState(step=step)
        if not isinstance(ts, TrainState):
            raise StateError(f"train_state must be a TrainState, got {type(ts).__name__}",
                             step=step, rank=self.rank)
        if ts.step != step:
            raise StateError(f"train_state.step is {ts.step} but the save is for step {step}",
                             step=step, rank=self.rank,
                             hint="advance the TrainState to this step before saving")
        if self.options.capture_rng:
            ts = ts.with_rng(RNGState.capture())
        try:
            flat = flatten_state(state, step=step)
        except StateError as exc:
            if exc.rank is None:
                exc.rank = self.rank
            raise
        ts_plain = ts.to_plain()
        try:
            tree = encode_tree(flat.skeleton)
        except (TypeError, ValueError, OverflowError) as exc:
            raise StateError(f"a value cannot be encoded: {exc}", step=step, rank=self.rank,
                             hint="non-tensor leaves must be plain values") from exc
        layout = plan_layout(flat.tensors)
        # Every limit a reader enforces (the table in _format.limits), before anything is
        # written.
        check_save(flat, tree, ts_plain, step=step, rank=self.rank,
                   world_size=self.world_size, save_id=f"{self.run_id}-{step}",
                   chunk_bytes=self.options.chunk_bytes, layout=layout)
        cap = self.options.host_buffer_bytes
        streamed = cap is not None and layout.buffer_bytes > cap
        if streamed:
            _check_streamable(flat, step, self.rank)
            check_byte_copyable(flat, step=step, rank=self.rank)
        return SavePlan(step, started, flat, tree, ts_plain, layout,
                        pinned=any(t.device.type == "cuda" for t in flat.tensors),
                        streamed=streamed)

    def acquire(self, plan: SavePlan, block: bool) -> Slot | Later | None:
        """A host buffer for the plan; None when none is free and this call may not wait;
        ``LATER`` when the save may start without it (see the module docstring)."""
        wait = block and self.options.when_busy == "block"
        size = self.options.host_buffer_bytes if plan.streamed else plan.layout.buffer_bytes
        assert size is not None
        if self._may_defer(plan):
            slot = self.pool.acquire(max(size, 1), pinned=plan.pinned, block=False, make=False)
            return LATER if slot is None else slot
        if self._may_bridge(plan) and not self.pool.made_for(max(size, 1), pinned=True):
            slot = self.pool.acquire(max(size, 1), pinned=True, block=False, make=False)
            return LATER if slot is None else slot
        try:
            return self.pool.acquire(max(size, 1), pinned=plan.pinned, block=wait)
        except StorageError as exc:  # no room for a memory buffer: this save fails
            exc.step = plan.step
            exc.rank = self.rank
            self._refused[plan.step] = exc
            return None

    def _may_defer(self, plan: SavePlan) -> bool:
        """Whether a save may start before its host buffer exists: with device staging (a
        staging buffer holds its CUDA tensors meanwhile), under ``when_busy="block"``."""
        return (self.staging is not None and plan.pinned and not plan.streamed
                and self.options.when_busy == "block")

    def _may_bridge(self, plan: SavePlan) -> bool:
        """Whether a save whose host buffers are not made yet may start in the bridge."""
        return (self.bridge is not None and plan.pinned and not plan.streamed
                and self.options.when_busy == "block")

    def start(self, plan: SavePlan, slot: Slot | Later | None) -> SaveJob:
        """Claim the step, start the copies, build the job. Without a slot: skipped.

        Runs under the admission lock: a restore that begins meanwhile waits until the save
        is registered as pending (and then waits for it), or the save sees the restore and
        is refused. Whatever raises gives the slot back.
        """
        try:
            with self.ledger.admission, gc_paused():
                if slot is None:
                    return self._skip(plan.step)
                self.ledger.claim(plan.step)  # another thread may have saved it, or a restore
                if isinstance(slot, Later):
                    try:
                        return self._admit(plan, None)
                    except NoStagingError:  # no staging buffer after all: the host buffer now
                        slot = self.pool.acquire(max(plan.layout.buffer_bytes, 1),
                                                 pinned=plan.pinned, block=True)
                        assert slot is not None
                return self._admit(plan, slot)
        except BaseException:
            if isinstance(slot, Slot):
                self.pool.release(slot)
            raise

    def _admit(self, plan: SavePlan, slot: Slot | None) -> SaveJob:
        """Start the copies into ``slot``, or, without one, into device staging buffers
        (NoStagingError where there are none: nothing is held then)."""
        step, flat = plan.step, plan.flat
        layout = plan.layout
        if isinstance(slot, MemorySlot):  # the data region fills the buffer: it is the shard
            layout = padded_to(layout, slot.buffer.numel())
        sources = item_sources(flat.tensors, layout)
        offsets = [item.offset for item in layout.items]
        if plan.streamed:
            snap = begin_streamed_snapshot(flat.tensors, flat.paths, sources, offsets,
                                           layout.gaps, step=step, rank=self.rank)
        else:
            snap = take_snapshot(flat.tensors, flat.paths, sources, offsets, layout.gaps,
                                 None if slot is None else slot.buffer, step=step,
                                 rank=self.rank,
                                 ordered=self.options.snapshot_mode == "ordered",
                                 staging=self.staging if slot is not None
                                 else self.staging or self.bridge)
        save_id = f"{self.run_id}-{step}"
        control = HandleControl(step, save_id, snap)
        job = SaveJob(
            step=step, rank=self.rank, world_size=self.world_size, save_id=save_id,
            control=control, slot=slot,
            host_buffer=None if slot is not None else (max(layout.buffer_bytes, 1), plan.pinned),
            snapshot=snap, paths=flat.paths,
            dtypes=tuple(DTYPE_NAMES[t.dtype] for t in flat.tensors),
            shapes=tuple(tuple(t.shape) for t in flat.tensors), layouts=flat.layouts,
            data=layout, tree=plan.tree, train_state=plan.train_state,
            requested_at=plan.started, meshes=flat.meshes,
        )
        self.ledger.register(control, wait_for_snapshot=snap.needs_release)
        self._emit(SaveRequested(step=step, rank=self.rank, save_id=save_id,
                                 tensors=len(flat.tensors), bytes=job.data_bytes,
                                 blocking_seconds=time.perf_counter() - plan.started))
        return job

    def _skip(self, step: int) -> SaveJob:
        """A save dropped by the ``skip`` policy: it fails now, and still votes at commit."""
        self.ledger.claim(step)
        save_id = f"{self.run_id}-{step}"
        control = HandleControl(step, save_id)
        reason = "every host buffer is busy with an earlier save"
        error: CheckpointError = PoolBusyError(
            f"save skipped: {reason}", step=step, rank=self.rank,
            hint="save less often, or use buffer_slots=2 or when_busy='block'")
        refused = self._refused.pop(step, None)
        control.fail(refused or error)
        if refused is None:
            self._emit(SaveSkipped(step=step, rank=self.rank, reason=reason))
        else:  # no buffer could be made: a failed save, counted as one
            error = refused
            self.ledger.failed(refused, step)
            self._emit(SaveFailed(step=step, rank=self.rank, save_id=save_id, stage="copy",
                                  error=str(refused)))
        return SaveJob.placeholder(step, self.rank, self.world_size, save_id, control,
                                   error, "copy")

    def wait_snapshot(self, *, block_cpu: bool) -> None:
        """On the caller's thread (its current CUDA streams are the ones to order)."""
        for handle in self.ledger.take_snapshots():
            handle.wait_snapshot(block_cpu=block_cpu)


def _check_streamable(flat: FlatState, step: int, rank: int) -> None:
    """A streamed save copies byte ranges of each tensor: they must be contiguous."""
    for tensor, path in zip(flat.tensors, flat.paths):
        if not tensor.is_contiguous():
            raise StateError(
                f"tensor {path} is not contiguous; a state larger than host_buffer_bytes is "
                "copied in byte ranges", step=step, rank=rank, path=path,
                hint="make it contiguous, or set host_buffer_bytes=None (a buffer as large "
                     "as the state)")
