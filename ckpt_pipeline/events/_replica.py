"""The events of the replica tier: copies of each shard on other nodes (``replicas``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._base import Event

__all__ = (
    "ForeignFilesSetAside",
    "ReplicaRestoreFailed",
    "ReplicaRestored",
    "ReplicaStored",
    "ReplicationDegraded",
    "ShardFetched",
    "ShardReplicated",
)


@dataclass(frozen=True, slots=True)
class ShardReplicated(Event):
    """A copy of this rank's shard is durable on ``peer`` (sender side, before the vote)."""

    log_name: ClassVar[str] = "ckpt.replicate.sent"
    save_id: str
    peer: int
    node: str
    bytes: int
    seconds: float
    """From the first byte sent to the peer's acknowledgement (data, header and manifest
    verified and fsynced there)."""


@dataclass(frozen=True, slots=True)
class ReplicaStored(Event):
    """This rank (the holder) published a verified copy of rank ``source``'s shard.

    Emitted from the copy server's thread once shard and manifest are durable; the copy's
    commit record follows when the step commits, else the copy is removed.
    """

    log_name: ClassVar[str] = "ckpt.replicate.stored"
    save_id: str
    source: int
    path: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ReplicationDegraded(Event):
    """The step committed, but without some of its copies (every rank emits the same list).

    ``missing`` holds (source rank, holder rank) of each copy that is not durable, ``reasons``
    why, in the same order (a timeout or a lost connection names the peer).
    """

    log_name: ClassVar[str] = "ckpt.replicate.degraded"
    log_level: ClassVar[str] = "warning"
    save_id: str
    missing: tuple[tuple[int, int], ...]
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ShardFetched(Event):
    """At restore, this rank's shard came from the copy held by ``peer``, verified and written
    back to this rank's root (so the copy count is whole again)."""

    log_name: ClassVar[str] = "ckpt.recovery.fetched"
    log_level: ClassVar[str] = "info"
    save_id: str
    peer: int
    path: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ForeignFilesSetAside(Event):
    """At restore, this rank's files of the step are of another save than the one the ranks
    agreed on (``save_id``): another run's root came back. They were moved to ``path``
    (kept, never loaded) and the rank's shard comes from a copy or the persistent tier."""

    log_name: ClassVar[str] = "ckpt.recovery.foreign_files"
    log_level: ClassVar[str] = "warning"
    save_id: str
    foreign_save_ids: tuple[str, ...]
    path: str
    files: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReplicaRestored(Event):
    """After a restore, a copy of this rank's shard of the restored step that ``holder``
    lacked (a replaced node) was sent again, verified, published and committed there: the
    step has its copies again. Sender side, from the re-send's thread."""

    log_name: ClassVar[str] = "ckpt.replicate.restored"
    log_level: ClassVar[str] = "info"
    save_id: str
    holder: int
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ReplicaRestoreFailed(Event):
    """After a restore, sending a missing copy of this rank's shard to ``holder`` again
    failed (``error`` names the peer and why); the step stays restorable from the rank's own
    shard, with one copy fewer until the next save."""

    log_name: ClassVar[str] = "ckpt.replicate.restore_failed"
    log_level: ClassVar[str] = "warning"
    save_id: str
    holder: int
    error: str

