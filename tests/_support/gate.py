"""A slow host-buffer allocation on demand: the making of host buffers (pinned tensors, or
the memory tier's shared-memory files) held at a gate, so that a test fixes the order of
events instead of timing them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import pytest

from ckpt_pipeline._save import buffers, shm_pool
from ckpt_pipeline._tiers.memory.shm import ShmBuffer


class Gate:
    """Holds every call of a wrapped maker until opened; ``entered`` is set at the first."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def wrap(self, make: Callable[..., object]) -> Callable[..., object]:
        def gated(*args: object, **kwargs: object) -> object:
            self.entered.set()
            assert self.opened.wait(30), "the gate was never opened"
            return make(*args, **kwargs)
        return gated


@contextlib.contextmanager
def gated_buffer_making(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    """Every host buffer made inside waits for the gate (opened at the latest on exit)."""
    gate = Gate()
    monkeypatch.setattr(buffers, "_host_buffer", gate.wrap(buffers._host_buffer))
    monkeypatch.setattr(shm_pool, "ShmBuffer", gate.wrap(ShmBuffer))
    try:
        yield gate
    finally:
        gate.opened.set()
