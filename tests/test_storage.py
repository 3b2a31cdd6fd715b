"""The storage layer names the file in every error, never a bare descriptor."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["pwrite", "fsync"])
def test_a_failed_write_names_the_file(root: Path, call: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with cp.CheckpointPipeline(root, direct_io=False) as pipe:
        pipe.save(1, {"x": torch.ones(1024)}).result(30)
        real = getattr(os, call)

        def failing(fd: int, *args: object) -> object:
            if ".shard.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):  # this save's shard
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(fd, *args)

        monkeypatch.setattr(os, call, failing)
        with pytest.raises(cp.StorageError) as caught:
            pipe.save(2, {"x": torch.ones(1024)}).result(30)
        monkeypatch.setattr(os, call, real)
    message = str(caught.value)
    assert "<fd" not in message
    assert "step-0000000002/.rank-00000." in message, message
    assert caught.value.errno == errno.EIO


@pytest.mark.timeout(60)
def test_read_errors_name_the_file(root: Path) -> None:
    storage = cp.LocalStorage(root)
    storage.ensure_root()
    (root / "short").write_bytes(b"abc")
    fd, _size = storage.open_read("short")
    try:
        with pytest.raises(cp.StorageError) as caught:
            storage.pread_into(fd, memoryview(bytearray(10)), 0)
    finally:
        storage.close(fd)
    assert caught.value.path == str(root / "short")


@pytest.mark.timeout(60)
def test_truncate_sizes_a_file_being_written_and_names_it_when_it_fails(root: Path) -> None:
    storage = cp.LocalStorage(root)
    storage.ensure_root()
    fd, temp = storage.create_temp("", "f")
    try:
        storage.truncate(fd, 10)
        assert (root / temp).read_bytes() == bytes(10)
        with pytest.raises(cp.StorageError) as caught:
            storage.truncate(fd, -1)
    finally:
        storage.close(fd)
    assert caught.value.errno == errno.EINVAL and caught.value.path == str(root / temp)


@pytest.mark.timeout(60)
def test_copy_out_copies_a_range_of_a_file_to_a_descriptor_outside_the_root(
    root: Path, tmp_path: Path
) -> None:
    storage = cp.LocalStorage(root)
    storage.ensure_root()
    (root / "src").write_bytes(bytes(range(256)) * 64)
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    fd, _size = storage.open_read("src")
    try:
        copied = storage.copy_out(fd, out, 1000, 5000)
        if not copied:  # the kernel refused: the caller writes what it reads instead
            pytest.skip("copy_file_range is not offered here")
    finally:
        storage.close(fd)
        os.close(out)
    assert (tmp_path / "out").read_bytes()[1000:5000] == (root / "src").read_bytes()[1000:5000]

