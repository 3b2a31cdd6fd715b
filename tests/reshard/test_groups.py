"""How a rank's spans are shared out between its reading threads (``group_spans``): as many
groups as asked for, even when every tensor of a shard ends inside the block where the next
begins, no block read by two groups, and every destination byte written once by the pieces a
span is cut into. The block map is a stand-in with the two things ``group_spans`` asks of a
shard (``blocks`` and ``checks``); the reading itself is tested on real files elsewhere."""

from __future__ import annotations

from bisect import bisect_right

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_pipeline._reshard.ranges import Span, group_spans

pytestmark = pytest.mark.timeout(60)


class _BlockMap:
    """A shard's data region [0, size) cut into blocks of ``block`` bytes."""

    def __init__(self, size: int, block: int) -> None:
        self.checks = [(a, min(a + block, size), 0) for a in range(0, size, block)]
        self.starts = [a for a, _, _ in self.checks]

    def blocks(self, start: int, end: int) -> tuple[int, int]:
        return bisect_right(self.starts, start) - 1, bisect_right(self.starts, end - 1) - 1


def _packed(counts: list[int], source: int = 0) -> tuple[list[Span], list[torch.Tensor]]:
    """Float32 tensors of ``counts`` elements laid one after the other in a shard's file,
    each read whole into a contiguous destination."""
    spans, outs, at = [], [], 0
    for n in counts:
        out = torch.zeros(n, dtype=torch.float32)
        spans.append(Span(source, at, at + 4 * n, torch.float32, (n,), (1,), out))
        outs.append(out)
        at += 4 * n
    return spans, outs


def _group_blocks(group: list[Span], shard: _BlockMap) -> set[int]:
    out: set[int] = set()
    for span in group:
        first, last = shard.blocks(span.start, span.end)
        out |= set(range(first, last + 1))
    return out


def test_one_shard_of_tensors_packed_across_blocks_reads_with_every_thread() -> None:
    # 24 tensors of 3,000 floats (12,000 bytes) in blocks of 4,096 bytes: every tensor ends
    # inside the block where the next begins, as tensors packed in a shard do. Before spans
    # were cut at a shared block's end, this was one group: one thread.
    spans, _ = _packed([3000] * 24)
    shard = _BlockMap(24 * 12_000, 4096)
    groups = group_spans([shard], spans, 4)  # type: ignore[list-item]
    assert len(groups) == 4
    seen: set[int] = set()
    for group in groups:
        blocks = _group_blocks(group, shard)
        assert not blocks & seen, "a block read by two threads"
        seen |= blocks
    sizes = [sum(s.end - s.start for s in g) for g in groups]
    assert sum(sizes) == 24 * 12_000
    assert max(sizes) <= 2 * min(sizes), sizes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.integers(1, 9),
       st.sampled_from([64, 1000, 4096]))
def test_the_pieces_of_the_spans_cover_every_byte_once_and_share_no_block(
        counts: list[int], parts: int, block: int) -> None:
    spans, outs = _packed(counts)
    total = sum(4 * n for n in counts)
    shard = _BlockMap(total, block)
    groups = group_spans([shard], spans, parts)  # type: ignore[list-item]
    assert 1 <= len(groups) <= parts
    seen: set[int] = set()
    written = 0
    for group in groups:
        blocks = _group_blocks(group, shard)
        assert not blocks & seen
        seen |= blocks
        for span in group:
            assert span.into.numel() * 4 == span.end - span.start
            # the file bytes' element index, written where the span says they go
            span.into.copy_(torch.arange(span.start // 4, span.end // 4, dtype=torch.float32))
            written += span.end - span.start
    assert written == total
    expected = torch.arange(total // 4, dtype=torch.float32)
    assert torch.equal(torch.cat(outs), expected)


def test_a_span_into_a_strided_destination_is_not_cut() -> None:
    # Columns of a matrix: the bytes do not fill the destination in order, so the span stays
    # whole and the groups end only where no block is shared.
    base = torch.zeros(100, 40, dtype=torch.float32)
    spans = [Span(0, i * 8000, (i + 1) * 8000, torch.float32, (100, 20), (40, 1),
                  base[:, 20 * (i % 2):20 * (i % 2) + 20]) for i in range(4)]
    shard = _BlockMap(32_000, 3001)  # every span ends inside the block the next begins in
    groups = group_spans([shard], spans, 4)  # type: ignore[list-item]
    assert [len(g) for g in groups] == [4]
    assert groups[0] == spans
