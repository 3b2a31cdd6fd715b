"""Which byte ranges a box of a saved tensor is read in.

A box of a tensor laid out with strides is, in the file, a set of contiguous runs (rows of its
innermost dimensions) with gaps between them. Reading each run alone costs a call per run,
millions for a column slice of a tall matrix; reading from the first needed byte to the last
in one range reads the gaps too. ``spans`` cuts the box into sub-boxes each read as one range:

- a gap is read through when it is shorter than ``gap`` bytes (the checksum block: a gap
  shorter than a block holds no whole block, so skipping it would save no block read, only
  copies);
- a range is at most ``bound`` bytes (the bytes in flight), unless one element is larger;
- sub-boxes come in file order, so that a reader's cache of verified blocks serves the
  neighbours.

The gaps that are read through lie inside blocks the runs touch anyway, so the blocks read
for a box are the blocks its runs touch, each once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .boxes import Box

__all__ = ("span_bytes", "spans")


def span_bytes(box: Box, stride: Sequence[int], item: int) -> int:
    """Bytes from the box's first element to the end of its last (0 for an empty box)."""
    if box.volume == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(box.sizes, stride)) + 1) * item


def _dense(box: Box, stride: Sequence[int], item: int, gap: int) -> bool:
    """Whether every gap between the box's runs is shorter than ``gap`` bytes."""
    inner = item
    for d in sorted((d for d, n in enumerate(box.sizes) if n > 1), key=lambda d: stride[d]):
        if stride[d] * item - inner >= gap:
            return False
        inner += (box.sizes[d] - 1) * stride[d] * item
    return True


def _narrowed(box: Box, dim: int, start: int, size: int) -> Box:
    offsets, sizes = list(box.offsets), list(box.sizes)
    offsets[dim] += start
    sizes[dim] = size
    return Box(tuple(offsets), tuple(sizes))


def spans(box: Box, stride: Sequence[int], item: int, *, gap: int, bound: int
          ) -> Iterator[Box]:
    """Sub-boxes of ``box`` (coordinates of the saved tensor) that together are the box, each
    to be read as the one byte range from its first element to its last (module docstring)."""
    if box.volume == 0:
        return
    if span_bytes(box, stride, item) <= bound and _dense(box, stride, item, gap):
        yield box
        return
    dims = [d for d, n in enumerate(box.sizes) if n > 1]
    if not dims:
        yield box
        return
    outer = max(dims, key=lambda d: stride[d])
    one = _narrowed(box, outer, 0, 1)
    one_span = span_bytes(one, stride, item)
    step = stride[outer] * item
    if one_span <= bound and _dense(one, stride, item, gap) and step - one_span < gap:
        per = max(1, (bound - one_span) // step + 1) if step else box.sizes[outer]
        for i in range(0, box.sizes[outer], per):
            yield _narrowed(box, outer, i, min(per, box.sizes[outer] - i))
        return
    for i in range(box.sizes[outer]):
        yield from spans(_narrowed(box, outer, i, 1), stride, item, gap=gap, bound=bound)
