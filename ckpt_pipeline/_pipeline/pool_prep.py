"""Make the host buffers before the first save asks for them, off the training thread.

Making gigabytes of page-locked memory takes seconds (on an H200, 1.5 s for 4.5 GiB mapped,
populated and registered). Made by the first save, that time blocks the training thread. So
the pool is made in a background thread as soon as a size is known and nothing on the
training thread's path would wait for it: once the first ``restore()`` or ``restore_latest()``
is done, from the state passed in (a fresh job passes it too, and finds nothing to restore):
the state's own layout; or at open from ``MemoryConfig(slot_bytes=)`` (made by the tier
itself).

Not at open from the newest step a restart finds: the restore that follows would compete with
it. Registering pinned memory holds the CUDA driver, which stalls the restore's own copies to
the GPU, and mapping it in takes the memory bandwidth the restore's reads need.

A save that comes while its buffer is still being made waits for that buffer only (with
device staging it does not wait: it copies to the GPU and returns, and the copy stage takes the
buffer when it is made).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from .._format.layout import plan_layout
from .._logging import log
from .._save.buffers import HostPool
from .._save.shm_pool import MemoryPool
from .._tree import flatten_state
from ..errors import CheckpointError

__all__ = ("PoolPrep",)


class PoolPrep:
    """Starts the pool's making once, from the first size that becomes known."""

    def __init__(self, pool: HostPool | MemoryPool, rank: int, cap: int | None,
                 *, made_by_tier: bool) -> None:
        self._pool = pool
        self._rank = rank
        self._cap = cap  # host_buffer_bytes: a streamed state's slots hold a piece only
        self._started = made_by_tier
        self._thread: threading.Thread | None = None

    def from_state(self, state: Mapping[str, Any]) -> None:
        """At a restore: the size ``state`` would need (on the caller's thread: a layout of
        its tensors, no copies). A state that cannot be saved is left to ``save()`` to
        report."""
        if self._started:
            return
        try:
            flat = flatten_state(state, step=0)
        except CheckpointError:
            return
        if flat.tensors:
            layout = plan_layout(flat.tensors)
            self._start(layout.buffer_bytes, any(t.is_cuda for t in flat.tensors),
                        source="restore state")

    def _start(self, size: int, cuda: bool, *, source: str) -> None:
        self._started = True
        size = size if self._cap is None else min(size, self._cap)
        pool, rank = self._pool, self._rank

        def reserve() -> None:
            try:
                pool.reserve(size, register=cuda)
            except Exception as exc:  # the first save makes them, as without a size
                log.warning("ckpt.pool.reserve_failed", rank=rank, bytes=size,
                            error=f"{type(exc).__name__}: {exc}")
            else:
                log.info("ckpt.pool.reserved", rank=rank, bytes=size, source=source)

        self._thread = threading.Thread(target=reserve, name="ckpt-pool-reserve", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the making started here has ended (at close, before the pool closes: a
        thread still inside torch's allocator when the interpreter exits aborts the
        process). Worker thread."""
        if self._thread is not None:
            self._thread.join()
