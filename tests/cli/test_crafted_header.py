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
from ckpt_pipeline._format.documents import Manifest, decode_manifest, encode_manifest
from ckpt_pipeline._format.region import checksum
from ckpt_pipeline._format.scan import scan
from ckpt_pipeline._format.shard import encode_header, encode_preamble
from ckpt_pipeline.storage import LocalStorage
from tests._support.children import REPO, child_env

pytestmark = pytest.mark.timeout(120)


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
