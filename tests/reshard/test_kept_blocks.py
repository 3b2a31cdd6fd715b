"""The reading threads' kept block, on a real shard file: tensors laid end to end, each ending
inside the checksum block where the next begins, read whole by one thread. The block two
tensors share is read once (and verified), each tensor gets exactly its bytes (the head of the
next one from the kept block), and a damaged shared block fails the read. Destinations of the
saved dtype are read straight into (``_read_direct``); float64 ones go through the staging
buffer (``_read_span``), each span's blocks read whole there."""

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


def _read(root: Path, dtype: torch.dtype = torch.float32
          ) -> tuple[dict[str, torch.Tensor], ShardRanges]:
    (status,) = scan(cp.LocalStorage(root), 0)
    shard = ShardRanges(cp.LocalStorage(root), status, 0)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["direct", "staged"])
def test_tensors_that_share_blocks_are_read_exactly_with_each_block_read_once(
        tmp_path: Path, dtype: torch.dtype) -> None:
    saved = _save(tmp_path)
    outs, shard = _read(tmp_path, dtype)
    for name, tensor in saved.items():
        assert torch.equal(outs[f"tensors/{name}"], tensor.to(dtype)), name
    data = [(a, b) for a, b, _ in shard.checks]
    tensors_end = max(shard.header.storages[r.storage].offset + r.byte_offset
                      + 4 * r.shape[0] for r in shard.header.tensors)
    needed_blocks = [k for k, (a, _b) in enumerate(data) if a < tensors_end]
    read_bytes = sum(b - a for a, b in data[:len(needed_blocks)])
    assert shard.bytes_read == read_bytes  # every block the tensors touch, each once


def test_a_damaged_block_shared_by_two_tensors_fails_the_read(tmp_path: Path) -> None:
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
        _read(tmp_path)
