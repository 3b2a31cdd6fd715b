"""Fixtures and hooks of the whole suite: a checkpoint root, and GPU tests skipped without CUDA.

The helpers the tests share (child processes, the command line, training states, round trips,
the replication launcher) are in ``tests/_support/``, imported by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``gpu``-marked tests when there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkpoint root that does not exist yet."""
    return tmp_path / "ckpt"
