"""Typed, validated configuration of a pipeline, grouped by the subsystem that reads it.

``PipelineConfig`` holds the save path's and the failure policy's options, a retention policy,
and two groups: ``ReplicationConfig`` (copies on other nodes) and ``PersistentConfig`` (the
persistent tier). Each subsystem is handed only its group (``PipelineConfig.snapshot``,
``.write``, ``.failures``, ``.restore`` for the save path's and the restore path's own). The
flat keywords of earlier releases (``replicas=``, ``persist_every=``, ...) still work, with a
``DeprecationWarning`` naming the new spelling (``_config_aliases.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from ._config_aliases import resolve_options
from ._config_groups import BusyPolicy as BusyPolicy
from ._config_groups import (
    FailurePolicy,
    RestoreOptions,
    Retention,
    SnapshotOptions,
    WriteOptions,
    positive_int,
    positive_seconds,
    retention_metrics,
)
from ._config_groups import MemoryConfig as MemoryConfig
from ._config_groups import PersistentConfig as PersistentConfig
from ._config_groups import ReplicationConfig as ReplicationConfig
from ._config_groups import SnapshotMode as SnapshotMode
from .errors import ConfigError
from .retention import KeepAny, RetentionPolicy

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._config_aliases import DeprecatedOptions

__all__ = ("BusyPolicy", "MemoryConfig", "PersistentConfig", "PipelineConfig", "PipelineOptions",
           "ReplicationConfig", "SnapshotMode")

_MiB = 1024 * 1024


@dataclass(frozen=True, slots=True, init=False)
class PipelineConfig:
    """How a pipeline checkpoints. Defaults suit a single-process training job.

    - ``retention``: a retention policy (``ckpt_pipeline.retention``), or a list or tuple of
      them (a step is kept if any of them keeps it; held as a tuple). Committed steps the
      policy does not keep are pruned once a newer one is committed; the newest complete step
      is never pruned. Default ``KeepLast(3)``. A policy that ranks steps by a metric
      (``KeepBest(3, metric="loss")``) needs that value in rank 0's ``TrainState.extra`` at
      every save: a save without it fails.
    - ``keep_last``: shorthand for ``retention=KeepLast(keep_last)`` (giving both is a
      ConfigError); read back as ``config.retention``.
    - ``buffer_slots``: host buffers in the pool (1, or 2 to let a save start while the previous
      one is still being written). Each slot is as large as the state, or ``host_buffer_bytes``.
    - ``host_buffer_bytes``: cap on the size of each slot (None: as large as the state). A
      larger state is streamed: copied into the slot a piece at a time, each piece written
      while the next is copied. ``wait_snapshot()`` then returns only once the last piece is
      copied, after the others are on disk: host memory traded for blocking time.
    - ``when_busy``: what ``save()`` does when every slot is busy: ``"block"`` waits for one,
      ``"skip"`` drops this save and emits ``SaveSkipped``.
    - ``device_staging``: ``True`` copies CUDA tensors first into a staging buffer on their
      own GPU (a device-to-device copy, tens of times faster than to the host), and to the
      host from there: the next in-place update waits only for the device copy. Costs GPU
      memory as large as the state's CUDA tensors, allocated once; where it does not fit,
      saves copy straight to the host. A save that finds no host buffer ready (a fresh job's
      first save, or every slot busy with ``when_busy="block"``) does not wait for one
      either: the pipeline takes it after ``save()`` returns. ``None`` (the default) stages
      only a save whose host buffers are not made yet (a fresh job's first save, which would
      otherwise wait seconds for gigabytes of pinned memory), in a buffer allocated for it
      where the GPU keeps a tenth of its memory free beside it, and freed (to PyTorch's
      caching allocator) once its copies to the host are queued. ``False`` never stages.
      Not used by streamed saves (``host_buffer_bytes``) nor under ``when_busy="skip"``.
    - ``snapshot_mode``: ``"overlap"`` copies CUDA tensors on a side stream and expects
      ``wait_snapshot()`` before the next in-place update; ``"ordered"`` makes the caller's
      stream wait for the copies inside ``save()`` (no protocol, copy time on the GPU timeline).
    - ``capture_rng`` / ``restore_rng``: save and restore the RNG states with the TrainState.
    - ``chunk_bytes``: granularity of writes (and of checksums up to 4 MiB: a shard's data
      is checksummed in blocks of 4 MiB, or of the chunk when that is smaller).
    - ``io_threads``: worker threads for checksums and file I/O.
    - ``reshard_bytes_in_flight``: a restore onto another world size or mesh reads the saved
      shards' bytes a range at a time into host memory, with ``io_threads`` threads, then
      copies them into the live tensors: the bytes those ranges hold at once (each thread's
      range at most this divided by ``io_threads``, but at least one checksum block; each
      thread also keeps its last verified block). The live tensors themselves are not counted.
    - ``direct_io``: write shard data with ``O_DIRECT`` (no page cache: faster on large
      states, and no gigabytes of dirty pages competing with training for host memory); where
      the file system refuses it, writes go through the page cache as with ``False``.
    - ``queue_depth``: capacity of each stream between stages.
    - ``coordination_timeout_s``: bound on every exchange between ranks; a rank that does not
      answer in time fails that save or restore with a CoordinationError naming it. (A rank's
      place in the job comes from the coordinator, never from the config.)
    - ``max_failures_in_row``: a failed save does not stop training (its ``result()`` raises
      and ``SaveFailed`` is emitted), but after this many failures in a row the next ``save()``
      raises, so that a broken disk cannot go unnoticed for hours.
    - ``strict``: raise at the next ``save()`` or ``wait()`` after any failed save (a save
      committed without all its copies, see ``replication``, counts as failed here).
    - ``replication``: copies on other nodes, a :class:`ReplicationConfig` (default: none).
    - ``persistent``: the persistent tier, a :class:`PersistentConfig`, or its URL alone
      (``persistent="s3://bucket/run"``); None: no persistent tier.
    - ``memory``: the memory tier, a :class:`MemoryConfig`, or its directory alone
      (``memory="/dev/shm/my-job"``): saves commit to shared memory, and every
      ``disk_every``-th is written through to the root. None: every save goes to the root.
      Its buffers take the place of the host buffer pool (``buffer_slots`` is not used);
      ``host_buffer_bytes`` cannot be combined with it.
    """

    retention: Retention
    buffer_slots: int
    host_buffer_bytes: int | None
    when_busy: BusyPolicy
    device_staging: bool | None
    snapshot_mode: SnapshotMode
    capture_rng: bool
    restore_rng: bool
    chunk_bytes: int
    io_threads: int
    reshard_bytes_in_flight: int
    direct_io: bool
    queue_depth: int
    coordination_timeout_s: float
    max_failures_in_row: int
    strict: bool
    replication: ReplicationConfig
    persistent: PersistentConfig | None
    memory: MemoryConfig | None

    def __init__(self, *, keep_last: int | None = None,
                 retention: RetentionPolicy | Sequence[RetentionPolicy] | None = None,
                 buffer_slots: int = 1, host_buffer_bytes: int | None = None,
                 when_busy: BusyPolicy = "block", device_staging: bool | None = None,
                 snapshot_mode: SnapshotMode = "overlap", capture_rng: bool = True,
                 restore_rng: bool = True, chunk_bytes: int = 64 * _MiB, io_threads: int = 8,
                 reshard_bytes_in_flight: int = 64 * _MiB, direct_io: bool = True,
                 queue_depth: int = 4,
                 coordination_timeout_s: float = 300.0, max_failures_in_row: int = 3,
                 strict: bool = False, replication: ReplicationConfig | None = None,
                 persistent: PersistentConfig | str | None = None,
                 memory: MemoryConfig | str | None = None,
                 **deprecated: Unpack[DeprecatedOptions]) -> None:
        """Keyword options only; ``deprecated``: the flat spellings of earlier releases."""
        given = resolve_options(
            {"keep_last": keep_last, "retention": retention, "replication": replication,
             "persistent": persistent}, deprecated, ReplicationConfig(), None,
            valid=_OPTION_NAMES)
        values = dict(
            buffer_slots=buffer_slots, host_buffer_bytes=host_buffer_bytes,
            when_busy=when_busy, device_staging=device_staging, snapshot_mode=snapshot_mode,
            capture_rng=capture_rng, restore_rng=restore_rng, chunk_bytes=chunk_bytes,
            io_threads=io_threads, reshard_bytes_in_flight=reshard_bytes_in_flight,
            direct_io=direct_io, queue_depth=queue_depth,
            coordination_timeout_s=coordination_timeout_s,
            max_failures_in_row=max_failures_in_row, strict=strict,
            memory=MemoryConfig(memory) if isinstance(memory, str) else memory, **given)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._check()

    @property
    def retention_policy(self) -> RetentionPolicy:
        """The policy the retain stage applies (several combined by ``KeepAny``)."""
        policy = self.retention
        return policy if isinstance(policy, RetentionPolicy) else KeepAny(policy)

    @property
    def retention_metrics(self) -> tuple[str, ...]:
        """The ``TrainState.extra`` keys the retention policy needs with every save."""
        return retention_metrics(self.retention_policy)

    @property
    def snapshot(self) -> SnapshotOptions:
        return SnapshotOptions(self.capture_rng, self.chunk_bytes, self.host_buffer_bytes,
                               self.when_busy, self.snapshot_mode)

    @property
    def write(self) -> WriteOptions:
        return WriteOptions(self.chunk_bytes, self.io_threads, self.direct_io)

    @property
    def failures(self) -> FailurePolicy:
        return FailurePolicy(self.strict, self.max_failures_in_row)

    @property
    def restore(self) -> RestoreOptions:
        return RestoreOptions(self.restore_rng, self.io_threads, self.reshard_bytes_in_flight)

    def merged(self, options: Mapping[str, Any]) -> PipelineConfig:
        """This config with keyword ``options`` (the constructors' ``**options``) applied; an
        old spelling updates this config's group, a misspelled name fails naming the valid
        ones."""
        if not options:
            return self
        names = {"keep_last", "retention", "replication", "persistent"}
        fields = self.__dataclass_fields__
        given = resolve_options({k: v for k, v in options.items() if k in names},
                                {k: v for k, v in options.items()
                                 if k not in names and k not in fields},
                                self.replication, self.persistent, valid=_OPTION_NAMES,
                                keep=self.retention)
        changes = {k: v for k, v in options.items() if k in fields}
        current = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return PipelineConfig(**{**current, **changes, **given})

    def _check(self) -> None:
        positive_int("buffer_slots", self.buffer_slots, "use 1, or 2 for double buffering")
        positive_int("io_threads", self.io_threads, "for example io_threads=8")
        positive_int("reshard_bytes_in_flight", self.reshard_bytes_in_flight,
                     "for example 64 MiB (67108864)")
        positive_int("queue_depth", self.queue_depth, "for example queue_depth=4")
        if self.when_busy not in ("block", "skip"):
            raise ConfigError(f"when_busy={self.when_busy!r} is not a policy",
                              hint='use "block" or "skip"')
        if self.snapshot_mode not in ("overlap", "ordered"):
            raise ConfigError(f"snapshot_mode={self.snapshot_mode!r} is not a mode",
                              hint='use "overlap" or "ordered"')
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) or (
            self.chunk_bytes < 4096 or self.chunk_bytes % 4096
        ):
            raise ConfigError(f"chunk_bytes={self.chunk_bytes!r} is invalid",
                              hint="use a positive multiple of 4096, for example 64 MiB")
        cap = self.host_buffer_bytes
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, int) or cap % 4096 or (
                cap < 2 * self.chunk_bytes
            ):
                raise ConfigError(
                    f"host_buffer_bytes={cap!r} is invalid",
                    hint=f"use None, or a multiple of 4096 of at least two chunks "
                         f"(2 * chunk_bytes = {2 * self.chunk_bytes})")
            if self.snapshot_mode == "ordered":
                raise ConfigError("snapshot_mode='ordered' cannot stream a state through a "
                                  "capped host buffer",
                                  hint="use snapshot_mode='overlap' with host_buffer_bytes, "
                                       "or host_buffer_bytes=None")
        positive_seconds("coordination_timeout_s", self.coordination_timeout_s,
                          "for example 300 (seconds)")
        positive_int("max_failures_in_row", self.max_failures_in_row,
                      "for example max_failures_in_row=3")
        if self.memory is not None:
            if not isinstance(self.memory, MemoryConfig):
                raise ConfigError(f"memory={self.memory!r} is not a MemoryConfig",
                                  hint="for example memory='/dev/shm/my-job'")
            if cap is not None:
                raise ConfigError("host_buffer_bytes cannot be combined with the memory tier: "
                                  "its buffers hold the whole state",
                                  hint="use host_buffer_bytes=None, or memory=None")
        if not isinstance(self.replication, ReplicationConfig):
            raise ConfigError(f"replication={self.replication!r} is not a ReplicationConfig",
                              hint="for example replication=ReplicationConfig(copies=1)")
        for name in ("capture_rng", "restore_rng", "strict", "direct_io"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False")
        if self.device_staging is not None and not isinstance(self.device_staging, bool):
            raise ConfigError(f"device_staging must be True, False or None, got "
                              f"{self.device_staging!r}",
                              hint="None (the default) stages only saves whose host buffers "
                                   "are not made yet")


class PipelineOptions(TypedDict, total=False):
    """The keyword options of the pipelines' constructors: those of PipelineConfig.

    Typed so that a misspelled or mistyped option is a type error, not only a run-time
    ``ConfigError`` (a test checks that the two lists agree). The deprecated flat spellings
    are left out on purpose: a type checker flags them, the run time warns.
    """

    keep_last: int | None
    retention: RetentionPolicy | Sequence[RetentionPolicy] | None
    buffer_slots: int
    host_buffer_bytes: int | None
    when_busy: BusyPolicy
    device_staging: bool | None
    snapshot_mode: SnapshotMode
    capture_rng: bool
    restore_rng: bool
    chunk_bytes: int
    io_threads: int
    reshard_bytes_in_flight: int
    direct_io: bool
    queue_depth: int
    coordination_timeout_s: float
    max_failures_in_row: int
    strict: bool
    replication: ReplicationConfig | None
    persistent: PersistentConfig | str | None
    memory: MemoryConfig | str | None


_OPTION_NAMES = tuple(PipelineOptions.__annotations__)
"""The valid keyword options, named when one is misspelled."""
