"""The events of the persistent tier (``persistent``): uploads, promotions, downloads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._base import Event

__all__ = (
    "PersistFailed",
    "PersistPruned",
    "PersistSkipped",
    "PersistentAvailable",
    "PersistentTakenOver",
    "PersistentUnavailable",
    "ShardDownloaded",
    "ShardUploaded",
    "StepPersisted",
)


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
