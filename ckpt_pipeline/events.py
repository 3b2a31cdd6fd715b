"""Typed events that every stage emits, for subscribers and for the log.

Each event is a frozen dataclass named for what happened. ``log_name`` is the event name of
its log line (stdlib logger ``ckpt_pipeline``) and ``log_level`` its level: the per-stage
lines at DEBUG, a commit, a restore and a start-up scrub at INFO, problems at WARNING or ERROR.
The fields become the line's key-value pairs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

__all__ = (
    "CheckpointCommitted",
    "CheckpointPruned",
    "CheckpointRejected",
    "CheckpointRestored",
    "CheckpointRewound",
    "Event",
    "ForeignFilesSetAside",
    "PersistFailed",
    "PersistPruned",
    "PersistSkipped",
    "PersistentAvailable",
    "PersistentTakenOver",
    "PersistentUnavailable",
    "ReplicaRestoreFailed",
    "ReplicaRestored",
    "ReplicaStored",
    "ReplicationDegraded",
    "RetentionFailed",
    "SaveFailed",
    "SaveRequested",
    "SaveSkipped",
    "ShardDownloaded",
    "ShardFetched",
    "ShardReplicated",
    "ShardSerialized",
    "ShardUploaded",
    "ShardWritten",
    "SnapshotTaken",
    "StepPersisted",
    "TemporariesScrubbed",
)


@dataclass(frozen=True, slots=True)
class Event:
    """Base of all pipeline events."""

    log_name: ClassVar[str] = "ckpt.event"
    log_level: ClassVar[str] = "debug"

    step: int
    rank: int

    def fields(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SaveRequested(Event):
    """``save()`` accepted a request; its tensors are being copied."""

    log_name: ClassVar[str] = "ckpt.save.requested"
    save_id: str
    tensors: int
    bytes: int
    blocking_seconds: float


@dataclass(frozen=True, slots=True)
class SaveSkipped(Event):
    """A save was dropped because every host buffer was busy and the policy is ``skip``."""

    log_name: ClassVar[str] = "ckpt.save.skipped"
    log_level: ClassVar[str] = "warning"
    reason: str


@dataclass(frozen=True, slots=True)
class SnapshotTaken(Event):
    """Every tensor of the save is in host memory."""

    log_name: ClassVar[str] = "ckpt.snapshot.done"
    save_id: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ShardSerialized(Event):
    """Checksums computed and the shard header encoded."""

    log_name: ClassVar[str] = "ckpt.serialize.done"
    save_id: str
    bytes: int
    header_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ShardWritten(Event):
    """The shard and manifest of this rank are durable under their final names."""

    log_name: ClassVar[str] = "ckpt.write.done"
    save_id: str
    path: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class CheckpointCommitted(Event):
    """The commit record is durable: the step is complete and restorable."""

    log_name: ClassVar[str] = "ckpt.commit.done"
    log_level: ClassVar[str] = "info"
    save_id: str
    path: str
    bytes: int
    seconds: float
    """From ``save()`` to the commit record fsynced (time to durable)."""


@dataclass(frozen=True, slots=True)
class CheckpointPruned(Event):
    """An older committed step was removed by retention."""

    log_name: ClassVar[str] = "ckpt.retain.pruned"
    path: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class RetentionFailed(Event):
    """Retention could not remove an older step (it stays on disk; the save is committed).

    ``step`` is the step that could not be pruned, ``committed_step`` the save whose
    retention ran. ``ckpt-pipeline ls`` marks the step until a later prune removes it.
    """

    log_name: ClassVar[str] = "ckpt.retain.failed"
    log_level: ClassVar[str] = "warning"
    committed_step: int
    path: str
    error: str


@dataclass(frozen=True, slots=True)
class SaveFailed(Event):
    """A save failed; nothing of it was committed and the previous checkpoint is intact."""

    log_name: ClassVar[str] = "ckpt.save.failed"
    log_level: ClassVar[str] = "error"
    save_id: str
    stage: str
    error: str


@dataclass(frozen=True, slots=True)
class TemporariesScrubbed(Event):
    """Start-up removed what crashed saves left behind (never a committed step)."""

    log_name: ClassVar[str] = "ckpt.recovery.scrubbed"
    log_level: ClassVar[str] = "info"
    path: str
    bytes: int


@dataclass(frozen=True, slots=True)
class CheckpointRejected(Event):
    """A step failed validation during recovery and was not loaded."""

    log_name: ClassVar[str] = "ckpt.recovery.rejected"
    log_level: ClassVar[str] = "error"
    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class CheckpointRestored(Event):
    """A step was loaded into the live state."""

    log_name: ClassVar[str] = "ckpt.recovery.restored"
    log_level: ClassVar[str] = "info"
    save_id: str
    path: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class CheckpointRewound(Event):
    """A restore went back behind newer steps of the current timeline (``step`` is the one
    restored): the rewind is recorded in this rank's root (``path``), and ``abandoned`` will
    never be restored."""

    log_name: ClassVar[str] = "ckpt.recovery.rewound"
    log_level: ClassVar[str] = "info"
    save_id: str
    timeline: int
    abandoned: tuple[int, ...]
    path: str


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


@dataclass(frozen=True, slots=True)
class ShardUploaded(Event):
    """This rank's files of a committed step are in the persistent tier, each object checked
    after upload; the step is complete there only once ``StepPersisted`` follows."""

    log_name: ClassVar[str] = "ckpt.persist.uploaded"
    log_level: ClassVar[str] = "info"
    save_id: str
    url: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class StepPersisted(Event):
    """The step's commit object is written (by rank 0, after every rank's files): the step is
    complete in the persistent tier. ``seconds``: from the step's commit to this."""

    log_name: ClassVar[str] = "ckpt.persist.committed"
    log_level: ClassVar[str] = "info"
    save_id: str
    url: str
    seconds: float


@dataclass(frozen=True, slots=True)
class PersistSkipped(Event):
    """A promotion that was due was not made: earlier ones are still uploading (``reason``
    names the rank), or the step was gone from the local tier."""

    log_name: ClassVar[str] = "ckpt.persist.skipped"
    log_level: ClassVar[str] = "warning"
    reason: str


@dataclass(frozen=True, slots=True)
class PersistFailed(Event):
    """A promotion failed after its retries (every rank emits it, naming the ranks and their
    errors); the step stays in the local tier, the persistent tier keeps its older steps."""

    log_name: ClassVar[str] = "ckpt.persist.failed"
    log_level: ClassVar[str] = "warning"
    save_id: str
    url: str
    error: str


@dataclass(frozen=True, slots=True)
class PersistPruned(Event):
    """Rank 0 removed a step from the persistent tier (``persistent_keep``), its commit
    object first, or the leftovers of a promotion that never completed."""

    log_name: ClassVar[str] = "ckpt.persist.pruned"
    log_level: ClassVar[str] = "info"
    url: str
    complete: bool


@dataclass(frozen=True, slots=True)
class PersistentTakenOver(Event):
    """Rank 0 took the persistent URL over from another job's open (``holder``: its run id,
    ``host``, ``pid``, ``root``): its heartbeat was older than its lease or stopped while
    watched (``heartbeat_age_s`` by this host's clock), or ``persistent_takeover`` was set
    (``forced``). Uploads of that job still in flight are never committed as this run's."""

    log_name: ClassVar[str] = "ckpt.persist.taken_over"
    log_level: ClassVar[str] = "warning"
    url: str
    holder: str
    host: str
    pid: int
    root: str
    heartbeat_age_s: float
    forced: bool


@dataclass(frozen=True, slots=True)
class PersistentUnavailable(Event):
    """This rank could not reach the persistent tier (``step`` is -1): at open, the store was
    down, hung or black-holed, and the pipeline opened from the local tier; promotions are
    skipped (``PersistSkipped``) until every rank reaches it. ``retrying``: it is tried again
    in the background with backoff (False after a configuration or permission error)."""

    log_name: ClassVar[str] = "ckpt.persist.unavailable"
    log_level: ClassVar[str] = "warning"
    url: str
    error: str
    retrying: bool


@dataclass(frozen=True, slots=True)
class PersistentAvailable(Event):
    """This rank reached the persistent tier after ``PersistentUnavailable`` (``step`` is -1;
    ``seconds``: since the pipeline began to open it); promotions resume once every rank has
    (decided at the next save's commit vote)."""

    log_name: ClassVar[str] = "ckpt.persist.available"
    log_level: ClassVar[str] = "info"
    url: str
    seconds: float


@dataclass(frozen=True, slots=True)
class ShardDownloaded(Event):
    """At restore, this rank's shard came from the persistent tier, every part checked, and
    was written to this rank's root while the restore read it. ``seconds``: from the start
    of the download until the files were published (after the restore read them)."""

    log_name: ClassVar[str] = "ckpt.recovery.downloaded"
    log_level: ClassVar[str] = "info"
    save_id: str
    url: str
    path: str
    bytes: int
    seconds: float
