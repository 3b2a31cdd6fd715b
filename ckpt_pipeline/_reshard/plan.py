"""Planning a reshard: which saved box each element of a needed box comes from.

``plan_box`` takes the boxes a tensor was saved in (each with the saved ranks that hold it: a
replicated box is held by several) and one box a reader needs, and returns the pieces to copy:
the overlap of the needed box with each saved box it meets, from one holder each. Replicated
sources are read once, the holder picked by the reader's rank (so that readers spread over the
holders). Every element of the needed box must be covered exactly once: a gap, or two saved
boxes that overlap without being the same box, is a ``ReshardError``.

``SavedBoxes`` sorts the distinct saved boxes once, by their start on the dimension with the
most distinct starts, with the running maximum of their ends: a needed box finds the boxes it
may meet by a binary search, then walks back only while a box before can still reach it. So
planning L needed boxes against C saved ones takes O((L + C) log C) for the grids DTensor
makes (plus the pieces found), not L x C.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import RestoreError
from .boxes import Box

__all__ = ("Piece", "ReshardError", "SavedBoxes", "plan_box")


class ReshardError(RestoreError):
    """A saved layout cannot be resharded onto the one needed (a needed box not covered
    exactly once, a shape or a per-rank value that differs)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Copy ``region`` (full-tensor coordinates) from saved rank ``source``'s box ``saved``."""

    source: int
    saved: Box
    region: Box


class SavedBoxes:
    """The distinct boxes one tensor was saved in, each with its holders, sorted for
    ``meeting`` (see the module docstring)."""

    def __init__(self, path: str, shape: Sequence[int],
                 boxes: Iterable[tuple[int, Box]]) -> None:
        self.path = path
        self.shape = tuple(shape)
        holders: dict[Box, list[int]] = {}
        for rank, box in boxes:
            if len(box.offsets) != len(self.shape) or any(
                    o < 0 or s < 0 or o + s > n
                    for o, s, n in zip(box.offsets, box.sizes, self.shape)):
                raise ReshardError(f"{path}: rank {rank}'s box {box} does not fit the tensor "
                                   f"of shape {list(self.shape)}", rank=rank, path=path)
            if box.volume:
                holders.setdefault(box, []).append(rank)
        self.holders = {box: tuple(sorted(ranks)) for box, ranks in holders.items()}
        distinct = list(self.holders)
        self.dim = max(range(len(self.shape)), default=0,
                       key=lambda d: len({b.offsets[d] for b in distinct}))
        if not self.shape:
            self.dim = -1
        distinct.sort(key=lambda b: b.offsets[self.dim] if self.shape else 0)
        self.boxes = distinct
        self.starts = [b.offsets[self.dim] if self.shape else 0 for b in distinct]
        self.reach = list(itertools.accumulate(
            (b.ends[self.dim] if self.shape else 1 for b in distinct), max))

    def meeting(self, need: Box) -> list[Box]:
        """The saved boxes that overlap ``need``."""
        if not self.shape:
            return list(self.boxes)
        lo, hi = need.offsets[self.dim], need.ends[self.dim]
        found: list[Box] = []
        i = bisect_left(self.starts, hi) - 1
        while i >= 0 and self.reach[i] > lo:
            box = self.boxes[i]
            if box.intersect(need) is not None:
                found.append(box)
            i -= 1
        found.reverse()
        return found


def plan_box(saved: SavedBoxes, need: Box, *, reader: int = 0) -> list[Piece]:
    """The pieces that fill ``need`` (see the module docstring), or ReshardError."""
    if need.volume == 0:
        return []
    pieces = []
    for box in saved.meeting(need):
        region = box.intersect(need)
        assert region is not None
        holders = saved.holders[box]
        pieces.append(Piece(holders[reader % len(holders)], box, region))
    covered = sum(p.region.volume for p in pieces)
    overlap = _first_overlap(pieces)
    if overlap is not None:
        a, b = overlap
        raise ReshardError(
            f"{saved.path}: the saved boxes {a.saved} (rank {a.source}) and {b.saved} (rank "
            f"{b.source}) overlap without being the same box; the elements {need} cannot be "
            "read from one place each", path=saved.path,
            hint="the checkpoint's layout is not one DTensor splits tensors into")
    if covered != need.volume:
        raise ReshardError(
            f"{saved.path}: the saved boxes cover {covered} of the {need.volume} elements of "
            f"{need} in the tensor of shape {list(saved.shape)}", path=saved.path,
            hint="a rank's shard of this tensor is missing from the checkpoint")
    return pieces


def _first_overlap(pieces: Sequence[Piece]) -> tuple[Piece, Piece] | None:
    """Two pieces whose regions overlap, if any: a sweep along the first dimension, each
    piece compared with those still open there."""
    if not pieces or not pieces[0].region.sizes:
        return (pieces[0], pieces[1]) if len(pieces) > 1 else None
    order = sorted(pieces, key=lambda p: p.region.offsets[0])
    open_: list[Piece] = []
    for piece in order:
        start = piece.region.offsets[0]
        open_ = [p for p in open_ if p.region.ends[0] > start]
        for other in open_:
            if other.region.intersect(piece.region) is not None:
                return other, piece
        open_.append(piece)
    return None
