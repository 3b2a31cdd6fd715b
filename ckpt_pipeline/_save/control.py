"""The pipeline's side of a ``SaveHandle``: the one object that settles it.

``save()`` hands the caller a ``SaveHandle``, which only reads the outcome. The pipeline keeps
the ``HandleControl`` it was created with: the stages resolve or fail it through the control,
and the ledger marks it settled once retention (or the failure's clean-up) is done too. So no
module reaches into the handle's internals, and the public class shows only its public API.
"""

from __future__ import annotations

import concurrent.futures
import threading

from ..errors import CheckpointError
from ..handle import CommitInfo, SaveHandle
from .copy import Snapshot

__all__ = ("HandleControl",)


class HandleControl:
    """Settles one save's handle: its outcome once (commit or failure), then ``settle``.

    Thread-safe: the stages run on the event loop, a skipped save fails on the caller's
    thread, and ``wait()`` waits in a worker thread.
    """

    def __init__(self, step: int, save_id: str, snapshot: Snapshot | None = None) -> None:
        self._outcome: concurrent.futures.Future[CommitInfo] = concurrent.futures.Future()
        self._durable: concurrent.futures.Future[CommitInfo | None] = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self.handle = SaveHandle(step, save_id, self._outcome, snapshot, self._durable)
        """What ``save()`` returns to the caller."""

    @property
    def step(self) -> int:
        return self.handle.step

    def resolve(self, info: CommitInfo) -> None:
        """The save committed (a second outcome is ignored: the first one stands). Committed
        on disk, it is durable too; committed in memory, ``resolve_durable`` follows."""
        with self._lock:
            if not self._outcome.done():
                self._outcome.set_result(info)
            if info.tier == "disk" and not self._durable.done():
                self._durable.set_result(info)

    def resolve_durable(self, info: CommitInfo | None) -> None:
        """A memory save's outcome on disk: committed there (``info``), or not written to
        disk (None: not due, skipped). Ignored once it has one."""
        with self._lock:
            if not self._durable.done():
                self._durable.set_result(info)

    def fail(self, error: CheckpointError) -> None:
        """The save failed (ignored if it already has an outcome): on disk too."""
        with self._lock:
            if not self._outcome.done():
                self._outcome.set_exception(error)
            if not self._durable.done():
                self._durable.set_exception(error)

    def fail_durable(self, error: CheckpointError) -> None:
        """A memory save's write-through to disk failed (it stays committed in memory)."""
        with self._lock:
            if not self._durable.done():
                self._durable.set_exception(error)

    def settle(self) -> None:
        """The save has left the pipeline: committed and retained, or failed and removed."""
        self.resolve_durable(None)  # a memory save that left without a disk outcome
        self._settled.set()

    @property
    def settled(self) -> bool:
        return self._settled.is_set()

    def wait_settled(self, timeout: float | None) -> bool:
        """Block until settled (from a worker thread); False when ``timeout`` passed first."""
        return self._settled.wait(timeout)
