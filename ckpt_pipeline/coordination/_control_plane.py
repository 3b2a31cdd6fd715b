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
``HierarchicalCoordinator`` (``_hierarchy.py``) keeps that contract and agrees per node first.

A coordinator may also offer ``all_gather_root``: the same exchange, with a second payload
of each rank's that only rank 0 receives (what rank 0 alone needs, such as the persistent
tier's object sums for its commit object), so that the other ranks neither receive nor
decode it. ``_agree`` uses it where a coordinator has it, and otherwise sends that payload
inside the message.
"""

from __future__ import annotations

import datetime
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .._hostmem import byte_view
from .._logging import log
from .._threads import in_thread
from ..errors import ConfigError, CoordinationError

__all__ = ("Coordinator", "DistributedCoordinator", "LocalCoordinator", "close_coordinator",
           "default_store", "destroy_group", "gather_bytes", "join_root", "pack_frames",
           "split_root", "unpack_frames")

_COUNT = struct.Struct("<I")


# ---------------------------------------------------------------- framing (no pickle)

def pack_frames(items: Sequence[bytes]) -> bytes:
    """``items`` as one message: their count, each length (little-endian u32), the bytes."""
    lengths = [len(item) for item in items]
    if any(n >= 1 << 32 for n in lengths) or len(items) >= 1 << 32:
        raise ValueError("a frame holds at most 2**32 - 1 items of at most 2**32 - 1 bytes")
    return b"".join([struct.pack(f"<I{len(items)}I", len(items), *lengths), *items])


def unpack_frames(data: bytes) -> list[bytes]:
    """The items ``pack_frames`` packed; ValueError for anything else (short, trailing bytes)."""
    if len(data) < _COUNT.size:
        raise ValueError(f"a frame of {len(data)} bytes has no item count")
    (count,) = _COUNT.unpack_from(data)
    head = _COUNT.size * (1 + count)
    if len(data) < head:
        raise ValueError(f"a frame of {len(data)} bytes is too short for {count} lengths")
    lengths = struct.unpack_from(f"<{count}I", data, _COUNT.size)
    if head + sum(lengths) != len(data):
        raise ValueError(f"a frame's {count} items take {sum(lengths)} bytes, not the "
                         f"{len(data) - head} it holds")
    out, at = [], head
    for n in lengths:
        out.append(data[at:at + n])
        at += n
    return out


def join_root(payload: bytes, for_root: bytes) -> bytes:
    """One message of ``payload`` and the piece for rank 0 alone (``pack_frames``)."""
    return pack_frames([payload, for_root])


def split_root(message: bytes) -> tuple[bytes, bytes]:
    """(payload, piece for rank 0) of a ``join_root`` message; ValueError otherwise."""
    items = unpack_frames(message)
    if len(items) != 2:
        raise ValueError(f"a message of {len(items)} items, not a payload and a piece")
    return items[0], items[1]


@runtime_checkable
class Coordinator(Protocol):
    """Exchanges small messages between the ranks of one job (call order: module docstring)."""

    rank: int
    world_size: int

    async def all_gather(self, payload: bytes, *, what: str, step: int | None = None
                         ) -> Sequence[bytes]:
        """Every rank's payload, indexed by rank (a list, or ``Runs`` of equal payloads).

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

    async def all_gather_root(self, payload: bytes, for_root: bytes, *, what: str,
                              step: int | None = None) -> tuple[list[bytes], dict[int, bytes]]:
        return [payload], ({0: for_root} if for_root else {})


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
        self._made_group = group is None
        if group is None:
            group = dist.new_group(backend="gloo",
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        elif dist.get_backend(group) != "gloo":
            raise ConfigError("the control-plane group must use the gloo backend",
                              hint="create it with torch.distributed.new_group(backend='gloo')")
        self._dist = dist
        self.group = group
        self._keys = f"ckpt_pipeline/{getattr(group, 'group_name', 'control')}"
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._store = default_store(dist)
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

    async def all_gather_root(self, payload: bytes, for_root: bytes, *, what: str,
                              step: int | None = None) -> tuple[list[bytes], dict[int, bytes]]:
        """``all_gather``, and on rank 0 every rank's non-empty ``for_root`` by rank ({} on
        the other ranks). In one ring every rank receives every part anyway: the others only
        split it off, never decode it."""
        framed = await self.all_gather(join_root(payload, for_root), what=what, step=step)
        payloads: list[bytes] = []
        roots: dict[int, bytes] = {}
        for rank, message in enumerate(framed):
            try:
                payload_, part = split_root(message)
            except ValueError as exc:  # the same on every rank: each splits every message
                raise CoordinationError(f"{what}: rank {rank} sent a malformed message ({exc})",
                                        step=step, rank=self.rank, ranks=(rank,)) from exc
            payloads.append(payload_)
            if part and self.rank == 0:
                roots[rank] = part
        return payloads, roots

    def close(self) -> None:
        """Destroy the gloo group this coordinator made (not one passed in); later exchanges
        raise. Safe to call twice; never raises."""
        group, self.group = self.group, None
        if self._broken is None:
            self._broken = "the coordinator was closed"
        if self._made_group and group is not None:
            destroy_group(self._dist, group)

    def _gather(self, payload: bytes, seq: int) -> list[bytes]:
        if self._store is not None:
            self._store.set(self._key(self.rank), str(seq))
        return gather_bytes(self._dist, self.group, payload, self.world_size)

    def _key(self, rank: int) -> str:
        """One key per rank in the job's store: the number of its latest exchange."""
        return f"{self._keys}/{rank}"

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


def default_store(dist: Any) -> Any:
    """The job's c10d store (a TCPStore served by rank 0 under env://), None without one."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:
        return None


def gather_bytes(dist: Any, group: Any, payload: bytes, size: int) -> list[bytes]:
    """Every member's ``payload`` on a gloo ``group`` of ``size`` members, by group rank: an
    all-gather of the lengths, then one of the payloads padded to the longest."""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    mine = torch.zeros(max(*sizes, 1), dtype=torch.uint8)
    if payload:
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    return [bytes(byte_view(g, 0, n)) if n else b"" for g, n in zip(gathered, sizes, strict=True)]


def close_coordinator(coordinator: Coordinator) -> None:
    """Release what ``coordinator`` holds (its gloo groups), when it has a ``close()``; a
    failure to is logged, never raised (it runs while a pipeline closes)."""
    close = getattr(coordinator, "close", None)
    if not callable(close):
        return
    try:
        close()
    except Exception as exc:
        log.warning("ckpt.control.close_failed", rank=getattr(coordinator, "rank", None),
                    error=f"{type(exc).__name__}: {exc}")


def destroy_group(dist: Any, group: Any) -> None:
    """Destroy one gloo group of this process (its connections close; the C++ worker threads
    are joined once the last reference to it goes, which the caller drops)."""
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    try:
        dist.destroy_process_group(group)
    except Exception as exc:  # already destroyed, or torch.distributed torn down first
        log.debug("ckpt.control.group_gone", error=f"{type(exc).__name__}: {exc}")
