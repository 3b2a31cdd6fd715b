"""The events of start-up and restore from this rank's own root."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._base import Event

__all__ = (
    "CheckpointRejected",
    "CheckpointRestored",
    "CheckpointRewound",
    "TemporariesScrubbed",
)


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

