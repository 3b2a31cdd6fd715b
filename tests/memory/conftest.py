"""The memory tier's tests: each gets a memory root of its own in /dev/shm."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A memory root of its own in /dev/shm, not created yet (removed afterwards)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    path = shm / f"ckpt-test-{uuid.uuid4().hex[:12]}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
