"""Typed, validated configuration of a pipeline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from .errors import ConfigError
from .retention import KeepAny, KeepLast, MetricPolicy, RetentionPolicy

__all__ = ("BusyPolicy", "PipelineConfig", "PipelineOptions", "SnapshotMode")

BusyPolicy = Literal["block", "skip"]
SnapshotMode = Literal["overlap", "ordered"]

_MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """How a pipeline checkpoints. Defaults suit a single-process training job.

    - ``keep_last``: committed steps kept on disk; older ones are pruned once a newer one is
      committed. The newest committed step is never pruned. Shorthand for
      ``retention=KeepLast(keep_last)``.
    - ``retention``: a retention policy (``ckpt_pipeline.retention``), or a list or tuple of
      them (a step is kept if any of them keeps it), instead of ``keep_last``; ``None`` means
      ``KeepLast(keep_last)``. The newest complete step is never pruned. A policy that ranks
      steps by a metric (``KeepBest(3, metric="loss")``) needs that value in rank 0's
      ``TrainState.extra`` at every save: a save without it fails.
    - ``buffer_slots``: host buffers in the pool (1, or 2 to let a save start while the previous
      one is still being written). Each slot is as large as the state, or ``host_buffer_bytes``.
    - ``host_buffer_bytes``: cap on the size of each slot (None: as large as the state). A
      larger state is streamed: copied into the slot a piece at a time, each piece written
      while the next is copied. ``wait_snapshot()`` then returns only once the last piece is
      copied, after the others are on disk: host memory traded for blocking time.
    - ``when_busy``: what ``save()`` does when every slot is busy: ``"block"`` waits for one,
      ``"skip"`` drops this save and emits ``SaveSkipped``.
    - ``device_staging``: copy CUDA tensors first into a staging buffer on their own GPU (a
      device-to-device copy, tens of times faster than to the host), and to the host from
      there: the next in-place update waits only for the device copy. Costs GPU memory as
      large as the state's CUDA tensors, allocated once; where it does not fit, saves copy
      straight to the host. Not used by streamed saves (``host_buffer_bytes``).
    - ``snapshot_mode``: ``"overlap"`` copies CUDA tensors on a side stream and expects
      ``wait_snapshot()`` before the next in-place update; ``"ordered"`` makes the caller's
      stream wait for the copies inside ``save()`` (no protocol, copy time on the GPU timeline).
    - ``capture_rng`` / ``restore_rng``: save and restore the RNG states with the TrainState.
    - ``chunk_bytes``: granularity of checksums and of writes.
    - ``io_threads``: worker threads for checksums and file I/O.
    - ``direct_io``: write shard data with ``O_DIRECT`` (no page cache: faster on large
      states, and no gigabytes of dirty pages competing with training for host memory); where
      the file system refuses it, writes go through the page cache as with ``False``.
    - ``queue_depth``: capacity of each stream between stages.
    - ``rank`` / ``world_size``: this process's place in the job (single process: 0 and 1);
      taken from the coordinator (torch.distributed when it is initialized).
    - ``coordination_timeout_s``: bound on every exchange between ranks; a rank that does not
      answer in time fails that save or restore with a CoordinationError naming it.
    - ``max_failures_in_row``: a failed save does not stop training (its ``result()`` raises
      and ``SaveFailed`` is emitted), but after this many failures in a row the next ``save()``
      raises, so that a broken disk cannot go unnoticed for hours.
    - ``strict``: raise at the next ``save()`` or ``wait()`` after any failed save (a save
      committed without all its copies, see ``replicas``, counts as failed here).
    - ``replicas``: extra copies of each rank's shard, each on another node than the shard and
      the other copies (0: none). Sent from the host buffer while the local write runs, over
      TCP between the ranks (never the training's process group); a step commits when every
      rank's shard is durable, and the copies that could not be made are reported
      (``CommitInfo.missing_replicas``, ``ReplicationDegraded``). At restore a rank whose shard
      is missing or corrupt fetches a copy. More than the number of other nodes is a
      ``ConfigError`` at open. Placement: docs/distributed.md, "Replication".
    - ``node_name``: the node this rank runs on, for placing copies (None: the host name).
    - ``replication_timeout_s``: bound on every send, receive and acknowledgement of a copy; a
      peer that does not answer in time loses that copy (the save still commits).
    - ``replication_host``: the address other ranks reach this rank's copy server at (None:
      the address this host uses to reach ``MASTER_ADDR``, else its host name's).
    - ``persistent``: where committed steps are promoted to: a directory on a shared file
      system, ``s3://bucket/run`` (``pip install 'ckpt_pipeline[s3]'``: obstore), or another
      fsspec URL (``pip install 'ckpt_pipeline[fsspec]'`` and the protocol's package).
      Uploads run in the background from the committed local files, never from the
      training's memory; a step is complete there once its commit object, written last by rank
      0 after every rank's shard, exists. Recovery also considers it. None: no persistent tier.
    - ``persist_every``: promote every M-th committed step (counted from the pipeline's open).
      A promotion due while two are still uploading on some rank is skipped
      (``PersistSkipped``): a slow upload delays only later uploads.
    - ``persist_on_close``: at a clean close (and so after a SIGTERM that ends the block),
      promote the newest committed step too, and wait up to ``persist_timeout_s`` for the
      uploads in flight.
    - ``persistent_keep``: complete steps kept in the persistent tier (None: all).
    - ``persistent_options``: the store's settings: for ``s3://``, obstore's S3 settings
      (``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ...; the ``AWS_*``
      environment variables are read too) and ``client_options`` (``connect_timeout``, 5 s,
      and ``timeout``, 30 s, longer for a part: every request's deadlines); for another URL,
      keyword arguments of its fsspec file system. Never logged, never written into a
      checkpoint. A store that cannot be reached does not keep the pipeline from opening
      (docs/distributed.md, "The persistent tier", "Deadlines").
    - ``persist_retries``: retries of each failed upload or download request, with exponential
      backoff, before the promotion fails (``PersistFailed``; training goes on).
    - ``persistent_lease_s``: the URL belongs to one open at a time: rank 0 writes an owner
      object at open and refreshes its heartbeat every third of this. A second job is refused
      (``PersistentInUseError``) while the holder's heartbeat advances; a holder whose
      heartbeat is older than its lease, or does not advance while watched for one lease,
      is taken over (``PersistentTakenOver``). Clocks of the hosts must agree to well within
      it. Docs: docs/distributed.md, "Persistent tier".
    - ``persistent_takeover``: take the URL over at open whatever its holder's heartbeat says,
      for when you know the other job is dead (its uploads in flight are never committed as
      this run's; a live holder stops promoting at its next commit).
    """

    keep_last: int = 3
    retention: RetentionPolicy | Sequence[RetentionPolicy] | None = None
    buffer_slots: int = 1
    host_buffer_bytes: int | None = None
    when_busy: BusyPolicy = "block"
    device_staging: bool = False
    snapshot_mode: SnapshotMode = "overlap"
    capture_rng: bool = True
    restore_rng: bool = True
    chunk_bytes: int = 64 * _MiB
    io_threads: int = 8
    direct_io: bool = True
    queue_depth: int = 4
    rank: int = 0
    world_size: int = 1
    coordination_timeout_s: float = 300.0
    max_failures_in_row: int = 3
    strict: bool = False
    replicas: int = 0
    node_name: str | None = None
    replication_timeout_s: float = 60.0
    replication_host: str | None = None
    persistent: str | None = None
    persist_every: int = 1
    persist_on_close: bool = True
    persist_timeout_s: float = 600.0
    persistent_keep: int | None = 3
    persistent_options: Mapping[str, Any] | None = field(default=None, repr=False)
    persist_retries: int = 5
    persistent_lease_s: float = 60.0
    persistent_takeover: bool = False

    @property
    def retention_policy(self) -> RetentionPolicy:
        """The policy the retain stage applies: ``retention`` (several combined by
        ``KeepAny``), or ``KeepLast(keep_last)``."""
        policy = self.retention
        if policy is None:
            return KeepLast(self.keep_last)
        if isinstance(policy, RetentionPolicy):
            return policy
        return KeepAny(tuple(policy))

    @property
    def retention_metrics(self) -> tuple[str, ...]:
        """The ``TrainState.extra`` keys the retention policy needs with every save."""
        policy = self.retention_policy
        return tuple(policy.metrics) if isinstance(policy, MetricPolicy) else ()

    def __post_init__(self) -> None:
        _positive_int("keep_last", self.keep_last, "keep at least one checkpoint: keep_last=1")
        self._check_retention()
        _positive_int("buffer_slots", self.buffer_slots, "use 1, or 2 for double buffering")
        _positive_int("io_threads", self.io_threads, "for example io_threads=8")
        _positive_int("queue_depth", self.queue_depth, "for example queue_depth=4")
        _positive_int("world_size", self.world_size, "world_size=1 for a single process")
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
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not (
            0 <= self.rank < self.world_size
        ):
            raise ConfigError(f"rank={self.rank!r} is outside world_size={self.world_size}",
                              hint="rank must be in [0, world_size)")
        timeout = self.coordination_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"coordination_timeout_s={timeout!r} must be a positive number",
                              hint="for example 300 (seconds)")
        _positive_int("max_failures_in_row", self.max_failures_in_row,
                      "for example max_failures_in_row=3")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or (
            self.replicas < 0
        ):
            raise ConfigError(f"replicas={self.replicas!r} is not a number of copies",
                              hint="use 0 (no copies, the default) or a positive int")
        for name in ("node_name", "replication_host"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{name}={value!r} must be a non-empty string or None")
        timeout = self.replication_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"replication_timeout_s={timeout!r} must be a positive number",
                              hint="for example 60 (seconds)")
        self._check_persistent()
        for name in ("capture_rng", "restore_rng", "strict", "direct_io", "device_staging",
                     "persist_on_close"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False")

    def _check_retention(self) -> None:
        policy = self.retention
        if policy is None:
            return
        hint = ("pass e.g. KeepLast(3), a list such as [KeepLast(2), KeepEvery(1000)], or an "
                "object with keep(steps) -> set of steps")
        if isinstance(policy, (list, tuple)):
            if not policy:
                raise ConfigError("retention=[] names no policy", hint=hint)
            for index, item in enumerate(policy):
                if not isinstance(item, RetentionPolicy):
                    raise ConfigError(f"retention[{index}]={item!r} is not a retention policy",
                                      hint=hint)
            policies: tuple[RetentionPolicy, ...] = tuple(policy)
            object.__setattr__(self, "retention", policies)  # frozen: a tuple, not a list
        elif isinstance(policy, RetentionPolicy):
            policies = (policy,)
        else:
            raise ConfigError(f"retention={policy!r} is not a retention policy", hint=hint)
        KeepAny(policies)  # checks what metric policies name

    def _check_persistent(self) -> None:
        url = self.persistent
        if url is not None and (not isinstance(url, str) or not url.strip()):
            raise ConfigError(f"persistent={url!r} must be a directory or a URL",
                              hint="for example persistent='s3://bucket/run' or a path on a "
                                   "shared file system")
        _positive_int("persist_every", self.persist_every, "for example persist_every=10")
        if self.persistent_keep is not None:
            _positive_int("persistent_keep", self.persistent_keep,
                          "keep at least one step, or None to keep all")
        if isinstance(self.persist_retries, bool) or not isinstance(
            self.persist_retries, int
        ) or self.persist_retries < 0:
            raise ConfigError(f"persist_retries={self.persist_retries!r} must be an int >= 0")
        timeout = self.persist_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"persist_timeout_s={timeout!r} must be a positive number",
                              hint="for example 600 (seconds)")
        if self.persistent_options is not None and not isinstance(
            self.persistent_options, Mapping
        ):
            raise ConfigError("persistent_options must be a mapping of keyword arguments")
        lease = self.persistent_lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not (
            0 < lease < 86400
        ):
            raise ConfigError(f"persistent_lease_s={lease!r} must be a positive number of "
                              "seconds below a day", hint="for example 60; a shorter lease "
                              "lets a restarted job take a dead job's URL over sooner")
        if not isinstance(self.persistent_takeover, bool):
            raise ConfigError("persistent_takeover must be True or False",
                              hint="True only when you know the job holding the URL is dead")


def _positive_int(name: str, value: object, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive int", hint=hint)


class PipelineOptions(TypedDict, total=False):
    """The keyword options of the pipelines' constructors: the fields of PipelineConfig.

    Typed so that a misspelled or mistyped option is a type error, not only a run-time
    ``ConfigError`` (a test checks that the two lists agree).
    """

    keep_last: int
    retention: RetentionPolicy | Sequence[RetentionPolicy] | None
    buffer_slots: int
    host_buffer_bytes: int | None
    when_busy: BusyPolicy
    device_staging: bool
    snapshot_mode: SnapshotMode
    capture_rng: bool
    restore_rng: bool
    chunk_bytes: int
    io_threads: int
    direct_io: bool
    queue_depth: int
    rank: int
    world_size: int
    coordination_timeout_s: float
    max_failures_in_row: int
    strict: bool
    replicas: int
    node_name: str | None
    replication_timeout_s: float
    replication_host: str | None
    persistent: str | None
    persist_every: int
    persist_on_close: bool
    persist_timeout_s: float
    persistent_keep: int | None
    persistent_options: Mapping[str, Any] | None
    persist_retries: int
    persistent_lease_s: float
    persistent_takeover: bool
