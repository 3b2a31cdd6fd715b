"""Stage 5, retain: prune the committed steps the retention policy does not keep, never the
newest complete one.

A policy that ranks steps by a metric (``MetricPolicy``) gets each step's values from its
commit record (``recorded_metrics``), never from memory: every rank, and a pipeline opened
after a restart, decides from the same values.

A step that cannot be removed stays on disk and is reported, never silently: the stage emits
``RetentionFailed`` and leaves a marker file in the root (``_format/markers.py``, holding the
error) that ``ckpt-pipeline ls`` shows, until a later prune removes the step.

Steps a rewind moved aside (``step-….rewound-<N>-r…``) are removed by one rule, whatever the
policy (``prune_rewound``): once a step newer than the rewind point N is committed on every
rank, the new timeline has a checkpoint of its own past N, and the abandoned steps go. Steps
moved aside for failing verification (``.rejected-``) are kept for inspection.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Set
from dataclasses import dataclass

from .._crash import crash_point
from .._format.filesets import owned_sets
from .._format.names import parse_rewound_dir
from .._format.steps import committed_steps, read_commit, step_dirs
from .._format.tidy import tidy_step_dir
from ..errors import CheckpointError
from ..retention import MetricPolicy, RetentionPolicy, StepInfo, kept_steps
from ..storage import Storage

__all__ = ("PruneFailed", "Pruned", "prune", "prune_rewound", "recorded_metrics")


@dataclass(frozen=True, slots=True)
class Pruned:
    step: int
    path: str
    bytes: int


@dataclass(frozen=True, slots=True)
class PruneFailed:
    """A step that retention could not remove, and why."""

    step: int
    path: str
    error: str


def prune(storage: Storage, rank: int, policy: RetentionPolicy, complete: int,
          protect: Collection[int] = ()) -> tuple[list[Pruned], list[PruneFailed]]:
    """Remove this rank's files of the committed steps that ``policy`` does not keep.

    This rank's files are its own shard and the copies it holds for other ranks: a step is
    kept or pruned with all of them (a step held only as copies counts like the others). Only
    steps older than ``complete``, a step known to be committed on every rank, are ever
    removed: the newest complete set survives whatever happened to the newer ones. Steps are
    ordered by the step recorded in the commit record, not by names or times. The commit
    record goes first, so a step being pruned is never mistaken for complete. A step that
    cannot be removed is reported and the others are still tried. Steps in ``protect`` (being
    uploaded to the persistent tier) are kept until a later prune. Runs in a worker thread.
    """
    steps = {**_held_steps(storage, rank), **committed_steps(storage, rank)}
    keep = _kept(storage, rank, policy, steps)
    out: list[Pruned] = []
    failed: list[PruneFailed] = []
    for step, dir_name in sorted(steps.items(), reverse=True):
        if step in keep or step >= complete or step in protect:
            continue
        path = os.path.join(str(storage.root), dir_name)
        try:
            size = _remove_step(storage, rank, dir_name)
        except CheckpointError as exc:
            failed.append(PruneFailed(step, path, str(exc)))
            continue
        out.append(Pruned(step, path, size))
    return out, failed


def prune_rewound(storage: Storage, rank: int, complete: int
                  ) -> tuple[list[Pruned], list[PruneFailed]]:
    """Remove this rank's directories that a rewind to a step older than ``complete`` (a step
    committed on every rank) moved aside; report those that could not be removed. Worker
    thread."""
    out: list[Pruned] = []
    failed: list[PruneFailed] = []
    for entry in storage.list_dir(""):
        parsed = parse_rewound_dir(entry.name)
        if parsed is None or parsed[2] != rank or parsed[1] >= complete or not entry.is_dir \
                or entry.is_symlink:
            continue
        path = os.path.join(str(storage.root), entry.name)
        try:
            size = 0
            for item in storage.list_dir(entry.name):
                if not item.is_file:
                    raise CheckpointError(f"{item.name} in it is not a regular file",
                                          path=path, hint="remove the directory by hand")
                storage.unlink(os.path.join(entry.name, item.name))
                size += item.size
            storage.rmdir(entry.name)
            storage.fsync_dir("")
        except CheckpointError as exc:
            failed.append(PruneFailed(parsed[0], path, str(exc)))
            continue
        out.append(Pruned(parsed[0], path, size))
    return out, failed


def _kept(storage: Storage, rank: int, policy: RetentionPolicy,
          steps: Mapping[int, str]) -> Set[int]:
    """Ask the policy (see ``ckpt_pipeline.retention`` for the call order)."""
    newest_first = sorted(steps, reverse=True)
    if not isinstance(policy, MetricPolicy):
        return kept_steps(policy.keep(tuple(newest_first)), policy)
    return kept_steps(policy.keep_infos(tuple(
        StepInfo(step, recorded_metrics(storage, rank, step, steps[step]))
        for step in newest_first)), policy)


def recorded_metrics(storage: Storage, rank: int, step: int,
                     dir_name: str) -> dict[str, float]:
    """The metric values in the commit record of ``step`` that this rank holds: its own, else
    a copy's. Empty when no record has any, or none can be read (such a step is never among
    the best; another policy may still keep it)."""
    names = {e.name for e in storage.list_dir(dir_name)}
    for files in owned_sets(names, rank):  # its own first
        if files.commit not in names:
            continue
        try:
            record = read_commit(storage, dir_name, step, files.source, files)
        except CheckpointError:
            continue
        if record.metrics:
            return dict(record.metrics)
    return {}


def _held_steps(storage: Storage, rank: int) -> dict[int, str]:
    """Steps where this rank holds a committed copy of another rank's shard."""
    out: dict[int, str] = {}
    for step, dir_name in step_dirs(storage).items():
        names = {e.name for e in storage.list_dir(dir_name)}
        if any(f.holder is not None and f.commit in names for f in owned_sets(names, rank)):
            out[step] = dir_name
    return out


def _remove_step(storage: Storage, rank: int, dir_name: str) -> int:
    sizes = {e.name: e.size for e in storage.list_dir(dir_name)}
    size = 0
    for files in owned_sets(sizes, rank):
        for name in files.names():
            if name not in sizes:
                continue
            size += sizes[name]
            storage.unlink(os.path.join(dir_name, name))
            if name == files.commit:
                # Durable before the data go: whatever a power cut keeps of the rest, this
                # set can no longer look complete.
                storage.fsync_dir(dir_name)
                crash_point("retain.commit_removed")
    tidy_step_dir(storage, dir_name)
    return size
