"""A save on its way through the stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._snapshot import Slot, Snapshot
from .handle import SaveHandle

__all__ = ("SaveJob",)


@dataclass(slots=True)
class SaveJob:
    """Everything the stages need for one save; each stage fills in its part."""

    step: int
    rank: int
    world_size: int
    save_id: str
    handle: SaveHandle
    slot: Slot
    snapshot: Snapshot
    paths: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    devices: tuple[str, ...]
    offsets: list[int]
    sizes: tuple[int, ...]
    data_length: int
    tree: bytes
    train_state: dict[str, Any]
    requested_at: float
    # filled by serialize
    header: bytes = b""
    checksums: list[tuple[int, ...]] = field(default_factory=list)
    # filled by write
    dir_name: str = ""
    temp_names: list[str] = field(default_factory=list)
    published: list[str] = field(default_factory=list)
    shard_size: int = 0
    committed: bool = False

    @property
    def data_bytes(self) -> int:
        return sum(self.sizes)
