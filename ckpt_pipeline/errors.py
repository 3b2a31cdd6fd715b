"""Every error the library raises, derived from one base.

Each error says what happened, to which step, rank and path, and what the user can do. The
fields are kept on the instance so that callers and event subscribers can act on them without
parsing the message.
"""

from __future__ import annotations

from pathlib import Path

__all__ = (
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointWarning",
    "ConfigError",
    "CoordinationError",
    "ForkedProcessError",
    "PersistentInUseError",
    "PipelineBusyError",
    "PipelineClosedError",
    "PoolBusyError",
    "RestoreError",
    "RootInUseError",
    "SaveError",
    "SnapshotTornError",
    "StateError",
    "StepOrderError",
    "StorageError",
    "UnsafeRootError",
)


class CheckpointError(Exception):
    """Base of every error raised by ckpt_pipeline."""

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        rank: int | None = None,
        path: str | Path | None = None,
        hint: str | None = None,
    ) -> None:
        self.step = step
        self.rank = rank
        self.path = None if path is None else str(path)
        self.hint = hint
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        # Built when shown, so that step or rank filled in later by the pipeline appear too.
        where = [
            f"{name}={value}"
            for name, value in (("step", self.step), ("rank", self.rank), ("path", self.path))
            if value is not None
        ]
        text = self.message
        if where:
            text += f" [{', '.join(where)}]"
        if self.hint:
            text += f". {self.hint}"
        return text


class ConfigError(CheckpointError):
    """A configuration value is invalid."""


class StateError(CheckpointError):
    """The state given to save() or restore cannot be handled (leaf type, structure, shape)."""


class StepOrderError(CheckpointError):
    """A save was requested for a step not greater than the last saved one."""


class UnsafeRootError(CheckpointError):
    """The checkpoint root is a symlink, owned by another user, or not writable."""


class PipelineClosedError(CheckpointError):
    """The pipeline was used after close()."""


class PoolBusyError(CheckpointError):
    """Every host buffer was busy and the policy did not allow waiting."""


class PipelineBusyError(CheckpointError):
    """The pipeline is doing something that this call must not overlap (a restore)."""


class ForkedProcessError(CheckpointError):
    """The pipeline was used from a process other than the one that opened it (a fork)."""


class RootInUseError(CheckpointError):
    """Another live process holds this rank's lock on the checkpoint root."""


class PersistentInUseError(CheckpointError):
    """Another live job holds the persistent URL: its owner object's heartbeat advances."""


class SnapshotTornError(CheckpointError):
    """A tensor was mutated in place while its snapshot copy could still be running."""


class SaveError(CheckpointError):
    """A save failed in the pipeline (write_data, seal or commit); nothing was committed.

    ``ranks``: the ranks that failed, when the failure was another rank's.
    """

    def __init__(self, message: str, *, step: int | None = None, rank: int | None = None,
                 path: str | Path | None = None, hint: str | None = None,
                 ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message, step=step, rank=rank, path=path, hint=hint)
        self.ranks = tuple(ranks)


class CoordinationError(CheckpointError):
    """The ranks could not agree in time: a rank died, hung, or the control plane failed.

    ``ranks``: the ranks that did not answer, when known.
    """

    def __init__(self, message: str, *, step: int | None = None, rank: int | None = None,
                 path: str | Path | None = None, hint: str | None = None,
                 ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message, step=step, rank=rank, path=path, hint=hint)
        self.ranks = tuple(ranks)


class StorageError(CheckpointError):
    """An I/O call of the storage layer failed; ``errno`` is the OS error number, if any."""

    def __init__(self, message: str, *, step: int | None = None, rank: int | None = None,
                 path: str | Path | None = None, hint: str | None = None,
                 errno: int | None = None) -> None:
        super().__init__(message, step=step, rank=rank, path=path, hint=hint)
        self.errno = errno


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint on disk is corrupt, truncated, incomplete or not ours."""


class RestoreError(CheckpointError):
    """Restoring failed: no checkpoint could be loaded into the given state."""


class CheckpointWarning(UserWarning):
    """A save failed, or committed without some of its copies, while no logging handler shows
    the library's ERROR line: issued once per such save (filter it as any warning)."""
