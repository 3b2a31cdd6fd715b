"""PyTorch Lightning checkpoints through a ``CheckpointPipeline``.

Two pieces, used together::

    io = PipelineCheckpointIO("checkpoints/run")
    trainer = Trainer(plugins=[io], callbacks=[io.callback(), ModelCheckpoint(
        every_n_train_steps=50, save_top_k=3)])
    trainer.fit(model, ckpt_path=io.latest())      # None on the first run: starts fresh

- :class:`PipelineCheckpointIO`, Lightning's ``CheckpointIO``: every ``save_checkpoint``
  (``trainer.save_checkpoint``, ``ModelCheckpoint``) hands the checkpoint dict to the pipeline
  as step ``checkpoint["global_step"]`` and returns once its tensors are copied (CPU) or their
  copies queued (CUDA); hashing, writing and the commit run in the background. The file name
  Lightning asks for is not written: it names the step (``load_checkpoint`` of that name, or
  of any name with ``step=N`` in it, loads step N; ``latest()`` names the newest committed one).
- :class:`PipelineCheckpointCallback` (``io.callback()``): ``pipe.wait_snapshot()`` before
  every optimizer step, the monitored metrics recorded with each save (for ``KeepBest``), and
  ``ModelCheckpoint(save_top_k=K)`` translated into the pipeline's retention.

Single device and DDP: Lightning's strategies call ``save_checkpoint`` on global rank 0 only.
That is right for DDP, whose replicas are identical: rank 0's pipeline saves alone (a
``LocalCoordinator``, never a collective with ranks that do not call it), and every rank loads
that root on resume, so under DDP ``root`` must be on a file system every rank sees. Sharded
strategies (FSDP, ModelParallelStrategy) need every rank to save and are not covered here.

No pickle: the checkpoint is stored as tensors and msgpack-able plain values. Lightning's own
entries (``loops``, ``callbacks``, ``hyper_parameters``, ``optimizer_states``,
``lr_schedulers``, precision and datamodule states) come back as they were: tuples as tuples,
``AttributeDict`` hyper-parameters as ``AttributeDict``, ``state_dict`` as an ``OrderedDict``
with its ``_metadata``. Anything else (an arbitrary object among the hyper-parameters, a
callback state holding a ``Path``) is refused with a ``StateError`` naming its key path;
``exclude=`` leaves such entries out and ``convert=`` turns them into plain values.
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO
from typing_extensions import Unpack, override

import ckpt_pipeline as cp
from ckpt_pipeline.config import PipelineOptions
from ckpt_pipeline.loading import newest_candidates

__all__ = (
    "PipelineCheckpointCallback",
    "PipelineCheckpointIO",
    "decode_checkpoint",
    "encode_checkpoint",
    "retention_for",
)

Converter = Callable[[str, Any], Any]
"""``convert(key_path, value)``: a plain replacement for a value the pipeline cannot store."""

_TYPES_KEY = "ckpt_pipeline.lightning"
"""The top-level entry recording which containers come back as Lightning's own types."""

_STEP_IN_NAME = re.compile(r"(?:^|[^A-Za-z0-9])step=(\d+)")


class _Unstorable:
    """Marks a value that the walk could not store (the caller decides what to say)."""


_UNSTORABLE = _Unstorable()


def encode_checkpoint(checkpoint: Mapping[str, Any], *, exclude: Iterable[str] = (),
                      convert: Converter | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict as the pipeline stores it: tensors and plain values only.

    ``exclude``: key paths (``"hyper_parameters/encoder"``, keys joined by ``/``) left out.
    ``convert``: called with the key path and the value for anything not storable; returns a
    plain replacement. Raises ``cp.StateError`` naming the key path of a value that stays
    unstorable. ``decode_checkpoint`` undoes it.
    """
    excluded = frozenset(exclude)
    attribute_dicts: list[list[str | int]] = []
    ordered: list[list[Any]] = []
    step = checkpoint.get("global_step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None

    def refuse(path: str, value: Any, why: str) -> cp.StateError:
        return cp.StateError(
            f"checkpoint entry {path!r} {why}; the pipeline stores tensors, None, bool, int, "
            f"float, str, bytes and dicts, lists and tuples of them (no pickle)", step=step,
            path=path,
            hint=f"leave it out with PipelineCheckpointIO(..., exclude=[{path!r}]), or turn it "
                 f"into plain values with convert=lambda path, value: ... (given {path!r} and "
                 f"the {type(value).__qualname__})")

    def walk(value: Any, keys: list[str | int], converted: bool) -> Any:
        path = "/".join(str(k) for k in keys)
        if isinstance(value, torch.Tensor):
            return value
        if value is None or isinstance(value, (bool, str, bytes)):
            return value
        if isinstance(value, float) or (isinstance(value, int) and type(value) in (int, bool)):
            return value
        kind = type(value)
        if kind in (dict, OrderedDict, AttributeDict):
            out: dict[str | int, Any] = {}
            for key, item in value.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise refuse(path or "<top level>", value,
                                 f"has the key {key!r} of type {type(key).__qualname__} "
                                 "(keys must be str or int)")
                sub = [*keys, key]
                if "/".join(str(k) for k in sub) in excluded:
                    continue
                out[key] = walk(item, sub, False)
            if kind is AttributeDict:
                attribute_dicts.append(keys)
            elif kind is OrderedDict:
                metadata = getattr(value, "_metadata", None)
                ordered.append([keys, None if metadata is None else
                                walk(dict(metadata), [*keys, "_metadata"], False)])
            return out
        if kind is list:
            return [walk(item, [*keys, i], False) for i, item in enumerate(value)]
        if kind is tuple:
            return tuple(walk(item, [*keys, i], False) for i, item in enumerate(value))
        if kind.__module__ == "numpy" and getattr(value, "ndim", None) == 0:
            return walk(value.item(), keys, converted)
        if convert is not None and not converted:
            replacement = convert(path, value)
            if replacement is not value:
                return walk(replacement, keys, True)
        why = (f"holds the {kind.__module__}.{kind.__qualname__} that convert= returned"
               if converted else f"holds a {kind.__module__}.{kind.__qualname__}")
        raise refuse(path, value, why)

    for name in checkpoint:
        if not isinstance(name, str):
            raise refuse(repr(name), name, "is a top-level key that is not a string")
    encoded: dict[str, Any] = walk(dict(checkpoint), [], False)
    encoded[_TYPES_KEY] = {"attribute_dicts": attribute_dicts, "ordered_dicts": ordered}
    return encoded


def decode_checkpoint(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint dict Lightning saved, from what ``cp.load`` read (``encode_checkpoint``
    undone: ``AttributeDict`` and ``OrderedDict`` with ``_metadata`` where they were)."""
    checkpoint = dict(tree)
    types = checkpoint.pop(_TYPES_KEY, None) or {}

    def replace(keys: Sequence[str | int], make: Callable[[Any], Any]) -> None:
        if not keys:
            return
        parent: Any = checkpoint
        for key in keys[:-1]:
            parent = parent[key]
        parent[keys[-1]] = make(parent[keys[-1]])

    for keys, metadata in types.get("ordered_dicts", ()):
        def ordered(value: Any, metadata: Any = metadata) -> OrderedDict[Any, Any]:
            result: OrderedDict[Any, Any] = OrderedDict(value)
            if metadata is not None:
                result._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
            return result
        replace(keys, ordered)
    for keys in types.get("attribute_dicts", ()):
        replace(keys, AttributeDict)
    return checkpoint


def retention_for(callbacks: Iterable[Callback]) -> list[cp.RetentionPolicy] | None:
    """The retention that keeps what these ``ModelCheckpoint`` callbacks would keep.

    ``save_top_k=K`` without ``monitor``: ``KeepLast(K)``; with ``monitor``:
    ``KeepBest(K, metric=monitor, mode=mode)`` (the metric is recorded with each save by
    ``PipelineCheckpointCallback``); ``save_top_k=-1``: every step (``KeepEvery(1)``).
    None when there is no ``ModelCheckpoint`` that saves (the pipeline's default applies).
    The newest committed step is always kept, which covers ``save_last``.
    """
    policies: list[cp.RetentionPolicy] = []
    for callback in callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.save_top_k == 0:
            continue
        top_k = callback.save_top_k
        if top_k < 0:
            policies.append(cp.KeepEvery(1))
        elif callback.monitor is None:
            policies.append(cp.KeepLast(top_k))
        else:
            if callback.mode == "max":
                policies.append(cp.KeepBest(top_k, metric=callback.monitor, mode="max"))
            else:
                policies.append(cp.KeepBest(top_k, metric=callback.monitor, mode="min"))
    return policies or None


class PipelineCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` over a ``CheckpointPipeline`` rooted at ``root``.

    ``options`` go to the pipeline (``keep_last``, ``retention``, ``buffer_slots``, ...); without
    ``keep_last`` or ``retention``, ``io.callback()`` takes the retention from the trainer's
    ``ModelCheckpoint`` (``retention_for``). ``exclude`` and ``convert``: see
    ``encode_checkpoint``. The RNG states captured at each save are applied when its checkpoint
    is loaded (Lightning itself saves none), unless ``restore_rng=False``. The pipeline opens at the first
    save and closes in ``teardown`` (after the saves in flight commit).

    ``remove_checkpoint`` is a no-op: the pipeline's retention prunes committed steps once a
    newer one is committed, never a step in flight and never the newest, so a removal never
    races a save. Two saves at the same ``global_step`` (``save_last`` right after the top-k
    save) store the step once; the second name is another name of it.
    """

    def __init__(self, root: str | os.PathLike[str], *, exclude: Iterable[str] = (),
                 convert: Converter | None = None, exit_timeout_s: float | None = 300.0,
                 **options: Unpack[PipelineOptions]) -> None:
        super().__init__()
        self.root = os.path.abspath(os.fspath(root))
        self.exclude = tuple(exclude)
        self.convert = convert
        self._exit_timeout_s = exit_timeout_s
        self._options = options
        self._pipe: cp.CheckpointPipeline | None = None
        self._steps_by_path: dict[str, int] = {}
        self._last_step: int | None = None
        self._metrics: dict[str, float] = {}

    def callback(self) -> PipelineCheckpointCallback:
        """The callback to pass beside this plugin: ``Trainer(plugins=[io],
        callbacks=[io.callback()])``."""
        return PipelineCheckpointCallback(self)

    @property
    def pipeline(self) -> cp.CheckpointPipeline:
        """The pipeline, opened on first use."""
        if self._pipe is None:
            self._pipe = cp.CheckpointPipeline(
                self.root, coordinator=cp.LocalCoordinator(), sigterm="off",
                exit_timeout_s=self._exit_timeout_s, **self._options).open()
            self._last_step = self._pipe.latest_step()
        return self._pipe

    def adopt_retention(self, callbacks: Iterable[Callback]) -> None:
        """Take the retention from ``ModelCheckpoint`` callbacks, unless ``keep_last`` or
        ``retention`` was given; ConfigError once the pipeline is open with another one."""
        if "keep_last" in self._options or "retention" in self._options:
            return
        policies = retention_for(callbacks)
        if policies is None:
            return
        if self._pipe is not None:
            raise cp.ConfigError(
                "the pipeline is already open, so the retention of ModelCheckpoint cannot be "
                "adopted", path=self.root,
                hint="give retention= (e.g. retention_for(trainer.checkpoint_callbacks)) to "
                     "PipelineCheckpointIO, or let the first fit open it")
        self._options["retention"] = policies

    def record_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Values to store in the next save's ``TrainState.extra`` (real numbers only)."""
        recorded: dict[str, float] = {}
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                value = value.item()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                    math.isfinite(value)):
                recorded[name] = float(value)
        self._metrics = recorded

    def wait_snapshot(self) -> None:
        """Before an in-place update of saved tensors: the copies of a save in flight are done
        (a GPU-side wait on CUDA; returns at once when nothing is open or copying)."""
        if self._pipe is not None:
            self._pipe.wait_snapshot()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Hand ``checkpoint`` to the pipeline as step ``checkpoint["global_step"]``; returns
        once its tensors are copied or their copies queued. Bad input raises here."""
        if storage_options is not None:
            raise cp.ConfigError("storage_options is not supported by PipelineCheckpointIO",
                                 path=self.root, hint="configure the pipeline through "
                                 "PipelineCheckpointIO(root, **options) instead")
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise cp.StateError(f"checkpoint['global_step'] is {step!r}, not a step number",
                                path=os.fspath(path),
                                hint="save through Trainer.save_checkpoint or ModelCheckpoint")
        name = os.path.abspath(os.fspath(path))
        pipe = self.pipeline
        if step == self._last_step:  # e.g. save_last right after the top-k save
            self._steps_by_path[name] = step
            return
        state = encode_checkpoint(checkpoint, exclude=self.exclude, convert=self.convert)
        train_state = cp.TrainState(step=step, extra=self._metrics)
        pipe.save(step, state, train_state)
        self._steps_by_path[name] = step
        self._last_step = step

    def step_of(self, path: Any) -> int | None:
        """The step a checkpoint path names: one this plugin saved under that name, or
        ``step=N`` in its name; None for the root itself (the newest committed step)."""
        name = os.path.abspath(os.fspath(path))
        if name == self.root:
            return None
        if name in self._steps_by_path:
            return self._steps_by_path[name]
        match = _STEP_IN_NAME.search(os.path.basename(name))
        if match is None:
            raise cp.CheckpointError(
                f"cannot tell which step {name} names", path=name,
                hint="pass io.latest(), the root, or a name with step=N in it")
        return int(match.group(1))

    def committed_steps(self) -> list[int]:
        """The committed steps under ``root``, oldest first (waits for saves in flight)."""
        if self._pipe is not None:
            self._pipe.wait()
        if not os.path.isdir(self.root):
            return []
        return sorted(newest_candidates(cp.LocalStorage(self.root), 0))

    def latest(self) -> str | None:
        """The name of the newest committed step, for ``trainer.fit(ckpt_path=io.latest())``;
        None when nothing is committed (the fit starts fresh)."""
        steps = self.committed_steps()
        return os.path.join(self.root, f"step={steps[-1]}") if steps else None

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict of the step ``path`` names (see ``step_of``), read and verified
        by the pipeline; only committed steps are read. For the newest step, a step that does
        not verify is reported and the next older one is loaded. ``map_location``: a device
        or its name (anything else loads to the CPU)."""
        step = self.step_of(path)
        if self._pipe is not None:
            self._pipe.wait()
        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        if step is not None:
            loaded = cp.load(self.root, step, map_location=device)
        else:
            loaded = self._load_newest(device)
        if self._options.get("restore_rng", True) and loaded.train_state.rng is not None:
            loaded.train_state.rng.apply()
        return decode_checkpoint(loaded.tree)

    def _load_newest(self, device: str | torch.device) -> cp.LoadedCheckpoint:
        steps = self.committed_steps()
        if not steps:
            raise FileNotFoundError(f"no committed checkpoint under {self.root}")
        failures: list[cp.CheckpointIntegrityError] = []
        for step in reversed(steps):
            try:
                return cp.load(self.root, step, map_location=device)
            except cp.CheckpointIntegrityError as exc:
                failures.append(exc)
        raise failures[0]

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """A no-op: retention prunes, after the commit of a newer step (see the class)."""

    @override
    def teardown(self) -> None:
        """Wait for the saves in flight to commit, then close the pipeline (it reopens at the
        next save)."""
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            try:
                pipe.wait()
            finally:
                pipe.close()


class PipelineCheckpointCallback(Callback):
    """The training-loop side of ``PipelineCheckpointIO``: ``wait_snapshot`` before every
    optimizer step, the metrics recorded with each save, the retention taken from the
    trainer's ``ModelCheckpoint`` callbacks at ``setup``."""

    def __init__(self, io: PipelineCheckpointIO) -> None:
        self.io = io

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.strategy.checkpoint_io is not self.io:
            raise cp.ConfigError(
                "the trainer does not checkpoint through this callback's PipelineCheckpointIO",
                path=self.io.root, hint="pass the same object: Trainer(plugins=[io], "
                                        "callbacks=[io.callback()])")
        self.io.adopt_retention(trainer.checkpoint_callbacks)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.io.wait_snapshot()

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self.io.record_metrics(trainer.callback_metrics)
