"""A checkpoint manager with torchtitan's method names, over a ``CheckpointPipeline``.

torchtitan's training loop calls its ``CheckpointManager`` at fixed points: ``load()`` once
at start-up, ``maybe_wait_for_staging()`` right before ``optimizers.step()``, ``save(step)``
after every step and ``close()`` at the end. :class:`PipelineCheckpointManager` answers the
same calls, so a torchtitan-style loop (or any torchrun script) checkpoints asynchronously
through the pipeline: ``save`` decides whether the step is due (every ``interval`` steps and
at the last one), hands the state over and returns at once; the copy, the writes and the
commit agreed by every rank run in the background.

Besides the objects in ``states``, the manager keeps the run's :class:`ckpt_pipeline.TrainState`
(``train_state``): ``save`` advances it every step (``samples`` consumed, your ``extra``
values), every save stores it, and ``load`` brings it back, so that a data position derived
from ``train_state.consumed_train_samples`` resumes where it was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from typing_extensions import Unpack

import ckpt_pipeline as cp
from ckpt_pipeline.config import PipelineOptions

__all__ = ("PipelineCheckpointManager",)


class PipelineCheckpointManager:
    """Periodic asynchronous saves and resume, called as torchtitan calls its manager.

    ``states`` maps names to what is saved: objects with ``state_dict()`` and
    ``load_state_dict()`` (modules, FSDP2-sharded ones included, optimizers, LR schedulers,
    a data loader) or nested dicts and lists of tensors. ``interval`` is the number of steps
    between saves; ``enable_first_step_checkpoint`` also saves step 1. ``options`` go to the
    pipeline (``keep_last=3`` by default, ``buffer_slots``, ``replication``, ...); with
    ``torch.distributed`` initialized, the pipelines of every rank coordinate, so every rank
    must make the same calls with the same steps.

    Call order: ``load()`` (optional, once, before training), then per step
    ``maybe_wait_for_staging()`` before the optimizer updates the saved tensors in place and
    ``save(step)`` after it, then ``close()`` (or use the manager as a context manager).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        states: Mapping[str, Any],
        *,
        interval: int,
        enable_first_step_checkpoint: bool = False,
        exit_timeout_s: float | None = 300.0,
        **options: Unpack[PipelineOptions],
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise cp.ConfigError(f"interval must be a positive number of steps, got {interval!r}",
                                 hint="e.g. interval=500: save every 500 steps")
        options.setdefault("keep_last", 3)
        self.states = dict(states)
        self.interval = interval
        self.enable_first_step_checkpoint = enable_first_step_checkpoint
        self.train_state = cp.TrainState()
        """The run's progress: advanced by every ``save()``, brought back by ``load()``."""
        self.pipeline = cp.CheckpointPipeline(root, exit_timeout_s=exit_timeout_s, sigterm="off",
                                              **options).open()
        self._saved_step = 0

    def __enter__(self) -> PipelineCheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def load(self, step: int = -1) -> bool:
        """Restore the newest committed step (``step=-1``) or ``step`` into ``states`` in
        place, with ``train_state``; False when there is no checkpoint to restore.

        Restoring a given step makes it the run's newest: newer steps are moved aside (see
        ``CheckpointPipeline.restore``); RestoreError when that step is not held.
        """
        if step == -1:
            restored = self.pipeline.restore_latest(self.states)
        else:
            restored = self.pipeline.restore(self.states, step)
        if restored is None:
            return False
        self.train_state = restored.train_state
        self._saved_step = restored.step
        return True

    def should_save(self, curr_step: int, last_step: bool = False) -> bool:
        """Whether ``save(curr_step, last_step)`` saves: an interval step, the first step when
        ``enable_first_step_checkpoint``, or the last step; never a step saved already."""
        if curr_step <= self._saved_step:
            return False
        return (last_step or curr_step % self.interval == 0
                or (curr_step == 1 and self.enable_first_step_checkpoint))

    def save(self, curr_step: int, last_step: bool = False, *, samples: int = 0,
             **extra: Any) -> cp.SaveHandle | None:
        """Advance ``train_state`` to ``curr_step`` (``samples`` consumed by this step over
        all ranks, ``extra`` values such as the loss), and save if the step is due.

        Returns the save's handle at once, or None when nothing was saved (torchtitan
        returns a bool: the handle is true, None false). The last step
        (``last_step=True``) also waits for its commit, so that the process can exit
        right after; a failed save raises its ``CheckpointError`` there.
        """
        self.train_state = self.train_state.advanced(step=curr_step, samples=samples, **extra)
        if not self.should_save(curr_step, last_step):
            return None
        handle = self.pipeline.save(curr_step, self.states, self.train_state)
        self._saved_step = curr_step
        if last_step:
            handle.result()
        return handle

    def maybe_wait_for_staging(self) -> None:
        """Wait until a save in flight has copied the tensors the optimizer is about to
        update in place (on CUDA a GPU-side wait; returns at once when nothing is copying)."""
        self.pipeline.wait_snapshot()

    def maybe_wait_for_saving(self, timeout: float | None = None) -> None:
        """Block until every save in flight is committed (returns at once when none is);
        raise the first failure since the last wait."""
        self.pipeline.wait(timeout)

    def latest_step(self) -> int | None:
        """The newest step committed by this rank, or None."""
        return self.pipeline.latest_step()

    def close(self) -> None:
        """Finish the saves in flight and stop the pipeline. Idempotent."""
        self.pipeline.close()
