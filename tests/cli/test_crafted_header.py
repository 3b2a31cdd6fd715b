"""A header that declares a view of more bytes than the shard stores (a stride of 0 over a few
bytes) must never make ``export`` or ``cp.load`` allocate them: a CheckpointError naming the
tensor, checked under a limit on the address space so that an allocation would fail loudly."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.documents import (
    Manifest,
    decode_commit,
    decode_manifest,
    encode_commit,
    encode_manifest,
)
from ckpt_pipeline._format.header import DistLayout
from ckpt_pipeline._format.region import checksum
from ckpt_pipeline._format.scan import scan
from ckpt_pipeline._format.shard import encode_header, encode_preamble
from ckpt_pipeline.storage import LocalStorage
from tests._support.children import REPO, child_env

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # a child under RLIMIT_AS: seconds


def _craft(root: Path, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    """Rewrite rank 0's newest shard so that its first tensor declares ``shape`` and
    ``stride`` over the same stored bytes; header, preamble and manifest stay consistent."""
    status = scan(LocalStorage(root), 0)[0]
    header = status.header
    assert header is not None
    first = dataclasses.replace(header.tensors[0], shape=shape, stride=stride)
    raw = encode_header(dataclasses.replace(header, tensors=(first, *header.tensors[1:])))
    step_dir = root / status.dir_name
    shard = step_dir / "rank-00000.shard"
    data_end = header.data_offset + header.data_length
    data = bytearray(shard.read_bytes()[:data_end])
    data[:64] = encode_preamble(data_end, raw)
    shard.write_bytes(bytes(data) + raw)
    manifest_path = step_dir / "rank-00000.manifest"
    manifest = decode_manifest(manifest_path.read_bytes(), str(manifest_path))
    manifest_path.write_bytes(encode_manifest(dataclasses.replace(
        manifest, shard_size=data_end + len(raw), header_checksum=checksum(raw))))
    assert isinstance(manifest, Manifest)


_CHILD = """
    import resource, sys
    import ckpt_pipeline as cp
    from ckpt_pipeline.cli import main
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a 4 GiB allocation fails
    root, out = sys.argv[1], sys.argv[2]
    try:
        loaded = cp.load(root)
        print("load", tuple(loaded.tree["w"].shape))
    except cp.CheckpointError as exc:
        print("load refused:", exc)
    print("export status", main(["export", root, out]))
"""


def test_a_stride_zero_view_over_few_bytes_is_refused_not_allocated(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"w": torch.ones(4), "b": torch.zeros(2)}).result(30)
    _craft(root, (1 << 30,), (0,))  # 4 GiB of float32 over 16 stored bytes
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), str(root),
                           str(tmp_path / "out.safetensors")], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=90, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    assert "export status 1" in done.stdout, done.stdout + done.stderr
    assert re.search(r"tensor w is a view of 4294967296 bytes over \d\d stored bytes",
                     done.stderr), done.stderr  # (small tensors share one stored block)
    assert not (tmp_path / "out.safetensors").exists()


def _as_two_ranks(root: Path, dist: DistLayout) -> None:
    """Turn rank 0's files of the newest step into a 2-rank step: rank 0's first tensor as a
    DTensor shard with ``dist``, and the same files again as rank 1's (every record says world
    size 2), consistent in header, preamble, manifest and commit record."""
    status = scan(LocalStorage(root), 0)[0]
    header = status.header
    assert header is not None
    step_dir = root / status.dir_name
    data_end = header.data_offset + header.data_length
    data = (step_dir / "rank-00000.shard").read_bytes()[:data_end]
    manifest = decode_manifest((step_dir / "rank-00000.manifest").read_bytes(), "m")
    record = decode_commit((step_dir / "rank-00000.commit").read_bytes(), "c")
    first = dataclasses.replace(header.tensors[0], dist=dist)
    for rank in (0, 1):
        raw = encode_header(dataclasses.replace(header, rank=rank, world_size=2,
                                                tensors=(first, *header.tensors[1:])))
        body = bytearray(data)
        body[:64] = encode_preamble(data_end, raw)
        (step_dir / f"rank-{rank:05d}.shard").write_bytes(bytes(body) + raw)
        (step_dir / f"rank-{rank:05d}.manifest").write_bytes(encode_manifest(
            dataclasses.replace(manifest, rank=rank, world_size=2,
                                shard_size=data_end + len(raw), header_checksum=checksum(raw))))
        (step_dir / f"rank-{rank:05d}.commit").write_bytes(encode_commit(
            dataclasses.replace(record, rank=rank, world_size=2)))


_CONSOLIDATE_CHILD = """
    import resource, sys
    import ckpt_pipeline as cp
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a 4 GiB allocation fails
    try:
        cp.load(sys.argv[1], consolidate=True)
        print("loaded")
    except cp.CheckpointError as exc:
        print("refused:", exc)
"""


def test_a_huge_global_shape_is_refused_before_the_full_tensor_is_allocated(
        tmp_path: Path) -> None:
    root = tmp_path / "root"
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"w": torch.ones(4), "b": torch.zeros(2)}).result(30)
    # each of 2 ranks claims 4 floats as its half of a tensor of 2^30 (4 GiB)
    _as_two_ranks(root, DistLayout((2,), ("S0",), (1 << 30,), (1,)))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_CONSOLIDATE_CHILD),
                           str(root)], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=90, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    assert "refused:" in done.stdout, done.stdout
    assert "rank 0's shard has shape [4], its place in the full tensor of [1073741824]" \
        in done.stdout, done.stdout
