"""The option groups of ``PipelineConfig``, each read by one subsystem.

The public ones (``ReplicationConfig``, ``PersistentConfig``) are re-exported by ``config.py``;
the others are the views the save path and the restore path are handed
(``PipelineConfig.snapshot`` and so on), so that no stage receives the whole config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ConfigError
from .retention import KeepAny, KeepLast, MetricPolicy, RetentionPolicy

__all__ = ("BusyPolicy", "FailurePolicy", "MemoryConfig", "PersistentConfig", "ReplicationConfig", "RestoreOptions",
           "Retention", "SnapshotMode", "SnapshotOptions", "WriteOptions", "positive_int",
           "positive_seconds", "retention_metrics", "retention_of")

BusyPolicy = Literal["block", "skip"]
SnapshotMode = Literal["overlap", "ordered"]
Retention = RetentionPolicy | tuple[RetentionPolicy, ...]
"""What a config holds as its retention: one policy, or several that ``KeepAny`` combines."""


@dataclass(frozen=True, slots=True)
class ReplicationConfig:
    """Copies of each rank's shard on other nodes (docs/distributed.md, "Replication").

    - ``copies``: extra copies of each rank's shard, each on another node than the shard and
      the other copies (0: none). Sent from the host buffer while the local write runs, over
      TCP between the ranks (never the training's process group); a step commits when every
      rank's shard is durable, and the copies that could not be made are reported
      (``CommitInfo.missing_replicas``, ``ReplicationDegraded``). At restore a rank whose shard
      is missing or corrupt fetches a copy. More than the number of other nodes is a
      ``ConfigError`` at open.
    - ``node_name``: the node this rank runs on, for placing copies (None: the host name).
    - ``timeout_s``: bound on every send, receive and acknowledgement of a copy; a peer that
      does not answer in time loses that copy (the save still commits).
    - ``host``: the address other ranks reach this rank's copy server at (None: the address
      this host uses to reach ``MASTER_ADDR``, else its host name's).
    """

    copies: int = 0
    node_name: str | None = None
    timeout_s: float = 60.0
    host: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.copies, bool) or not isinstance(self.copies, int) or self.copies < 0:
            raise ConfigError(f"copies={self.copies!r} is not a number of copies",
                              hint="use 0 (no copies, the default) or a positive int")
        for name in ("node_name", "host"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{name}={value!r} must be a non-empty string or None")
        positive_seconds("timeout_s", self.timeout_s, "for example 60 (seconds)")


@dataclass(frozen=True, slots=True)
class PersistentConfig:
    """The persistent tier (docs/distributed.md, "The persistent tier").

    - ``url``: where committed steps are promoted to: a directory on a shared file system,
      ``s3://bucket/run`` (``pip install 'ckpt_pipeline[s3]'``: obstore), or another fsspec
      URL (``pip install 'ckpt_pipeline[fsspec]'`` and the protocol's package). Uploads run in
      the background from the committed local files, never from the training's memory; a step
      is complete there once its commit object, written last by rank 0 after every rank's
      shard, exists. Recovery also considers it.
    - ``every``: promote every M-th committed step (counted from the pipeline's open). A
      promotion due while two are still uploading on some rank is skipped (``PersistSkipped``):
      a slow upload delays only later uploads.
    - ``on_close``: at a clean close (and so after a SIGTERM that ends the block), promote the
      newest committed step too, and wait up to ``timeout_s`` for the uploads in flight.
    - ``timeout_s``: how long a clean close waits for the uploads and their commit objects.
    - ``keep``: complete steps kept in the persistent tier (None: all).
    - ``options``: the store's settings: for ``s3://``, obstore's S3 settings (``endpoint``,
      ``region``, ``access_key_id``, ``secret_access_key``, ...; the ``AWS_*`` environment
      variables are read too) and ``client_options`` (``connect_timeout``, 5 s, and
      ``timeout``, 30 s, longer for a part: every request's deadlines); for another URL,
      keyword arguments of its fsspec file system. Never in ``repr``, never logged, never
      written into a checkpoint. A store that cannot be reached does not keep the pipeline
      from opening ("Deadlines").
    - ``retries``: retries of each failed upload or download request, with exponential
      backoff, before the promotion fails (``PersistFailed``; training goes on).
    - ``lease_s``: the URL belongs to one open at a time: rank 0 writes an owner object at
      open and refreshes its heartbeat every third of this. A second job is refused
      (``PersistentInUseError``) while the holder's heartbeat advances; a holder whose
      heartbeat is older than its lease, or does not advance while watched for one lease, is
      taken over (``PersistentTakenOver``). Clocks of the hosts must agree to well within it.
    - ``takeover``: take the URL over at open whatever its holder's heartbeat says, for when
      you know the other job is dead (its uploads in flight are never committed as this run's;
      a live holder stops promoting at its next commit).
    """

    url: str
    every: int = 1
    on_close: bool = True
    timeout_s: float = 600.0
    keep: int | None = 3
    options: Mapping[str, Any] | None = field(default=None, repr=False)
    retries: int = 5
    lease_s: float = 60.0
    takeover: bool = False

    def __post_init__(self) -> None:
        url = self.url
        if not isinstance(url, str) or not url.strip():
            raise ConfigError(f"persistent={url!r} must be a directory or a URL",
                              hint="for example persistent='s3://bucket/run' or a path on a "
                                   "shared file system")
        positive_int("every", self.every, "for example every=10")
        if self.keep is not None:
            positive_int("keep", self.keep, "keep at least one step, or None to keep all")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or (
            self.retries < 0
        ):
            raise ConfigError(f"retries={self.retries!r} must be an int >= 0")
        positive_seconds("timeout_s", self.timeout_s, "for example 600 (seconds)")
        if self.options is not None and not isinstance(self.options, Mapping):
            raise ConfigError("options must be a mapping of keyword arguments")
        lease = self.lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not (
            0 < lease < 86400
        ):
            raise ConfigError(f"lease_s={lease!r} must be a positive number of seconds below "
                              "a day", hint="for example 60; a shorter lease lets a restarted "
                                            "job take a dead job's URL over sooner")
        for name, hint in (("on_close", None),
                           ("takeover", "True only when you know the job holding the URL is "
                                        "dead")):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False", hint=hint)


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """The memory tier (docs/memory.md): the host buffers are files in shared memory, and
    they are the checkpoint. It survives a crash of the training process, not a reboot.

    - ``path``: a directory on a memory file system of this node, one per job (for example
      ``/dev/shm/<job>``); each rank keeps its files under it.
    - ``slots``: shared-memory buffers per rank, each as large as the state (its shard). A
      save commits to memory once its copies are done and every rank's shard is sealed there.
      At least ``keep + 2``: the newest memory step is never written into, and one buffer may
      be read by a write-through to disk while the next save fills another.
    - ``keep``: memory steps kept (the newest N); older ones give their buffers back.
    - ``disk_every``: write every K-th memory commit through to the disk root as well (a
      normal checkpoint: copies and the persistent tier see only these). A write-through due
      while the previous one still runs on some rank is skipped (``WriteThroughSkipped``).
    - ``slot_bytes``: the size of each buffer when known in advance: the files are created
      and registered at open, off the training thread, and their room is checked there.
      None: at the first save.
    - ``keep_files``: leave the memory files in place at a clean close (after the newest step
      was written through). A crash always leaves them, for the restart.
    """

    path: str
    slots: int = 3
    keep: int = 1
    disk_every: int = 4
    slot_bytes: int | None = None
    keep_files: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path.strip():
            raise ConfigError(f"memory={self.path!r} must be a directory in shared memory",
                              hint="for example memory='/dev/shm/my-job'")
        positive_int("keep", self.keep, "for example keep=1")
        positive_int("slots", self.slots, f"use at least keep + 2 = {self.keep + 2}")
        if self.slots < self.keep + 2:
            raise ConfigError(
                f"slots={self.slots} is too few for keep={self.keep}: the newest memory step "
                "is never overwritten and a write-through to disk holds one more buffer",
                hint=f"use slots={self.keep + 2}, or a smaller keep")
        positive_int("disk_every", self.disk_every, "for example disk_every=4")
        size = self.slot_bytes
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                 or size < 4096 or size % 4096):
            raise ConfigError(f"slot_bytes={size!r} is invalid",
                              hint="use None, or a multiple of 4096 at least as large as the "
                                   "state of one rank")
        if not isinstance(self.keep_files, bool):
            raise ConfigError("keep_files must be True or False")


@dataclass(frozen=True, slots=True)
class SnapshotOptions:
    """What admission (the training-thread part of ``save()``) reads: see PipelineConfig."""

    capture_rng: bool
    chunk_bytes: int
    host_buffer_bytes: int | None
    when_busy: BusyPolicy
    snapshot_mode: SnapshotMode


@dataclass(frozen=True, slots=True)
class WriteOptions:
    """What the write_data stage reads: see PipelineConfig."""

    chunk_bytes: int
    io_threads: int
    direct_io: bool


@dataclass(frozen=True, slots=True)
class FailurePolicy:
    """When failed saves are raised to the caller (the ledger): see PipelineConfig."""

    strict: bool
    max_failures_in_row: int


@dataclass(frozen=True, slots=True)
class RestoreOptions:
    """What the restore path reads: see PipelineConfig."""

    restore_rng: bool
    io_threads: int
    reshard_bytes_in_flight: int


def retention_metrics(policy: RetentionPolicy) -> tuple[str, ...]:
    """The ``TrainState.extra`` keys ``policy`` needs with every save."""
    return tuple(policy.metrics) if isinstance(policy, MetricPolicy) else ()


def retention_of(keep_last: int | None, retention: object) -> Retention:
    """The retention a config holds, from ``keep_last`` (shorthand) or ``retention``."""
    hint = ("pass e.g. KeepLast(3), a list such as [KeepLast(2), KeepEvery(1000)], or an "
            "object with keep(steps) -> set of steps")
    if keep_last is not None:
        positive_int("keep_last", keep_last, "keep at least one checkpoint: keep_last=1")
        return KeepLast(keep_last)
    if retention is None:
        return KeepLast(3)
    if isinstance(retention, RetentionPolicy):
        return retention
    if not isinstance(retention, (list, tuple)):
        raise ConfigError(f"retention={retention!r} is not a retention policy", hint=hint)
    if not retention:
        raise ConfigError("retention=[] names no policy", hint=hint)
    for index, item in enumerate(retention):
        if not isinstance(item, RetentionPolicy):
            raise ConfigError(f"retention[{index}]={item!r} is not a retention policy",
                              hint=hint)
    policies: tuple[RetentionPolicy, ...] = tuple(retention)
    KeepAny(policies)  # checks what metric policies name
    return policies


def positive_int(name: str, value: object, hint: str) -> None:
    """Raise ConfigError unless ``value`` is an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive int", hint=hint)


def positive_seconds(name: str, value: object, hint: str) -> None:
    """Raise ConfigError unless ``value`` is a positive number (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}={value!r} must be a positive number", hint=hint)
