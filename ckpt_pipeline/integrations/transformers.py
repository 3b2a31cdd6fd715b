"""A Hugging Face ``Trainer`` that checkpoints through a :class:`ckpt_pipeline.CheckpointPipeline`.

``PipelineTrainer`` is a drop-in for ``transformers.Trainer`` (``PipelineTrainerMixin`` puts
the same behaviour on a ``Trainer`` subclass of your own, listed first)::

    trainer = PipelineTrainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=True)   # newest committed step, or a fresh start

What changes against the stock ``Trainer``:

- ``_save_checkpoint`` hands the model, optimizer, LR scheduler, gradient scaler and the
  ``TrainerState`` (as plain values in ``TrainState.extra["hf_trainer_state"]``) to
  ``pipe.save()`` and returns: the copies, checksums, writes and fsyncs run off the training
  thread. The pipeline captures the Python, NumPy and torch RNG states itself. A callback calls
  ``pipe.wait_snapshot()`` in ``on_pre_optimizer_step``, the last hook before
  ``optimizer.step()`` changes the parameters in place.
- No ``checkpoint-N`` directory is written. The steps live under the pipeline's root
  (``output_dir/ckpt_pipeline`` by default) and count only once committed, so
  ``get_last_checkpoint`` (and a stock ``Trainer`` pointed at the same ``output_dir``) never
  sees a step, complete or not.
- ``train(resume_from_checkpoint=True)`` restores the newest committed, verified step (falling
  back to an older one when it is damaged): the model before the model is wrapped, the
  optimizer and scheduler once they exist, the ``TrainerState`` where the stock ``Trainer``
  loads its JSON (so its batch skipping starts from the restored ``global_step`` and epoch),
  and the RNG states where the stock one loads them (at the start of the resumed epoch, or
  after the skipped batches). With no committed step it falls back to the stock
  ``checkpoint-N`` directories (a run that switches from the stock ``Trainer``), then raises
  ``ValueError`` as the stock one does. A path (a ``checkpoint-N`` directory) is loaded by the
  stock code.
- ``save_total_limit`` becomes the pipeline's retention (``KeepLast(save_total_limit)``;
  None keeps every step). The pipeline prunes only committed steps, after a newer one
  committed, in its own retain stage: a removal never races a save in flight.
- ``train()`` finishes the saves in flight at its end (and raises the last failure there),
  and closes the pipeline.

Not supported (refused at ``train()`` with a ``ConfigError``): DeepSpeed, FSDP,
``load_best_model_at_end``. Hyper-parameter search trials are saved by the stock code.
``PipelineCallback`` is for save-only use with a stock ``Trainer`` (see its docstring).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import compare_trainer_and_checkpoint_args, get_last_checkpoint

import ckpt_pipeline as cp
from ckpt_pipeline.errors import ConfigError

__all__ = ("TRAINER_STATE_KEY", "PipelineCallback", "PipelineTrainer", "PipelineTrainerMixin",
           "ResumePoint", "trainer_state_to_plain")

logger = logging.getLogger("ckpt_pipeline.integrations.transformers")

TRAINER_STATE_KEY = "hf_trainer_state"
"""The ``TrainState.extra`` key holding the ``TrainerState`` as plain values."""

DEFAULT_ROOT_NAME = "ckpt_pipeline"
"""The pipeline's root under ``output_dir`` when none is given (not a ``checkpoint-N`` name)."""

if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


@dataclasses.dataclass(frozen=True, slots=True)
class ResumePoint:
    """The step a ``train(resume_from_checkpoint=True)`` resumes: what was restored up front,
    and what the Trainer's later load calls apply."""

    step: int
    path: str
    """The step's directory: what the Trainer is told it resumes from (never a
    ``checkpoint-N`` name)."""
    trainer_state: Mapping[str, Any]
    rng: cp.RNGState | None


def trainer_state_to_plain(state: TrainerState) -> dict[str, Any]:
    """The ``TrainerState`` as the JSON values ``save_to_json`` writes (msgpack-able)."""
    plain: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(state)))
    return plain


def _refuse_unsupported(args: TrainingArguments, trainer: Trainer) -> None:
    unsupported = [name for name, on in (
        ("DeepSpeed", trainer.is_deepspeed_enabled), ("FSDP", trainer.is_fsdp_enabled),
        ("load_best_model_at_end", args.load_best_model_at_end)) if on]
    if unsupported:
        raise ConfigError(f"PipelineTrainer does not support {', '.join(unsupported)} yet",
                          path=str(args.output_dir),
                          hint="use the stock transformers.Trainer for this run")


class _SnapshotFence(TrainerCallback):
    """Calls ``wait_snapshot()`` before ``optimizer.step()`` changes the saved tensors."""

    def __init__(self, pipeline: Any) -> None:
        self._pipeline = pipeline

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kwargs: Any) -> None:
        pipe = self._pipeline()
        if pipe is not None:
            pipe.wait_snapshot()


class PipelineTrainerMixin(_TrainerBase):
    """Put before ``Trainer`` in the bases: ``class MyTrainer(PipelineTrainerMixin, Trainer)``.

    ``checkpoint_root``: the pipeline's root (default ``output_dir/ckpt_pipeline``);
    ``checkpoint_config``: a ``cp.PipelineConfig`` (its retention replaces the one mapped from
    ``save_total_limit``). Everything else goes to ``Trainer``.
    """

    def __init__(self, *args: Any, checkpoint_root: str | os.PathLike[str] | None = None,
                 checkpoint_config: cp.PipelineConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ckpt_root = None if checkpoint_root is None else os.fspath(checkpoint_root)
        self._ckpt_config = checkpoint_config
        self._ckpt_pipe: cp.CheckpointPipeline | None = None
        self._ckpt_resume: ResumePoint | None = None
        self._ckpt_tree: dict[str, Any] | None = None
        self._ckpt_last: cp.SaveHandle | None = None
        self.add_callback(_SnapshotFence(lambda: self._ckpt_pipe))

    # ---- the pipeline ----

    @property
    def checkpoint_root(self) -> str:
        """Where the steps are saved."""
        if self._ckpt_root is not None:
            return self._ckpt_root
        return os.path.join(self._output_dir, DEFAULT_ROOT_NAME)

    @property
    def _output_dir(self) -> str:
        return str(self.args.output_dir)

    @property
    def checkpoint_pipeline(self) -> cp.CheckpointPipeline:
        """The open pipeline (opened on first use, closed at the end of ``train()``)."""
        if self._ckpt_pipe is None:
            config = self._ckpt_config
            if config is None:
                limit = self.args.save_total_limit
                config = cp.PipelineConfig(
                    retention=cp.KeepLast(limit) if limit else cp.KeepEvery(1))
            self._ckpt_pipe = cp.CheckpointPipeline(self.checkpoint_root, config=config).open()
        return self._ckpt_pipe

    def close_checkpoint_pipeline(self) -> None:
        """Finish the saves in flight and release the root (``train()`` does it at its end)."""
        pipe, self._ckpt_pipe = self._ckpt_pipe, None
        if pipe is not None:
            pipe.close()

    def _checkpoint_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model}
        if not self.args.save_only_model:
            state["optimizer"] = self.optimizer
            state["scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
        return state

    # ---- training ----

    def train(self, resume_from_checkpoint: str | bool | None = None,
              trial: Any = None, ignore_keys_for_eval: list[str] | None = None,
              **kwargs: Any) -> Any:
        """``Trainer.train``, resuming from the pipeline's newest committed step when
        ``resume_from_checkpoint`` is True; the pipeline is closed at the end."""
        _refuse_unsupported(self.args, self)
        if self.args.push_to_hub:
            logger.warning("PipelineTrainer does not push checkpoints to the hub (no "
                           "checkpoint-N directories are written)")
        succeeded = False
        try:
            self._ckpt_resume = None
            self._ckpt_tree = None
            if resume_from_checkpoint is True:
                point = self._restore_model()
                if point is not None:
                    self._ckpt_resume = point
                    resume_from_checkpoint = None  # the stock code must not read a directory
                elif get_last_checkpoint(self._output_dir) is None:  # type: ignore[no-untyped-call]
                    raise ValueError(f"No valid checkpoint found in output directory "
                                     f"({self._output_dir}) nor in {self.checkpoint_root}")
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            if self._ckpt_pipe is not None:
                self._ckpt_pipe.wait()
            succeeded = True
            return output
        finally:
            self._ckpt_tree = None
            self._ckpt_resume = None
            if succeeded:
                self.close_checkpoint_pipeline()
            else:  # the saves in flight still finish: the previous step stays intact
                try:
                    self.close_checkpoint_pipeline()
                except cp.CheckpointError:
                    logger.exception("closing the checkpoint pipeline after a failed train()")

    def _restore_model(self) -> ResumePoint | None:
        """Restore the newest committed step's model now (before the model is wrapped, as the
        stock ``Trainer`` loads its weights); the rest is applied later from the same step."""
        pipe = self.checkpoint_pipeline
        restored = pipe.restore_latest({"model": self.model}, restore_rng=False)
        if restored is None:
            return None
        trainer_state = restored.train_state.extra.get(TRAINER_STATE_KEY)
        if not isinstance(trainer_state, Mapping):
            raise cp.RestoreError(f"step {restored.step} holds no TrainerState "
                                  f"(extra[{TRAINER_STATE_KEY!r}]): not saved by PipelineTrainer",
                                  step=restored.step, path=restored.path,
                                  hint="give this run another checkpoint_root")
        logger.info("resuming from step %d (%s)", restored.step, restored.path)
        return ResumePoint(restored.step, str(restored.path), trainer_state,
                           restored.train_state.rng)

    def _inner_training_loop(self, batch_size: int | None = None,
                             args: TrainingArguments | None = None,
                             resume_from_checkpoint: str | None = None,
                             trial: Any = None,
                             ignore_keys_for_eval: list[str] | None = None) -> Any:
        if self._ckpt_resume is not None:
            resume_from_checkpoint = self._ckpt_resume.path
        return super()._inner_training_loop(
            batch_size=batch_size, args=args, resume_from_checkpoint=resume_from_checkpoint,
            trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)

    def _resuming(self, checkpoint: str | None) -> ResumePoint | None:
        point = self._ckpt_resume
        return point if point is not None and checkpoint == point.path else None

    def _init_training_state(self, max_steps: Any, num_update_steps_per_epoch: Any,
                             num_train_epochs: Any, resume_from_checkpoint: Any,
                             trial: Any) -> tuple[int, int]:
        point = self._resuming(resume_from_checkpoint)
        if point is None:
            result: tuple[int, int] = super()._init_training_state(
                max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                trial)
            return result
        super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                     None, trial)
        # What the stock code does with the trainer_state.json of a checkpoint-N directory.
        self.state = TrainerState(**json.loads(json.dumps(dict(point.trainer_state))))
        if self.state.best_model_checkpoint is not None and not os.path.isdir(
                self.state.best_model_checkpoint):
            self.state.best_model_checkpoint = None
        compare_trainer_and_checkpoint_args(self.args, self.state)  # type: ignore[no-untyped-call]
        self._load_callback_state()
        epochs_trained = int(self.state.global_step // num_update_steps_per_epoch)
        steps_trained_in_current_epoch = 0
        if not self.args.ignore_data_skip:
            steps_trained_in_current_epoch = self.state.global_step % num_update_steps_per_epoch
            steps_trained_in_current_epoch *= self.args.gradient_accumulation_steps
        self.state.init_training_references(  # type: ignore[no-untyped-call]
            self, max_steps, num_train_epochs, trial)
        return epochs_trained, steps_trained_in_current_epoch

    # ---- loading ----

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: torch.nn.Module | None = None) -> None:
        if self._resuming(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: the model was restored by train() before it was wrapped

    def _saved_tree(self, point: ResumePoint) -> dict[str, Any]:
        """The rest of the step (optimizer, scheduler, scaler), read and verified once."""
        if self._ckpt_tree is None:
            loaded = cp.load(self.checkpoint_root, step=point.step)
            self._ckpt_tree = loaded.tree
        return self._ckpt_tree

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        point = self._resuming(checkpoint)
        if point is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        tree = self._saved_tree(point)
        if "optimizer" not in tree or "scheduler" not in tree:
            raise cp.RestoreError(f"step {point.step} holds no optimizer or scheduler (saved "
                                  "with save_only_model=True): it cannot be resumed",
                                  step=point.step, path=point.path,
                                  hint="resume from a step saved without save_only_model")
        if self.optimizer is None or self.lr_scheduler is None:
            raise cp.RestoreError("the Trainer made no optimizer or scheduler to restore into",
                                  step=point.step, path=point.path)
        self.optimizer.load_state_dict(tree["optimizer"])
        self.lr_scheduler.load_state_dict(tree["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        point = self._resuming(checkpoint)
        if point is None:
            super()._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        saved = self._saved_tree(point).get("scaler")
        if scaler is not None and saved is not None:
            scaler.load_state_dict(saved)
        self._ckpt_tree = None  # the last load from the tree: free the optimizer's copy

    def _load_rng_state(self, checkpoint: str | None) -> None:
        point = self._resuming(checkpoint)
        if point is None:
            super()._load_rng_state(checkpoint)
        elif point.rng is not None:
            point.rng.apply()

    # ---- saving ----

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        if self.hp_search_backend is not None or trial is not None:
            super()._save_checkpoint(model, trial)
            return
        self.store_flos()
        # As the stock code does before writing trainer_state.json.
        # (After __post_init__, stateful_callbacks is a dict by callback name.)
        saved: dict[str, Any] = self.state.stateful_callbacks  # type: ignore[assignment]
        for callback in [cb for cb in [*self.callback_handler.callbacks, self.control]
                         if isinstance(cb, ExportableState)]:
            name = callback.__class__.__name__
            if isinstance(saved[name], list):
                saved[name].append(callback.state())
            else:
                saved[name] = callback.state()
        step = self.state.global_step
        per_step = (self._train_batch_size * self.args.gradient_accumulation_steps
                    * self.args.world_size)
        train_state = cp.TrainState(
            step=step, consumed_train_samples=step * per_step,
            floating_point_operations_so_far=float(self.state.total_flos),
            extra={TRAINER_STATE_KEY: trainer_state_to_plain(self.state),
                   "epoch": float(self.state.epoch or 0.0)})
        self._ckpt_last = self.checkpoint_pipeline.save(step, self._checkpoint_state(),
                                                        train_state)


class PipelineTrainer(PipelineTrainerMixin, Trainer):
    """``transformers.Trainer`` checkpointing through ``ckpt_pipeline`` (see the module)."""


class PipelineCallback(TrainerCallback):
    """Save-only: saves model, optimizer and scheduler through a pipeline at every save a
    stock ``Trainer`` makes (``on_save``, after its own ``checkpoint-N``), for exporting or
    inspecting with ``cp.load``.

    It does not resume a ``Trainer`` (the ``Trainer`` loads only its own directories) and it
    does not replace the stock checkpoint: for both, use ``PipelineTrainer``. The pipeline is
    yours to open and close; ``on_pre_optimizer_step`` calls its ``wait_snapshot()``.
    """

    def __init__(self, pipeline: cp.CheckpointPipeline) -> None:
        self.pipeline = pipeline

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kwargs: Any) -> None:
        self.pipeline.wait_snapshot()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        saved = {name: kwargs[key] for name, key in (
            ("model", "model"), ("optimizer", "optimizer"), ("scheduler", "lr_scheduler"))
            if kwargs.get(key) is not None}
        self.pipeline.save(state.global_step, saved, cp.TrainState(
            step=state.global_step, extra={TRAINER_STATE_KEY: trainer_state_to_plain(state)}))
