"""Boxes: the region of a full tensor that one shard holds.

A saved DTensor shard records its mesh's shape, its placements (``"S<dim>"`` or ``"R"`` per
mesh dimension) and the full tensor's shape (``DistLayout``). Its box follows from the rank's
coordinate on the mesh, the mesh being the ranks in order, laid out row-major (as
``init_device_mesh`` builds it), and from how DTensor splits a dimension: like ``torch.chunk``
(pieces of ``ceil(size / n)``, the last ones shorter or empty), each mesh dimension that shards
a tensor dimension splitting the piece the mesh dimensions before it left (several mesh
dimensions may shard one tensor dimension).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .._format.header import DistLayout

__all__ = ("Box", "mesh_coordinate", "saved_box")


@dataclass(frozen=True, slots=True)
class Box:
    """``offsets[d] <= i < offsets[d] + sizes[d]`` for every dimension ``d``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        """The common region, None when it is empty."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        ends = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(e <= s for s, e in zip(starts, ends)):
            return None
        return Box(starts, tuple(e - s for s, e in zip(starts, ends)))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which contains it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets)), self.sizes)

    def index(self) -> tuple[slice, ...]:
        """The slices that select this box from a tensor of its coordinates."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def mesh_coordinate(rank: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Rank ``rank``'s coordinate on a row-major mesh of the ranks in order."""
    coords: list[int] = []
    for size in reversed(mesh_shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def saved_box(layout: DistLayout, rank: int) -> Box:
    """Where rank ``rank``'s local shard of a DTensor of ``layout`` lies in the full tensor
    (the module docstring says how)."""
    coords = mesh_coordinate(rank, layout.mesh_shape)
    offsets = [0] * len(layout.global_shape)
    sizes = list(layout.global_shape)
    for mesh_dim, placement in enumerate(layout.placements):
        if placement == "R":
            continue
        dim = int(placement[1:])
        pieces = layout.mesh_shape[mesh_dim]
        chunk = -(-sizes[dim] // pieces)
        start = min(sizes[dim], coords[mesh_dim] * chunk)
        end = min(sizes[dim], start + chunk)
        offsets[dim] += start
        sizes[dim] = end - start
    return Box(tuple(offsets), tuple(sizes))
