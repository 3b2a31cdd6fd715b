"""Checkpoint an ``accelerate.Accelerator``'s prepared objects through a ``CheckpointPipeline``.

``accelerator.save_state(dir)`` writes everything on the training thread. :func:`save_state`
hands the same objects to ``pipe.save`` instead and returns its ``SaveHandle`` at once; the
writes, the fsyncs and (with ``torch.distributed`` initialised) the commit agreed by every rank
run in the background. :func:`load_state` restores them in place. Saved and restored together:

- the prepared models (unwrapped from DDP and ``torch.compile``, so a checkpoint of one process
  loads on several and back; FSDP2 shards as DTensors), optimizers, LR schedulers and the
  gradient scaler;
- ``accelerator.step`` and the objects given to ``accelerator.register_for_checkpointing``;
- each prepared data loader's position: its epoch (``iteration``), the shuffling generator's
  state, a ``SeedableRandomSampler``'s seed and epoch and, when iterated through a
  :class:`ResumableLoader`, the batches consumed in the epoch, which the next epoch skips with
  ``accelerator.skip_first_batches``. A loader iterated directly is exact only when saved
  between epochs;
- the RNG states of Python, NumPy and torch (the pipeline's ``TrainState``).

Hooks cannot redirect the saves of FSDP, hence helpers rather than ``register_save_state_pre_hook``.
A save copies CPU tensors before it returns and queues CUDA copies: call ``pipe.wait_snapshot()``
before ``optimizer.step()`` (or :func:`step_after_snapshot`).

Call order, every rank the same: ``accelerator.prepare(...)``, ``register_for_checkpointing``,
:class:`ResumableLoader` for each loader, :func:`load_state` once, then per step
``wait_snapshot`` before the optimizer and :func:`save_state` after it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

import ckpt_pipeline as cp

__all__ = ("NotCheckpointableError", "ResumableLoader", "accelerator_state", "load_state",
           "save_state", "step_after_snapshot")

_UNSUPPORTED = ("DEEPSPEED", "MEGATRON_LM", "XLA")


class NotCheckpointableError(cp.StateError):
    """An object of the accelerator (a registered one, a setup) cannot be saved by the pipeline."""


class ResumableLoader:
    """Iterate a prepared data loader through this to make its position part of a checkpoint.

    Each ``iter()`` is one epoch of ``loader``. It counts the batches it yields
    (``batches_in_epoch``) and keeps the shuffling generator's state from the epoch's start;
    after :func:`load_state`, the next epoch starts at the saved batch through
    ``accelerator.skip_first_batches``. ``epoch`` is the loader's epoch (``loader.iteration``):
    ``for epoch in range(resumable.epoch, epochs): for batch in resumable: ...``.
    """

    def __init__(self, accelerator: Any, loader: Any) -> None:
        if not any(loader is prepared for prepared in accelerator._dataloaders):
            raise cp.ConfigError("ResumableLoader needs a data loader that the accelerator "
                                 "prepared", hint="pass what accelerator.prepare() returned")
        self.accelerator = accelerator
        self.loader = loader
        self.batches_in_epoch = 0
        """Batches of the current epoch yielded (or skipped on resume) so far."""
        self._epoch_start_rng: torch.Tensor | None = None
        self._skip = 0
        _RESUMABLE[loader] = self

    @property
    def epoch(self) -> int:
        """The loader's epoch: the number of epochs it has finished."""
        return int(getattr(self.loader, "iteration", 0))

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader
        generator = _generator(loader)
        skip, self._skip = self._skip, 0
        self._epoch_start_rng = None if generator is None else generator.get_state()
        self.batches_in_epoch = skip
        iteration = self.epoch
        source = self.accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in source:
            self.batches_in_epoch += 1
            yield batch
        if source is not loader:  # the epoch ran in the copy that skipped batches
            loader.iteration = iteration + 1
        self._epoch_start_rng = None
        self.batches_in_epoch = 0

    def _position(self) -> tuple[int, torch.Tensor | None]:
        """Batches consumed in the epoch, and the generator state that replays it."""
        if self._skip or self._epoch_start_rng is None:
            generator = _generator(self.loader)
            return self._skip, None if generator is None else generator.get_state()
        return self.batches_in_epoch, self._epoch_start_rng

    def _resume_at(self, batches: int) -> None:
        self._skip = batches
        self._epoch_start_rng = None
        self.batches_in_epoch = 0


_RESUMABLE: weakref.WeakKeyDictionary[Any, ResumableLoader] = weakref.WeakKeyDictionary()


def _generator(loader: Any) -> torch.Generator | None:
    """The generator that shuffles ``loader``: the one Accelerate synchronises across ranks,
    else the sampler's, else the loader's."""
    from accelerate.data_loader import get_sampler  # type: ignore[import-untyped]

    candidates = (getattr(loader, "synchronized_generator", None),
                  getattr(get_sampler(loader), "generator", None),
                  getattr(loader, "generator", None))
    return next((g for g in candidates if isinstance(g, torch.Generator)), None)


class _LoaderPosition:
    """A prepared data loader's place in the data stream, as the pipeline saves an object."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        loader = self.loader
        resumable = _RESUMABLE.get(loader)
        if resumable is not None:
            batches, rng = resumable._position()
        else:
            generator = _generator(loader)
            batches, rng = 0, None if generator is None else generator.get_state()
        from accelerate.data_loader import get_sampler

        sampler = get_sampler(loader)
        state: dict[str, Any] = {
            "iteration": int(getattr(loader, "iteration", 0)),
            "batches_in_epoch": batches,
            "exact": resumable is not None,
            "generator": rng,
            "sampler_seed": getattr(sampler, "initial_seed", None),
            "sampler_epoch": getattr(sampler, "epoch", None),
            "loader": loader.state_dict() if getattr(loader, "use_stateful_dataloader",
                                                     False) else None,
        }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        loader = self.loader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(int(state["iteration"]))
        generator = _generator(loader)
        if generator is not None and state["generator"] is not None:
            # A copy: restored small tensors are views into one packed storage, and
            # Generator.set_state crashes the process on a view with a storage offset.
            generator.set_state(state["generator"].to(torch.uint8).clone())
        from accelerate.data_loader import get_sampler

        sampler = get_sampler(loader)
        if state["sampler_seed"] is not None and hasattr(sampler, "initial_seed"):
            sampler.initial_seed = state["sampler_seed"]
            sampler.epoch = state["sampler_epoch"]
        if state["loader"] is not None:
            loader.load_state_dict(state["loader"])
        resumable = _RESUMABLE.get(loader)
        if resumable is not None:
            resumable._resume_at(0 if state["loader"] is not None
                                 else int(state["batches_in_epoch"]))


class _Counters:
    """The accelerator's own counters (``step``, the gradient accumulation's)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


def accelerator_state(accelerator: Any) -> dict[str, Any]:
    """The state that :func:`save_state` saves and :func:`load_state` restores, by name:
    ``models``, ``optimizers``, ``schedulers``, ``dataloaders`` and ``custom`` (each keyed by
    its index in the accelerator, as Accelerate numbers its files), ``accelerator``, and
    ``scaler`` when there is one."""
    kind = str(getattr(accelerator.distributed_type, "name", accelerator.distributed_type))
    if kind in _UNSUPPORTED or (kind == "FSDP" and not accelerator.is_fsdp2):
        raise NotCheckpointableError(
            f"the pipeline cannot save the state of a {kind} accelerator",
            hint="use FSDP2 (fsdp_version=2), DDP or one process, or accelerator.save_state")
    custom: dict[str, Any] = {}
    for index, obj in enumerate(accelerator._custom_objects):
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise NotCheckpointableError(
                f"registered object {index} ({type(obj).__module__}.{type(obj).__qualname__}) "
                "has no state_dict() and load_state_dict()", path=f"custom/{index}",
                hint="give it both methods, or do not register it for checkpointing")
        custom[str(index)] = obj
    state: dict[str, Any] = {
        "models": {str(i): accelerator.unwrap_model(m, keep_torch_compile=False)
                   for i, m in enumerate(accelerator._models)},
        "optimizers": {str(i): getattr(o, "optimizer", o)
                       for i, o in enumerate(accelerator._optimizers)},
        "schedulers": {str(i): getattr(s, "scheduler", s)
                       for i, s in enumerate(accelerator._schedulers)},
        "dataloaders": {str(i): _LoaderPosition(d)
                        for i, d in enumerate(accelerator._dataloaders)},
        "custom": custom,
        "accelerator": _Counters(accelerator),
    }
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    return state


def save_state(accelerator: Any, pipe: cp.CheckpointPipeline, step: int, *,
               train_state: cp.TrainState | None = None,
               extra: Mapping[str, Any] | None = None) -> cp.SaveHandle:
    """Save the accelerator's state at ``step`` through ``pipe``; returns its handle at once.

    ``extra`` adds your own entries (an EMA model, ...) beside the accelerator's. Every rank
    calls it with the same step. NotCheckpointableError, before anything is written, for an
    object or a setup the pipeline cannot save.
    """
    state = accelerator_state(accelerator)
    state.update(extra or {})
    return pipe.save(step, state, train_state)


def load_state(accelerator: Any, pipe: cp.CheckpointPipeline, *, step: int | None = None,
               extra: Mapping[str, Any] | None = None, restore_rng: bool | None = None,
               missing: cp.Missing = "refuse") -> cp.RestoreResult | None:
    """Restore the newest complete step (or ``step``) into the accelerator's objects in place.

    None when there is nothing to restore. The data loaders wrapped in a
    :class:`ResumableLoader` continue their next epoch at the saved batch. ``extra`` must
    name the entries given to :func:`save_state`; ``restore_rng`` and ``missing`` are the
    pipeline's (``CheckpointPipeline.restore_latest``).
    """
    state = accelerator_state(accelerator)
    state.update(extra or {})
    if step is None:
        return pipe.restore_latest(state, restore_rng=restore_rng, missing=missing)
    return pipe.restore(state, step, restore_rng=restore_rng, missing=missing)


def step_after_snapshot(pipe: cp.CheckpointPipeline, *optimizers: Any) -> None:
    """``pipe.wait_snapshot()``, then ``step()`` each optimizer: the order a save needs."""
    pipe.wait_snapshot()
    for optimizer in optimizers:
        optimizer.step()
