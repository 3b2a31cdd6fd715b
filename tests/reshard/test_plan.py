"""The reshard planner (``ckpt_pipeline._reshard``): where each saved shard lies, and which
pieces fill a needed box, each element exactly once.

The boxes are checked against DTensor's own arithmetic (its private helper that computes a
shard's local shape and global offset from a mesh coordinate), and the plans by rebuilding
tensors out of the saved shards of a known full tensor, for random shapes, meshes, placements
and needed boxes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_pipeline._format.header import DistLayout, contiguous_stride
from ckpt_pipeline._reshard.boxes import Box, mesh_coordinate, saved_box
from ckpt_pipeline._reshard.plan import ReshardError, SavedBoxes, plan_box

pytestmark = pytest.mark.timeout(120)


@st.composite
def layouts(draw: st.DrawFn) -> DistLayout:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    placements = tuple(draw(st.sampled_from(["R", *(f"S{d}" for d in range(len(shape)))]))
                       for _ in mesh)
    return DistLayout(mesh, placements, shape, contiguous_stride(shape))


def _placements(layout: DistLayout) -> list[object]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in layout.placements]


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)


def _saved(layout: DistLayout) -> tuple[SavedBoxes, list[torch.Tensor]]:
    """Every rank's box of ``layout``, and each rank's shard of a known full tensor."""
    world = math.prod(layout.mesh_shape)
    boxes = [saved_box(layout, rank) for rank in range(world)]
    full = _full(layout.global_shape)
    return (SavedBoxes("t", layout.global_shape, enumerate(boxes)),
            [full[box.index()].clone() for box in boxes])


def _fill(saved: SavedBoxes, parts: list[torch.Tensor], need: Box,
          reader: int = 0) -> torch.Tensor:
    out = torch.full(need.sizes, -1, dtype=torch.int64)
    for piece in plan_box(saved, need, reader=reader):
        out[piece.region.relative_to(need).index()] = parts[piece.source][
            piece.region.relative_to(piece.saved).index()]
    return out


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_saved_boxes_are_where_dtensor_puts_each_shard(layout: DistLayout) -> None:
    from torch.distributed.tensor import _utils

    compute = getattr(_utils, "_compute_local_shape_and_global_offset", None)
    if compute is None:
        pytest.skip("this torch has no _compute_local_shape_and_global_offset")
    for rank in range(math.prod(layout.mesh_shape)):
        coordinate = list(mesh_coordinate(rank, layout.mesh_shape))
        shape, offset = compute(layout.global_shape, layout.mesh_shape, coordinate,
                                _placements(layout))
        box = saved_box(layout, rank)
        assert box.sizes == tuple(shape), (rank, layout)
        if box.volume:  # DTensor's offset of an empty shard is the dimension's end
            assert box.offsets == tuple(offset), (rank, layout)


@settings(max_examples=100, deadline=None)
@given(layouts(), st.data())
def test_any_needed_box_is_filled_exactly_from_the_saved_shards(
        layout: DistLayout, data: st.DataObject) -> None:
    saved, parts = _saved(layout)
    starts = [data.draw(st.integers(0, n)) for n in layout.global_shape]
    need = Box(tuple(starts), tuple(data.draw(st.integers(0, n - s))
                                    for s, n in zip(starts, layout.global_shape)))
    reader = data.draw(st.integers(0, 7))
    assert torch.equal(_fill(saved, parts, need, reader), _full(layout.global_shape)[need.index()])


@settings(max_examples=60, deadline=None)
@given(layouts(), layouts())
def test_a_layout_reshards_into_another_of_the_same_tensor(save: DistLayout,
                                                           load: DistLayout) -> None:
    """Saved on one mesh, read on another: every reader rank's box filled exactly."""
    load = DistLayout(load.mesh_shape, tuple(p if p == "R" or int(p[1:]) < len(save.global_shape)
                                             else "R" for p in load.placements),
                      save.global_shape, save.global_stride)
    saved, parts = _saved(save)
    full = _full(save.global_shape)
    for reader in range(math.prod(load.mesh_shape)):
        need = saved_box(load, reader)
        assert torch.equal(_fill(saved, parts, need, reader), full[need.index()])


def test_a_replicated_box_is_read_from_one_holder_spread_over_the_readers() -> None:
    layout = DistLayout((2, 2), ("R", "S0"), (8, 4), (4, 1))  # HSDP: mesh dim 0 replicates
    saved = SavedBoxes("w", layout.global_shape,
                       ((rank, saved_box(layout, rank)) for rank in range(4)))
    assert saved.holders[Box((0, 0), (4, 4))] == (0, 2)
    full = Box.full((8, 4))
    sources = [sorted(p.source for p in plan_box(saved, full, reader=r)) for r in range(2)]
    assert sources == [[0, 1], [2, 3]]  # each element once; reader 1 reads the other copy


def test_a_gap_in_the_saved_boxes_is_refused_naming_the_tensor() -> None:
    saved = SavedBoxes("layer.w", (8,), [(0, Box((0,), (4,))), (1, Box((5,), (3,)))])
    with pytest.raises(ReshardError, match=r"layer.w: the saved boxes cover 7 of the 8"):
        plan_box(saved, Box.full((8,)))
    assert len(plan_box(saved, Box((5,), (3,)))) == 1  # what is there is still plannable


def test_saved_boxes_that_overlap_without_being_equal_are_refused() -> None:
    saved = SavedBoxes("w", (8,), [(0, Box((0,), (5,))), (1, Box((4,), (4,)))])
    with pytest.raises(ReshardError, match=r"overlap without being the same box"):
        plan_box(saved, Box.full((8,)))


def test_a_box_outside_the_tensor_is_refused() -> None:
    with pytest.raises(ReshardError, match=r"rank 1's box \[6:10\] does not fit"):
        SavedBoxes("w", (8,), [(0, Box((0,), (6,))), (1, Box((6,), (4,)))])


def test_planning_meets_only_the_boxes_a_needed_box_overlaps() -> None:
    """Many saved boxes (a 1-D shard over 4096 ranks): a small needed box meets only the
    few it overlaps, found by the binary search, not by comparing with every box."""
    layout = DistLayout((4096,), ("S0",), (65536, 8), (8, 1))
    saved = SavedBoxes("w", layout.global_shape,
                       ((rank, saved_box(layout, rank)) for rank in range(4096)))
    need = Box((100, 0), (40, 8))  # rows 100-139: the boxes of ranks 6 to 8
    assert [p.source for p in plan_box(saved, need)] == [6, 7, 8]
    assert [b.offsets[0] for b in saved.meeting(need)] == [96, 112, 128]
