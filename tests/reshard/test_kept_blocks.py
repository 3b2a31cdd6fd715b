"""A reading thread's blocks shared by two tensors, on a real shard file: tensors laid end to
end, each ending inside the checksum block where the next begins, read whole by one thread.
Each block the tensors touch is read once (and verified), each tensor gets exactly its
bytes, and a damaged shared block fails the read. Both ways of reading: a local file
(``_Stream``: each tensor's bytes straight into it, the block's other bytes into scratch,
each block verified from its pieces) and a source read in whole blocks (``_Reader``, as the
persistent tier and the copy servers are: the kept block serves the next tensor's head).
Destinations of the saved dtype are read straight into; float64 ones go through the staging
buffer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.scan import scan
from ckpt_pipeline._reshard.boxes import Box
from ckpt_pipeline._reshard.ranges import ShardRanges, read_group, spans_of
from ckpt_pipeline.errors import CheckpointIntegrityError

pytestmark = pytest.mark.timeout(60)

BLOCK = 4096
COUNTS = (1000, 2500, 777, 3001, 64)
"""float32 elements of each tensor: none a multiple of a block, so every boundary but the
last falls inside a block."""


def _save(root: Path) -> dict[str, torch.Tensor]:
    state = {f"t{i}": torch.arange(n, dtype=torch.float32) + 1000 * i
             for i, n in enumerate(COUNTS)}
    with cp.CheckpointPipeline(root, chunk_bytes=BLOCK) as pipe:
        pipe.save(1, {"tensors": state}, cp.TrainState(step=1)).result(timeout=30)
    return state


class _WholeBlocks(cp.LocalStorage):
    """A local root read as a remote source is: in whole checksum blocks."""

    SMALL_READS = False


def _read(root: Path, dtype: torch.dtype = torch.float32, small_reads: bool = True
          ) -> tuple[dict[str, torch.Tensor], ShardRanges]:
    (status,) = scan(cp.LocalStorage(root), 0)
    shard = ShardRanges(cp.LocalStorage(root) if small_reads else _WholeBlocks(root), status,
                        0)
    assert shard.block == BLOCK
    outs: dict[str, torch.Tensor] = {}
    spans = []
    for record in sorted(shard.header.tensors, key=lambda r: (
            shard.header.storages[r.storage].offset + r.byte_offset)):
        out = outs[record.path] = torch.full(tuple(record.shape), -1.0, dtype=dtype)
        spans += spans_of(shard, 0, record, Box.full(record.shape), out, bound=1 << 30)
    try:
        read_group([shard], spans)  # one thread, every span in file order
    finally:
        shard.close()
    return outs, shard


@pytest.mark.parametrize("small_reads", [True, False], ids=["streamed", "whole_blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["direct", "staged"])
def test_tensors_that_share_blocks_are_read_exactly_with_each_block_read_once(
        tmp_path: Path, dtype: torch.dtype, small_reads: bool) -> None:
    saved = _save(tmp_path)
    outs, shard = _read(tmp_path, dtype, small_reads)
    for name, tensor in saved.items():
        assert torch.equal(outs[f"tensors/{name}"], tensor.to(dtype)), name
    data = [(a, b) for a, b, _ in shard.checks]
    tensors_end = max(shard.header.storages[r.storage].offset + r.byte_offset
                      + 4 * r.shape[0] for r in shard.header.tensors)
    needed_blocks = [k for k, (a, _b) in enumerate(data) if a < tensors_end]
    read_bytes = sum(b - a for a, b in data[:len(needed_blocks)])
    assert shard.bytes_read == read_bytes  # every block the tensors touch, each once


@pytest.mark.parametrize("small_reads", [True, False], ids=["streamed", "whole_blocks"])
def test_a_damaged_block_shared_by_two_tensors_fails_the_read(tmp_path: Path,
                                                             small_reads: bool) -> None:
    _save(tmp_path)
    (status,) = scan(cp.LocalStorage(tmp_path), 0)
    assert status.header is not None
    records = {r.path: r for r in status.header.tensors}
    t0 = records["tensors/t0"]
    end_of_t0 = status.header.storages[t0.storage].offset + t0.byte_offset + 4 * COUNTS[0]
    assert end_of_t0 % BLOCK, "t0 must end inside a block"
    shard_file = Path(status.path) / (status.shard_file or "rank-00000.shard")
    with shard_file.open("r+b") as f:  # a byte of t1's head, in the block t0 ends in
        f.seek(end_of_t0 + 8)
        byte = f.read(1)
        f.seek(end_of_t0 + 8)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointIntegrityError, match="checksum mismatch"):
        _read(tmp_path, small_reads=small_reads)


def _one_tensor(root: Path) -> tuple[torch.Tensor, ShardRanges, int]:
    """A 1-D float32 tensor saved alone; its shard open for range reads, and the tensor's
    first byte in the file."""
    value = torch.arange(10_000, dtype=torch.float32)
    with cp.CheckpointPipeline(root, chunk_bytes=BLOCK) as pipe:
        pipe.save(1, {"t": value}, cp.TrainState(step=1)).result(timeout=30)
    (status,) = scan(cp.LocalStorage(root), 0)
    shard = ShardRanges(cp.LocalStorage(root), status, 0)
    record = shard.records["t"]
    return value, shard, shard.header.storages[record.storage].offset + record.byte_offset


BOXES = ((100, 1900), (5000, 2000), (1500, 1000))
"""(first element, count) of each destination: two apart, the third overlapping the first
(read on its own, in whole blocks)."""


def _blocks_bytes(shard: ShardRanges, start: int, end: int) -> set[tuple[int, int]]:
    first, last = shard.blocks(start, end)
    return {(a, b) for a, b, _ in shard.checks[first:last + 1]}


def test_parts_of_a_tensor_read_each_block_they_touch_once_and_an_overlap_on_its_own(
        tmp_path: Path) -> None:
    value, shard, base = _one_tensor(tmp_path)
    outs = [torch.full((n,), -1.0) for _, n in BOXES]
    spans = [span for (at, n), out in zip(BOXES, outs, strict=True)
             for span in spans_of(shard, 0, shard.records["t"], Box((at,), (n,)), out,
                                  bound=1 << 30)]
    try:
        read_group([shard], spans)
    finally:
        shard.close()
    for (at, n), out in zip(BOXES, outs, strict=True):
        assert torch.equal(out, value[at:at + n])
    streamed = set().union(*(_blocks_bytes(shard, base + 4 * at, base + 4 * (at + n))
                             for at, n in BOXES[:2]))
    overlap = _blocks_bytes(shard, base + 4 * BOXES[2][0], base + 4 * sum(BOXES[2]))
    assert shard.bytes_read == sum(b - a for a, b in streamed) + sum(b - a for a, b in overlap)


@pytest.mark.parametrize("where", ["before_first", "between", "after_last"])
def test_a_damaged_byte_no_destination_needs_in_a_block_read_fails_the_read(
        tmp_path: Path, where: str) -> None:
    """The bytes of a block that no destination needs are verified with it: a damaged one
    before the first box, between the two, or after the last, inside a block they touch."""
    _, shard, base = _one_tensor(tmp_path)
    shard.close()
    (at0, n0), (at1, n1), _ = BOXES
    offset = {"before_first": base + 4 * at0 - 8, "between": base + 4 * (at0 + n0) + 8,
              "after_last": base + 4 * (at1 + n1) + 8}[where]
    touched = (_blocks_bytes(shard, base + 4 * at0, base + 4 * (at0 + n0))
               | _blocks_bytes(shard, base + 4 * at1, base + 4 * (at1 + n1)))
    assert any(a <= offset < b for a, b in touched), "the byte must be in a block read"
    shard_file = Path(shard.status.path) / (shard.status.shard_file or "rank-00000.shard")
    with shard_file.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    (status,) = scan(cp.LocalStorage(tmp_path), 0)
    shard = ShardRanges(cp.LocalStorage(tmp_path), status, 0)
    outs = [torch.full((n,), -1.0) for _, n in BOXES[:2]]
    spans = [span for (at, n), out in zip(BOXES[:2], outs, strict=True)
             for span in spans_of(shard, 0, shard.records["t"], Box((at,), (n,)), out,
                                  bound=1 << 30)]
    try:
        with pytest.raises(CheckpointIntegrityError, match="checksum mismatch"):
            read_group([shard], spans)
    finally:
        shard.close()
