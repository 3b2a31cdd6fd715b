"""ckpt_pipeline: asynchronous, crash-safe checkpointing for PyTorch training."""

import warnings

from . import events as _events
from ._pipeline.blocking import CheckpointPipeline as CheckpointPipeline
from ._pipeline.lifecycle import AsyncCheckpointPipeline as AsyncCheckpointPipeline
from .config import BusyPolicy as BusyPolicy
from .config import MemoryConfig as MemoryConfig
from .config import PersistentConfig as PersistentConfig
from .config import PipelineConfig as PipelineConfig
from .config import ReplicationConfig as ReplicationConfig
from .config import SnapshotMode as SnapshotMode
from .coordination import Coordinator as Coordinator
from .coordination import DistributedCoordinator as DistributedCoordinator
from .coordination import HierarchicalCoordinator as HierarchicalCoordinator
from .coordination import LocalCoordinator as LocalCoordinator
from .errors import CheckpointError as CheckpointError
from .errors import CheckpointIntegrityError as CheckpointIntegrityError
from .errors import CheckpointWarning as CheckpointWarning
from .errors import ConfigError as ConfigError
from .errors import CoordinationError as CoordinationError
from .errors import ForkedProcessError as ForkedProcessError
from .errors import PersistentInUseError as PersistentInUseError
from .errors import PipelineBusyError as PipelineBusyError
from .errors import PipelineClosedError as PipelineClosedError
from .errors import PoolBusyError as PoolBusyError
from .errors import RestoreError as RestoreError
from .errors import RootInUseError as RootInUseError
from .errors import SaveError as SaveError
from .errors import SnapshotTornError as SnapshotTornError
from .errors import StateError as StateError
from .errors import StepOrderError as StepOrderError
from .errors import StorageError as StorageError
from .errors import UnsafeRootError as UnsafeRootError
from .events import CheckpointCommitted as CheckpointCommitted
from .events import CheckpointPruned as CheckpointPruned
from .events import CheckpointRejected as CheckpointRejected
from .events import CheckpointRestored as CheckpointRestored
from .events import CheckpointRewound as CheckpointRewound
from .events import Event as Event
from .events import ForeignFilesSetAside as ForeignFilesSetAside
from .events import MemoryCommitted as MemoryCommitted
from .events import MemoryPruned as MemoryPruned
from .events import PersistentAvailable as PersistentAvailable
from .events import PersistentTakenOver as PersistentTakenOver
from .events import PersistentUnavailable as PersistentUnavailable
from .events import PersistFailed as PersistFailed
from .events import PersistPruned as PersistPruned
from .events import PersistSkipped as PersistSkipped
from .events import ReplicaRestored as ReplicaRestored
from .events import ReplicaRestoreFailed as ReplicaRestoreFailed
from .events import ReplicaStored as ReplicaStored
from .events import ReplicationDegraded as ReplicationDegraded
from .events import RetentionFailed as RetentionFailed
from .events import SaveFailed as SaveFailed
from .events import SaveRequested as SaveRequested
from .events import SaveSkipped as SaveSkipped
from .events import ShardDataWritten as ShardDataWritten
from .events import ShardDownloaded as ShardDownloaded
from .events import ShardFetched as ShardFetched
from .events import ShardReplicated as ShardReplicated
from .events import ShardSealed as ShardSealed
from .events import ShardUploaded as ShardUploaded
from .events import SnapshotTaken as SnapshotTaken
from .events import StepPersisted as StepPersisted
from .events import TemporariesScrubbed as TemporariesScrubbed
from .events import WriteThroughSkipped as WriteThroughSkipped
from .handle import CommitInfo as CommitInfo
from .handle import Missing as Missing
from .handle import RejectedStep as RejectedStep
from .handle import Reshard as Reshard
from .handle import RestoreResult as RestoreResult
from .handle import SaveHandle as SaveHandle
from .loading import LoadedCheckpoint as LoadedCheckpoint
from .loading import load as load
from .logs import enable_logging as enable_logging
from .retention import KeepAny as KeepAny
from .retention import KeepBest as KeepBest
from .retention import KeepEvery as KeepEvery
from .retention import KeepLast as KeepLast
from .retention import MetricPolicy as MetricPolicy
from .retention import RetentionPolicy as RetentionPolicy
from .retention import StepInfo as StepInfo
from .storage import LocalStorage as LocalStorage
from .storage import Storage as Storage
from .train_state import RNGState as RNGState
from .train_state import TrainState as TrainState

__version__ = "0.1.0"

__all__ = (
    "AsyncCheckpointPipeline",
    "BusyPolicy",
    "CheckpointCommitted",
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointPipeline",
    "CheckpointPruned",
    "CheckpointRejected",
    "CheckpointRestored",
    "CheckpointRewound",
    "CheckpointWarning",
    "CommitInfo",
    "ConfigError",
    "CoordinationError",
    "Coordinator",
    "DistributedCoordinator",
    "Event",
    "ForeignFilesSetAside",
    "ForkedProcessError",
    "HierarchicalCoordinator",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LoadedCheckpoint",
    "LocalCoordinator",
    "LocalStorage",
    "MemoryCommitted",
    "MemoryConfig",
    "MemoryPruned",
    "MetricPolicy",
    "Missing",
    "PersistFailed",
    "PersistPruned",
    "PersistSkipped",
    "PersistentAvailable",
    "PersistentConfig",
    "PersistentInUseError",
    "PersistentTakenOver",
    "PersistentUnavailable",
    "PipelineBusyError",
    "PipelineClosedError",
    "PipelineConfig",
    "PoolBusyError",
    "RNGState",
    "RejectedStep",
    "ReplicaRestoreFailed",
    "ReplicaRestored",
    "ReplicaStored",
    "ReplicationConfig",
    "ReplicationDegraded",
    "Reshard",
    "RestoreError",
    "RestoreResult",
    "RetentionFailed",
    "RetentionPolicy",
    "RootInUseError",
    "SaveError",
    "SaveFailed",
    "SaveHandle",
    "SaveRequested",
    "SaveSkipped",
    "ShardDataWritten",
    "ShardDownloaded",
    "ShardFetched",
    "ShardReplicated",
    "ShardSealed",
    "ShardUploaded",
    "SnapshotMode",
    "SnapshotTaken",
    "SnapshotTornError",
    "StateError",
    "StepInfo",
    "StepOrderError",
    "StepPersisted",
    "Storage",
    "StorageError",
    "TemporariesScrubbed",
    "TrainState",
    "UnsafeRootError",
    "WriteThroughSkipped",
    "__version__",
    "enable_logging",
    "load",
)


def __getattr__(name: str) -> type[Event]:
    """An old event name (``events.RENAMED``): warn, and hand back the renamed class."""
    new = _events.RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"ckpt_pipeline.{name} was renamed {new} (the stage's one name); the old "
                  "name will be removed", DeprecationWarning, stacklevel=2)
    event: type[Event] = getattr(_events, new)
    return event
