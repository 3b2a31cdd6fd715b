"""Typed events that every stage emits, for subscribers and for the log.

Each event is a frozen dataclass named for what happened. ``log_name`` is the event name of
its log line (stdlib logger ``ckpt_pipeline``) and ``log_level`` its level: the per-stage
lines at DEBUG, a commit, a restore and a start-up scrub at INFO, problems at WARNING or ERROR.
The fields become the line's key-value pairs.
"""

from __future__ import annotations

import warnings

from ._base import Event as Event
from ._memory import MemoryCommitted as MemoryCommitted
from ._memory import MemoryPruned as MemoryPruned
from ._memory import WriteThroughSkipped as WriteThroughSkipped
from ._persistent import PersistentAvailable as PersistentAvailable
from ._persistent import PersistentTakenOver as PersistentTakenOver
from ._persistent import PersistentUnavailable as PersistentUnavailable
from ._persistent import PersistFailed as PersistFailed
from ._persistent import PersistPruned as PersistPruned
from ._persistent import PersistSkipped as PersistSkipped
from ._persistent import ShardDownloaded as ShardDownloaded
from ._persistent import ShardUploaded as ShardUploaded
from ._persistent import StepPersisted as StepPersisted
from ._replica import ForeignFilesSetAside as ForeignFilesSetAside
from ._replica import ReplicaRestored as ReplicaRestored
from ._replica import ReplicaRestoreFailed as ReplicaRestoreFailed
from ._replica import ReplicaStored as ReplicaStored
from ._replica import ReplicationDegraded as ReplicationDegraded
from ._replica import ShardFetched as ShardFetched
from ._replica import ShardReplicated as ShardReplicated
from ._restore import CheckpointRejected as CheckpointRejected
from ._restore import CheckpointRestored as CheckpointRestored
from ._restore import CheckpointRewound as CheckpointRewound
from ._restore import TemporariesScrubbed as TemporariesScrubbed
from ._save import CheckpointCommitted as CheckpointCommitted
from ._save import CheckpointPruned as CheckpointPruned
from ._save import FailedAt as FailedAt
from ._save import RetentionFailed as RetentionFailed
from ._save import SaveFailed as SaveFailed
from ._save import SaveRequested as SaveRequested
from ._save import SaveSkipped as SaveSkipped
from ._save import SaveStage as SaveStage
from ._save import ShardDataWritten as ShardDataWritten
from ._save import ShardSealed as ShardSealed
from ._save import SnapshotTaken as SnapshotTaken

__all__ = (
    "CheckpointCommitted",
    "CheckpointPruned",
    "CheckpointRejected",
    "CheckpointRestored",
    "CheckpointRewound",
    "Event",
    "FailedAt",
    "ForeignFilesSetAside",
    "MemoryCommitted",
    "MemoryPruned",
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
    "SaveStage",
    "ShardDataWritten",
    "ShardDownloaded",
    "ShardFetched",
    "ShardReplicated",
    "ShardSealed",
    "ShardUploaded",
    "SnapshotTaken",
    "StepPersisted",
    "TemporariesScrubbed",
    "WriteThroughSkipped",
)

RENAMED = {"ShardSerialized": "ShardDataWritten", "ShardWritten": "ShardSealed"}
"""Old event names, kept importable: {old: new}. The stage they report is called write_data
and seal everywhere else (functions, crash labels, log names)."""


def __getattr__(name: str) -> type[Event]:
    """An old event name: warn, and hand back the renamed class (``isinstance`` still holds)."""
    new = RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"ckpt_pipeline.events.{name} was renamed {new} (the stage's one name); the old "
                  "name will be removed", DeprecationWarning, stacklevel=2)
    event: type[Event] = globals()[new]
    return event
