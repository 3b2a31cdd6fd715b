"""How a box of a saved tensor is cut into the byte ranges it is read in (``_reshard.runs``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_pipeline._reshard.boxes import Box
from ckpt_pipeline._reshard.runs import span_bytes, spans

pytestmark = pytest.mark.timeout(60)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _elements(box: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + s) for o, s in zip(box.offsets, box.sizes))))


@st.composite
def _cases(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], Box, int, int, int]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    stride = _contiguous(shape)
    if draw(st.booleans()):  # a transposed or permuted view, as a saved view may be
        order = draw(st.permutations(range(ndim)))
        shape, stride = tuple(shape[d] for d in order), tuple(stride[d] for d in order)
    offsets, sizes = [], []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        offsets.append(lo)
        sizes.append(draw(st.integers(0, n - lo)))
    item = draw(st.sampled_from([1, 2, 4, 8]))
    gap = draw(st.sampled_from([4, 8, 16, 64, 4096]))
    bound = draw(st.sampled_from([1, 8, 24, 64, 1 << 20]))
    return shape, stride, Box(tuple(offsets), tuple(sizes)), item, gap, bound


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_spans_cover_the_box_once_in_file_order_within_the_bound(
        case: tuple[tuple[int, ...], tuple[int, ...], Box, int, int, int]) -> None:
    _shape, stride, box, item, gap, bound = case
    parts = list(spans(box, stride, item, gap=gap, bound=bound))
    seen: list[tuple[int, ...]] = [e for part in parts for e in _elements(part)]
    assert len(seen) == len(set(seen)) and set(seen) == _elements(box)
    for part in parts:
        assert span_bytes(part, stride, item) <= bound or part.volume == 1
    firsts = [sum(o * s for o, s in zip(p.offsets, stride)) for p in parts]
    assert firsts == sorted(firsts)


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_spans_touch_only_the_blocks_the_elements_touch(
        case: tuple[tuple[int, ...], tuple[int, ...], Box, int, int, int]) -> None:
    """Gaps read through hold no whole block: reading the spans reads no block that reading
    each element alone would not."""
    _shape, stride, box, item, gap, bound = case
    needed = set()
    for e in _elements(box):
        at = sum(i * s for i, s in zip(e, stride)) * item
        needed.update(range(at // gap, (at + item - 1) // gap + 1))
    touched = set()
    for part in spans(box, stride, item, gap=gap, bound=bound):
        first = sum(o * s for o, s in zip(part.offsets, stride)) * item
        touched.update(range(first // gap, (first + span_bytes(part, stride, item) - 1)
                             // gap + 1))
    assert touched == needed


def test_a_column_slice_of_a_tall_matrix_is_read_in_few_ranges() -> None:
    """Rows of 4 KiB, half of each needed, blocks of 64 KiB: the gaps are read through, in
    ranges of at most the bound, not one call per row."""
    stride = (1024, 1)  # a 10000 x 1024 matrix
    box = Box((0, 512), (10_000, 512))
    parts = list(spans(box, stride, 4, gap=65536, bound=4 << 20))
    assert len(parts) == 10
    assert all(span_bytes(p, stride, 4) <= 4 << 20 for p in parts)


def test_rows_farther_apart_than_a_block_are_read_one_range_each() -> None:
    stride = (1 << 20, 1)  # 8 rows of 1 Mi elements
    box = Box((0, 0), (8, 1000))
    parts = list(spans(box, stride, 4, gap=1 << 20, bound=64 << 20))
    assert [p.offsets[0] for p in parts] == list(range(8))
    assert all(p.sizes == (1, 1000) for p in parts)
