"""The base of every pipeline event."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

__all__ = ("Event",)


@dataclass(frozen=True, slots=True)
class Event:
    """Base of all pipeline events."""

    log_name: ClassVar[str] = "ckpt.event"
    log_level: ClassVar[str] = "debug"

    step: int
    rank: int

    def fields(self) -> dict[str, Any]:
        return asdict(self)
