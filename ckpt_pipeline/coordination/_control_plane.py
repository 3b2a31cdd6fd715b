"""The control plane between ranks: one primitive, an all-gather of small byte messages.

The pipeline builds every agreement on it (``coordination/_agree.py``), always from its event loop and in
the same order on every rank:

1. at open: the run id that save ids are built from (rank 0's proposal);
2. per save, after this rank's shard is durable or failed: every rank's outcome; the commit
   record is written only when all succeeded for the same step and save id;
3. at restore: every rank's valid steps, then every rank's load outcome per candidate, then a
   barrier after the newer steps were moved aside.

``LocalCoordinator`` serves a single process. ``DistributedCoordinator`` runs on a gloo process
group of torch.distributed (created for the purpose, so the control plane never waits behind
NCCL work), with a timeout on every exchange: a dead or stuck rank becomes a CoordinationError
naming the ranks that did not answer, never a process that waits forever.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Protocol, runtime_checkable

import torch

from .._hostmem import byte_view
from .._threads import in_thread
from ..errors import ConfigError, CoordinationError

__all__ = ("Coordinator", "DistributedCoordinator", "LocalCoordinator")


@runtime_checkable
class Coordinator(Protocol):
    """Exchanges small messages between the ranks of one job (call order: module docstring)."""

    rank: int
    world_size: int

    async def all_gather(self, payload: bytes, *, what: str, step: int | None = None
                         ) -> list[bytes]:
        """Every rank's payload, indexed by rank.

        Raises CoordinationError (naming the ranks that did not answer) when the exchange does
        not complete within the coordinator's timeout.
        """


class LocalCoordinator:
    """The coordinator of a single process: every rank is this one."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    async def all_gather(self, payload: bytes, *, what: str, step: int | None = None
                         ) -> list[bytes]:
        return [payload]


class DistributedCoordinator:
    """All-gathers on a gloo process group, each bounded by ``timeout_s``.

    Construct it on the training thread of every rank at the same point (creating the group is
    a collective of the default group), after ``torch.distributed.init_process_group``. Pass
    ``group`` to use a gloo group of your own instead.
    """

    def __init__(self, group: Any = None, *, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialized",
                              hint="call torch.distributed.init_process_group first, or use "
                                   "LocalCoordinator for a single process")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r} must be positive")
        self.timeout_s = float(timeout_s)
        if group is None:
            group = dist.new_group(backend="gloo",
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        elif dist.get_backend(group) != "gloo":
            raise ConfigError("the control-plane group must use the gloo backend",
                              hint="create it with torch.distributed.new_group(backend='gloo')")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._store = _default_store(dist)
        self._seq = 0
        self._broken: str | None = None
        self._lock = threading.Lock()

    async def all_gather(self, payload: bytes, *, what: str, step: int | None = None
                         ) -> list[bytes]:
        with self._lock:
            self._seq += 1
            seq = self._seq
        if self._broken is not None:
            raise CoordinationError(
                f"{what}: the control plane failed earlier ({self._broken})", step=step,
                rank=self.rank, hint="restart the job; checkpoints committed so far are intact")
        started = time.monotonic()
        try:
            return await in_thread(None, self._gather, payload, seq)
        except Exception as exc:
            elapsed = time.monotonic() - started
            missing = self._missing(seq)
            self._broken = f"{what} at step {step}: {type(exc).__name__}"
            who = (f"rank(s) {missing} did not take part" if missing
                   else "the exchange failed")
            when = (f"after the {self.timeout_s:g} s timeout"
                    if elapsed >= 0.9 * self.timeout_s else f"after {elapsed:.1f} s")
            error = CoordinationError(
                f"{what}: {who} ({when}; {type(exc).__name__}: {exc})",
                step=step, rank=self.rank,
                hint="a rank died or is stuck; restart the job, it resumes from the newest "
                     "checkpoint committed on every rank", ranks=tuple(missing))
            raise error from exc

    def _gather(self, payload: bytes, seq: int) -> list[bytes]:
        dist = self._dist
        if self._store is not None:
            self._store.set(self._key(self.rank), str(seq))
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
        if payload:
            mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        return [bytes(byte_view(g, 0, int(s.item()))) if int(s.item()) else b""
                for g, s in zip(gathered, sizes, strict=True)]

    def _key(self, rank: int) -> str:
        """One key per rank in the job's store: the number of its latest exchange."""
        return f"ckpt_pipeline/{getattr(self.group, 'group_name', 'control')}/{rank}"

    def _missing(self, seq: int) -> list[int]:
        """Ranks that never entered exchange ``seq`` (best effort, through the default store)."""
        if self._store is None:
            return []
        missing = []
        for rank in range(self.world_size):
            try:
                key = self._key(rank)
                if not self._store.check([key]) or int(self._store.get(key)) < seq:
                    missing.append(rank)
            except Exception:
                return []
        return missing


def _default_store(dist: Any) -> Any:
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:
        return None
