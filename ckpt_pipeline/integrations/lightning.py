"""PyTorch Lightning checkpoints through a ``CheckpointPipeline``.

For single-device and DDP training, two pieces, used together::

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
that root on resume, so under DDP ``root`` must be on a file system every rank sees.

Sharded training (FSDP2 and tensor parallelism) needs every rank to save its own shard, and
``ModelParallelStrategy`` bypasses ``CheckpointIO``: :class:`PipelineModelParallelStrategy`
is that strategy with a pipeline on every rank, agreeing over ``torch.distributed``::

    strategy = PipelineModelParallelStrategy("checkpoints/run")
    trainer = Trainer(strategy=strategy, callbacks=[ModelCheckpoint(every_n_train_steps=50)])
    trainer.fit(model, ckpt_path=strategy.latest())

It saves the model and optimizer states as the live sharded DTensors, waits for the snapshot
between backward and the optimizer's update by itself (no callback), and loads a step into
the model and optimizers in place on every rank.

The encoding of the checkpoint dict (``encode_checkpoint``, ``decode_checkpoint``) and
``retention_for`` live in ``_lightning_encoding.py``; this module re-exports them.

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
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.constants import default_pg_timeout
from typing_extensions import Unpack, override

import ckpt_pipeline as cp
from ckpt_pipeline.config import PipelineOptions
from ckpt_pipeline.loading import newest_candidates

from ._lightning_encoding import Converter as Converter
from ._lightning_encoding import decode_checkpoint as decode_checkpoint
from ._lightning_encoding import encode_checkpoint as encode_checkpoint
from ._lightning_encoding import retention_for as retention_for

__all__ = (
    "PipelineCheckpointCallback",
    "PipelineCheckpointIO",
    "PipelineModelParallelStrategy",
    "decode_checkpoint",
    "encode_checkpoint",
    "retention_for",
)

_STEP_IN_NAME = re.compile(r"(?:^|[^A-Za-z0-9])step=(\d+)")


def _step_named(path: Any, root: str, named: Mapping[str, int]) -> int | None:
    """The step a checkpoint path names: the one saved under that name (``named``), or ``step=N``
    in its name; None for ``root`` itself (the newest committed step)."""
    name = os.path.abspath(os.fspath(path))
    if name == root:
        return None
    if name in named:
        return named[name]
    match = _STEP_IN_NAME.search(os.path.basename(name))
    if match is None:
        raise cp.ConfigError(
            f"cannot tell which step {name} names", path=name,
            hint="pass latest(), the root, or a name with step=N in it")
    return int(match.group(1))


def _committed_steps(root: str, rank: int) -> list[int]:
    """The steps ``rank`` committed under ``root``, oldest first (none when there is no root)."""
    if not os.path.isdir(root):
        return []
    return sorted(newest_candidates(cp.LocalStorage(root), rank))


def _latest_name(root: str, steps: list[int]) -> str | None:
    """The name of the newest of ``steps`` (``load_checkpoint`` of it loads that step)."""
    return os.path.join(root, f"step={steps[-1]}") if steps else None


def _step_to_save(checkpoint: Mapping[str, Any], path: Any) -> int:
    """``checkpoint["global_step"]``, checked to be a step number."""
    step = checkpoint.get("global_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise cp.StateError(f"checkpoint['global_step'] is {step!r}, not a step number",
                            path=os.fspath(path),
                            hint="save through Trainer.save_checkpoint or ModelCheckpoint")
    return step


def _refuse_storage_options(storage_options: Any, owner: str, root: str) -> None:
    """ConfigError for ``storage_options``: the pipeline's options are given at construction."""
    if storage_options is not None:
        raise cp.ConfigError(f"storage_options is not supported by {owner}", path=root,
                             hint=f"configure the pipeline through {owner}(root, **options) "
                                  "instead")


def _adopt_retention(options: PipelineOptions, callbacks: Iterable[Callback], is_open: bool,
                     owner: str, root: str) -> None:
    """Set ``options["retention"]`` to what the ``ModelCheckpoint`` callbacks keep, unless
    ``keep_last`` or ``retention`` was given; ConfigError once the pipeline is open."""
    if "keep_last" in options or "retention" in options:
        return
    policies = retention_for(callbacks)
    if policies is None:
        return
    if is_open:
        raise cp.ConfigError(
            "the pipeline is already open, so the retention of ModelCheckpoint cannot be "
            "adopted", path=root,
            hint=f"give retention= (e.g. retention_for(trainer.checkpoint_callbacks)) to "
                 f"{owner}, or let the first fit open it")
    options["retention"] = policies


def _real_metrics(metrics: Mapping[str, Any], options: PipelineOptions) -> dict[str, float]:
    """The values among ``metrics`` that the retention of ``options`` ranks steps by
    (``KeepBest``), those that are finite real numbers (one-element tensors too), as floats:
    what a save records in ``TrainState.extra``. Only those are read, since reading a CUDA
    tensor's value waits for the GPU on the training thread."""
    retention = {key: options[key] for key in ("keep_last", "retention")
                 if key in options}
    wanted = cp.PipelineConfig(**retention).retention_metrics  # type: ignore[arg-type]
    recorded: dict[str, float] = {}
    for name in wanted:
        value = metrics.get(name)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                math.isfinite(value)):
            recorded[name] = float(value)
    return recorded


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
        _adopt_retention(self._options, callbacks, self._pipe is not None,
                         "PipelineCheckpointIO", self.root)

    def record_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Store in the next save's ``TrainState.extra`` the values of ``metrics`` that the
        retention ranks steps by (``KeepBest``: a monitored ``ModelCheckpoint``); others are
        not read."""
        self._metrics = _real_metrics(metrics, self._options)

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
        _refuse_storage_options(storage_options, "PipelineCheckpointIO", self.root)
        step = _step_to_save(checkpoint, path)
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
        return _step_named(path, self.root, self._steps_by_path)

    def committed_steps(self) -> list[int]:
        """The committed steps under ``root``, oldest first (waits for saves in flight)."""
        if self._pipe is not None:
            self._pipe.wait()
        return _committed_steps(self.root, 0)

    def latest(self) -> str | None:
        """The name of the newest committed step, for ``trainer.fit(ckpt_path=io.latest())``;
        None when nothing is committed (the fit starts fresh)."""
        return _latest_name(self.root, self.committed_steps())

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
    trainer's ``ModelCheckpoint`` callbacks at ``setup``, and at the end of a fit every rank
    waits for rank 0's saves to commit."""

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

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Under DDP only rank 0 saves, and nothing else waits for its commits: every rank
        waits here until they are committed, so that once ``fit`` returns ``io.latest()``
        names the same step on every rank (a no-op on one device; not called when the fit
        raises)."""
        self.io.committed_steps()  # waits for the saves in flight (rank 0)
        trainer.strategy.barrier("PipelineCheckpointCallback.on_fit_end")


class _ShardedOptimizerState:
    """An optimizer as ``PipelineModelParallelStrategy`` stores it: ``get_optimizer_state_dict``
    (parameters named by their FQN, moments as the live sharded DTensors), loaded back through
    ``set_optimizer_state_dict``; a restore walks it as it walks any object with
    ``state_dict()``/``load_state_dict()``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint import state_dict as dcp

        state: dict[str, Any] = dcp.get_optimizer_state_dict(
            self.model, self.optimizer, options=dcp.StateDictOptions())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint import state_dict as dcp

        dcp.set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state_dict,
                                     options=dcp.StateDictOptions())


class PipelineModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism) checkpointing through a
    ``CheckpointPipeline`` rooted at ``root`` on every rank::

        strategy = PipelineModelParallelStrategy("checkpoints/run", data_parallel_size=8,
                                                 tensor_parallel_size=1)
        trainer = Trainer(strategy=strategy, callbacks=[ModelCheckpoint(
            every_n_train_steps=50, save_top_k=3)])
        trainer.fit(model, ckpt_path=strategy.latest())   # None on the first run

    Every rank saves its own shard into ``root`` (one path for the job: a file system the ranks
    share, or the same path on each node's disk), and the pipelines agree over
    ``torch.distributed``: a step is committed once every rank's shard is durable.

    - ``save_checkpoint`` (``trainer.save_checkpoint``, ``ModelCheckpoint``), on every rank:
      step ``checkpoint["global_step"]``; the model and optimizer states as the live sharded
      DTensors (no full state dict, no copy to the CPU in the training thread: the pipeline
      copies them), the rest of Lightning's dict through ``encode_checkpoint`` (``exclude`` and
      ``convert`` as there). It returns once the tensors are copied (CPU) or their copies
      queued (CUDA). A second save at a step already saved (``save_last`` right after the
      top-k save) stores nothing new; its name becomes another name of the step.
    - ``optimizer_step``: ``wait_snapshot()`` once the closure (forward and backward) has run,
      before the optimizer updates the parameters and its moments in place.
    - ``load_checkpoint`` (``trainer.fit(ckpt_path=...)``), on every rank after the model and
      optimizers are set up: loads the step the path names (``latest()``, any name with
      ``step=N`` in it, or the root itself for the newest step every rank holds, falling back
      together past a damaged one) into the model and optimizers in place, applies the RNG
      states saved with it (unless ``restore_rng=False``), and returns the rest of the
      checkpoint for Lightning to restore (loops, callbacks, schedulers, precision). Only
      committed steps are loaded, the same on every rank; steps newer than a loaded older one
      are moved aside, so that the run goes on from it. A step saved by another number of
      ranks (a root the ranks share) is resharded onto this job; the RNG states are then not
      restored.
    - Retention: ``keep_last`` or ``retention`` among ``options``, else what the trainer's
      ``ModelCheckpoint(save_top_k=...)`` would keep (``retention_for``; the logged metrics
      are recorded with each save for a monitored one). ``remove_checkpoint`` removes nothing:
      the pipeline prunes a step once a newer one is committed.
    - ``teardown`` waits for the saves in flight to commit and closes the pipeline (it opens
      again at the next save or load).

    ``data_parallel_size``, ``tensor_parallel_size``, ``process_group_backend`` and ``timeout``
    are ``ModelParallelStrategy``'s; ``options`` go to the pipeline
    (``coordination_timeout_s``, ``buffer_slots``, ...).
    """

    def __init__(self, root: str | os.PathLike[str], *,
                 data_parallel_size: Literal["auto"] | int = "auto",
                 tensor_parallel_size: Literal["auto"] | int = "auto",
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 exclude: Iterable[str] = (), convert: Converter | None = None,
                 exit_timeout_s: float | None = 300.0,
                 **options: Unpack[PipelineOptions]) -> None:
        super().__init__(data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.root = os.path.abspath(os.fspath(root))
        self.exclude = tuple(exclude)
        self.convert = convert
        self._exit_timeout_s = exit_timeout_s
        self._options = options
        self._pipe: cp.CheckpointPipeline | None = None
        self._steps_by_path: dict[str, int] = {}
        self._last_step: int | None = None
        self._metrics_source: pl.Trainer | None = None

    @property
    def pipeline(self) -> cp.CheckpointPipeline:
        """This rank's pipeline, opened on first use: at a save or load, which every rank
        makes at the same point (opening is a collective of the default process group)."""
        if self._pipe is None:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise cp.ConfigError(
                    "PipelineModelParallelStrategy saves and loads on every rank, and "
                    "torch.distributed is not initialized", path=self.root,
                    hint="save and load through the Trainer that uses this strategy "
                         "(trainer.fit, trainer.save_checkpoint)")
            self._pipe = cp.CheckpointPipeline(
                self.root, sigterm="off", exit_timeout_s=self._exit_timeout_s,
                **self._options).open()
            self._last_step = self._pipe.latest_step()
        return self._pipe

    def wait_snapshot(self) -> None:
        """Before an in-place update of saved tensors: the copies of a save in flight are done
        (a GPU-side wait on CUDA; returns at once when nothing is open or copying)."""
        if self._pipe is not None:
            self._pipe.wait_snapshot()

    def committed_steps(self) -> list[int]:
        """The steps this rank committed under ``root``, oldest first (waits for the saves in
        flight, whose commits need every rank)."""
        if self._pipe is not None:
            self._pipe.wait()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        else:  # before the trainer set up the process group: the launcher's environment
            rank = int(os.environ.get("RANK", "0"))
        return _committed_steps(self.root, rank)

    def latest(self) -> str | None:
        """The name of the newest committed step, for ``trainer.fit(ckpt_path=
        strategy.latest())``; None when nothing is committed (the fit starts fresh).

        Every rank must pass a path or none (a rank without one does not load, and the
        others wait for it), and every rank loads the step rank 0 names. So the steps looked
        at are this rank's and rank 0's, as far as this rank sees them: on a root the ranks
        share, a job restarted on more ranks than saved the step (whose new ranks hold no
        step of their own) loads it too, resharded."""
        steps = set(self.committed_steps()) | set(_committed_steps(self.root, 0))
        return _latest_name(self.root, sorted(steps))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        _adopt_retention(self._options, trainer.checkpoint_callbacks, self._pipe is not None,
                         "PipelineModelParallelStrategy", self.root)
        self._metrics_source = trainer  # its logged metrics go with each save

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state as the live sharded DTensors (no CPU copy: the save copies)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        state: dict[str, Any] = get_model_state_dict(self.model, options=StateDictOptions())
        return state

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state by parameter FQN, its moments the live sharded DTensors."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return _ShardedOptimizerState(self.model, optimizer).state_dict()

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None,
                       **kwargs: Any) -> Any:
        """The optimizer's step, with ``wait_snapshot()`` between the closure (forward and
        backward, which Lightning runs inside ``optimizer.step``) and the update."""
        def closure_then_wait_snapshot() -> Any:
            result = closure()
            self.wait_snapshot()
            return result

        return super().optimizer_step(optimizer, closure_then_wait_snapshot, model, **kwargs)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Hand this rank's shard of ``checkpoint`` to the pipeline as step
        ``checkpoint["global_step"]`` (on every rank); returns once its tensors are copied or
        their copies queued. Bad input raises here, before anything is written."""
        _refuse_storage_options(storage_options, "PipelineModelParallelStrategy", self.root)
        step = _step_to_save(checkpoint, filepath)
        name = os.path.abspath(os.fspath(self.broadcast(filepath)))  # rank 0's name
        if self._pipe is None or step != self._last_step:  # else: e.g. save_last after top-k
            rest = {key: value for key, value in checkpoint.items()
                    if key not in ("state_dict", "optimizer_states")}
            state: dict[str, Any] = {  # encoded first: a refusal opens nothing
                "state_dict": checkpoint.get("state_dict", {}),
                "lightning": encode_checkpoint(rest, exclude=self.exclude,
                                               convert=self.convert)}
            if "optimizer_states" in checkpoint:
                state["optimizer_states"] = checkpoint["optimizer_states"]
            pipe = self.pipeline
            if step != self._last_step:  # opening found it committed already otherwise
                metrics = {} if self._metrics_source is None else _real_metrics(
                    self._metrics_source.callback_metrics, self._options)
                pipe.save(step, state, cp.TrainState(step=step, extra=metrics))
                self._last_step = step
        self._steps_by_path[name] = step

    def step_of(self, path: Any) -> int | None:
        """The step a checkpoint path names: one saved under that name, or ``step=N`` in its
        name; None for the root itself (the newest step every rank holds)."""
        return _step_named(path, self.root, self._steps_by_path)

    @override
    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the step rank 0's ``checkpoint_path`` names (see ``step_of``) into the model
        and optimizers in place, on every rank, and return the rest of the checkpoint dict
        (without ``state_dict`` and ``optimizer_states``, which are loaded already)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        path = self.broadcast(checkpoint_path)  # every rank loads the step rank 0 names
        step = self.step_of(path)
        assert self.model is not None
        pipe = self.pipeline
        pipe.wait()  # a save in flight is a candidate, and must commit before a rewind
        model_state: dict[str, Any] = get_model_state_dict(self.model,
                                                           options=StateDictOptions())
        live_keys = set(model_state)
        state: dict[str, Any] = {"state_dict": model_state, "lightning": {}}
        if self.optimizers:  # fitting: loaded too; a weights-only step has none (missing=keep)
            state["optimizer_states"] = [_ShardedOptimizerState(self.model, optimizer)
                                         for optimizer in self.optimizers]
        result = pipe.restore(state, step, missing="keep")
        if result is None:
            raise cp.RestoreError(f"nothing is committed under {self.root}", path=self.root,
                                  hint="start without ckpt_path (strategy.latest() is None "
                                       "then)")
        unexpected = sorted(set(model_state) - live_keys)
        lightning_module = self.lightning_module
        if unexpected and (lightning_module is None or lightning_module.strict_loading):
            raise cp.StateError(
                f"step {result.step} holds model entries the model does not have: "
                f"{unexpected[:8]}", step=result.step, path=self.root,
                hint="load it into the model that saved it, or set "
                     "model.strict_loading = False to ignore them")
        self._last_step = result.step
        self._steps_by_path[os.path.abspath(os.fspath(path))] = result.step
        return decode_checkpoint(state["lightning"])

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """A no-op: retention prunes, after the commit of a newer step (see the class)."""

    @override
    def teardown(self) -> None:
        """Wait for the saves in flight to commit, close the pipeline, then tear the strategy
        down."""
        pipe, self._pipe = self._pipe, None
        try:
            if pipe is not None:
                try:
                    pipe.wait()
                finally:
                    pipe.close()
        finally:
            super().teardown()
