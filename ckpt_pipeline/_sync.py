"""``CheckpointPipeline``: the pipeline for synchronous training loops.

The event loop runs in one named background thread behind an anyio blocking portal; the
training thread only validates, copies (CPU) or queues copies (CUDA), and hands the save over.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping, MutableMapping
from types import TracebackType
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal

from ._pipeline import AsyncCheckpointPipeline, Subscriber
from .config import PipelineConfig
from .coordination import Coordinator
from .errors import PipelineClosedError
from .handle import RestoreResult, SaveHandle
from .storage import Storage
from .train_state import TrainState

__all__ = ("CheckpointPipeline",)


class CheckpointPipeline:
    """Checkpoint pipeline for a synchronous training loop; a context manager.

    ``save()`` returns a :class:`SaveHandle` at once; ``wait_snapshot()`` goes before the next
    in-place update; ``restore_latest()`` loads the newest complete checkpoint in place.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        config: PipelineConfig | None = None,
        storage: Storage | None = None,
        coordinator: Coordinator | None = None,
        thread_name: str = "ckpt-pipeline",
        **options: Any,
    ) -> None:
        self._pipe = AsyncCheckpointPipeline(root, keep_last=keep_last, config=config,
                                             storage=storage, coordinator=coordinator,
                                             **options)
        self.config = self._pipe.config
        self._thread_name = thread_name
        self._thread: threading.Thread | None = None
        self._portal: BlockingPortal | None = None
        self._closing: anyio.Event | None = None
        self._close_error: BaseException | None = None
        self._closed = False

    @property
    def root(self) -> str:
        return str(self._pipe.storage.root)

    def __enter__(self) -> CheckpointPipeline:
        self.open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        """Start the background thread and the pipeline in it (scrubbing leftovers first)."""
        if self._thread is not None:
            raise PipelineClosedError("a pipeline can be opened once")
        ready: queue.Queue[BlockingPortal | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(ready,),
                                        name=self._thread_name, daemon=True)
        self._thread.start()
        item = ready.get()
        if isinstance(item, BaseException):
            self._thread.join()
            self._closed = True
            raise item
        self._portal = item

    def _run(self, ready: queue.Queue[BlockingPortal | BaseException]) -> None:
        async def main() -> None:
            async with BlockingPortal() as portal:
                self._closing = anyio.Event()
                try:
                    await self._pipe.open()
                except Exception as exc:
                    ready.put(exc)
                    return
                ready.put(portal)
                try:
                    await self._closing.wait()
                finally:
                    try:
                        await self._pipe.aclose()
                    except Exception as exc:
                        self._close_error = exc

        try:
            anyio.run(main)
        except BaseException as exc:  # the loop itself failed to start
            ready.put(exc)

    def close(self) -> None:
        """Finish every pending save, stop the background thread. Idempotent."""
        if self._closed or self._thread is None or self._portal is None:
            self._closed = True
            return
        self._closed = True
        closing = self._closing
        assert closing is not None
        self._portal.call(closing.set)
        self._thread.join()
        if self._close_error is not None:
            raise self._close_error

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._closed or self._portal is None:
            raise PipelineClosedError("the pipeline is closed (or was never opened)",
                                      hint="use it inside `with CheckpointPipeline(...)`")
        return self._portal.call(fn, *args)

    def save(self, step: int, state: Mapping[str, Any],
             train_state: TrainState | None = None) -> SaveHandle:
        """Snapshot ``state`` at ``step`` and queue it; returns at once with a handle.

        CPU tensors are copied before this returns; CUDA tensors are copied on a side stream
        (call ``wait_snapshot()`` before mutating them). Bad input raises CheckpointError here,
        before anything is written.
        """
        if self._closed or self._portal is None:
            raise PipelineClosedError("save() after close()", step=step,
                                      hint="open a new pipeline")
        pipe = self._pipe
        plan = pipe._plan_save(step, state, train_state)
        job = pipe._start_save(plan, pipe._acquire(plan, True))
        handle: SaveHandle = self._call(pipe._submit, job)
        return handle

    def wait_snapshot(self, *, block_cpu: bool = False) -> None:
        """Order the caller's CUDA streams after pending snapshot copies (see the async face)."""
        self._pipe._wait_snapshot(block_cpu=block_cpu)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed and retained; raise the first failure."""
        self._call(self._pipe.wait, timeout)

    def restore_latest(self, state: MutableMapping[str, Any]) -> RestoreResult | None:
        """Load the newest complete, verified checkpoint into ``state`` in place."""
        loaded = self._call(self._pipe._load_latest, state)
        if loaded is None:
            return None
        apply_error = self._pipe._apply(loaded, state)
        result: RestoreResult = self._call(self._pipe._finish_restore, loaded, apply_error)
        return result

    def latest_step(self) -> int | None:
        """The newest step committed by this rank, or None."""
        step: int | None = self._call(self._pipe.latest_step)
        return step

    def pending_steps(self) -> list[int]:
        """Steps still in the pipeline (not yet committed and retained, or failed)."""
        return self._pipe.pending_steps()

    @property
    def host_memory_bytes(self) -> int:
        """Bytes held by the host buffer pool (allocated on the first save, then reused)."""
        return self._pipe.host_memory_bytes

    @property
    def host_memory_pinned(self) -> bool:
        return self._pipe.host_memory_pinned

    @property
    def device_memory_bytes(self) -> int:
        """Bytes of GPU memory held by the device staging buffers (``device_staging``)."""
        return self._pipe.device_memory_bytes

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Receive every pipeline event (called from the pipeline's thread)."""
        return self._pipe.subscribe(callback)
