"""The recovery coordinator of one rank: scan, agree across ranks, load and verify, fall back.

Loading is split in three so that the sync face can apply the state on the caller's thread
(its CUDA streams): ``load_latest`` (event loop: read, verify, agree), ``apply`` (caller's
thread: into the live objects), ``finish`` (event loop: move newer unusable steps aside, report).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
import torch

from . import _recovery
from ._tree import apply_state, check_structure
from .config import PipelineConfig
from .coordination import Coordinator
from .errors import CheckpointError, CheckpointIntegrityError, RestoreError, StateError
from .events import CheckpointRejected, CheckpointRestored, Event
from .handle import RejectedStep, RestoreResult
from .storage import Storage
from .train_state import TrainState

__all__ = ("Loaded", "Recovery")

_log = structlog.get_logger("ckpt_pipeline")


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


class Recovery:
    """Finds the newest step that every rank holds and verifies, and loads it."""

    def __init__(self, storage: Storage, coordinator: Coordinator, config: PipelineConfig,
                 emit: Callable[[Event], None]) -> None:
        self.storage = storage
        self.coordinator = coordinator
        self.config = config
        self.rank = config.rank
        self._emit = emit

    async def _thread(self, fn: Callable[..., Any], *args: Any,
                      limiter: anyio.CapacityLimiter) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)

    async def load_latest(self, state: Mapping[str, Any],
                          limiter: anyio.CapacityLimiter) -> Loaded | None:
        """Scan, agree on candidates, and read the newest one that verifies on every rank.

        Raises RestoreError when steps exist but none loads, StateError when the live state
        does not fit the checkpoint (a usage error: nothing is rejected then).
        """
        started = time.perf_counter()
        statuses = await self._thread(_recovery.scan, self.storage, self.rank, limiter=limiter)
        rejected: list[RejectedStep] = []
        for status in statuses:
            if status.complete and not status.valid:
                rejected.append(self._reject(status.step, status.path, status.reason or "?"))
        valid = {s.step: s for s in statuses if s.valid}
        for status in valid.values():
            if status.world_size != self.config.world_size:
                raise RestoreError(
                    f"step {status.step} was saved by {status.world_size} rank(s), this job "
                    f"has {self.config.world_size}", step=status.step, rank=self.rank,
                    path=status.path, hint="restore with the same world size (resharding is "
                                           "not supported)")
        candidates = await self.coordinator.agree_candidates(
            {step: s.save_id or "" for step, s in valid.items()})
        for step, save_id in candidates:
            status = valid.get(step)
            error: str | None = None
            loaded: Loaded | None = None
            try:
                if status is None or status.save_id != save_id:
                    raise CheckpointIntegrityError("this rank holds no matching save",
                                                   step=step, rank=self.rank)
                loaded = await self._read_candidate(status, state, started, rejected, limiter)
            except StateError:
                raise  # the live state does not fit: the user's mistake, not a bad checkpoint
            except (CheckpointError, OSError) as exc:
                error = str(exc)
            failures = await self.coordinator.agree_loaded(step, error)
            if not failures and loaded is not None:
                return loaded
            path = status.path if status is not None else ""
            reason = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
            rejected.append(self._reject(step, path, reason))
        if rejected:
            listing = "; ".join(f"step {r.step}: {r.reason}" for r in rejected)
            raise RestoreError(f"no checkpoint could be loaded ({listing})", rank=self.rank,
                               path=str(self.storage.root),
                               hint="inspect with `ckpt-pipeline verify`; move the root aside "
                                    "to start fresh")
        return None

    async def _read_candidate(self, status: _recovery.StepStatus, state: Mapping[str, Any],
                              started: float, rejected: list[RejectedStep],
                              limiter: anyio.CapacityLimiter) -> Loaded:
        assert status.header is not None
        header = status.header
        cuda = torch.cuda.is_available()
        pinned = cuda and any(r.device.startswith("cuda") for r in header.tensors)
        shard = await _recovery.read_shard(self.storage, status, self.rank, pinned=pinned,
                                           threads=self.config.io_threads,
                                           limiter=limiter)
        tree, train_state = _recovery.decode_contents(status, self.rank)
        tensors = [_to_saved_device(t, rec.device) for t, rec in
                   zip(shard.tensors, header.tensors)]
        check_structure(state, tree, tensors, step=status.step)
        return Loaded(step=status.step, save_id=header.save_id, path=status.path, tree=tree,
                       tensors=tensors, train_state=train_state,
                       bytes=status.shard_size, started=started, rejected=tuple(rejected))

    def apply(self, loaded: Loaded, state: MutableMapping[str, Any]) -> None:
        """Load into the live objects; runs on the caller's thread (its CUDA streams)."""
        apply_state(state, loaded.tree, loaded.tensors, step=loaded.step)
        if self.config.restore_rng and loaded.train_state.rng is not None:
            loaded.train_state.rng.apply()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        loaded.tensors = []

    async def finish(self, loaded: Loaded, limiter: anyio.CapacityLimiter) -> RestoreResult:
        """Move newer, unusable steps aside so that training can save them again; report."""
        dirs = await self._thread(_recovery.step_dirs, self.storage, limiter=limiter)
        for step, dir_name in sorted(dirs.items()):
            if step > loaded.step:
                moved = await self._thread(_recovery.quarantine, self.storage, step, dir_name,
                                           self.rank, limiter=limiter)
                if moved is not None:
                    _log.warning("ckpt.recovery.moved_aside", step=step, rank=self.rank,
                             path=moved)
        seconds = time.perf_counter() - loaded.started
        self._emit(CheckpointRestored(step=loaded.step, rank=self.rank, save_id=loaded.save_id,
                                      path=loaded.path, bytes=loaded.bytes, seconds=seconds))
        return RestoreResult(step=loaded.step, save_id=loaded.save_id, path=loaded.path,
                             train_state=loaded.train_state, bytes=loaded.bytes,
                             seconds=seconds, rejected=loaded.rejected)

    def _reject(self, step: int, path: str, reason: str) -> RejectedStep:
        self._emit(CheckpointRejected(step=step, rank=self.rank, path=path, reason=reason))
        return RejectedStep(step, path, reason)


def _to_saved_device(t: torch.Tensor, device: str) -> torch.Tensor:
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            dev = torch.device("cuda", torch.cuda.current_device())
        return t.to(dev, non_blocking=True)
    return t

