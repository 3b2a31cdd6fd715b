"""Stage 5, retain: prune committed steps beyond ``keep_last``, never the newest."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._crash import crash_point
from ._format import commit_name, manifest_name, shard_name
from ._recovery import committed_steps, tidy_step_dir
from .storage import Storage

__all__ = ("Pruned", "prune")


@dataclass(frozen=True, slots=True)
class Pruned:
    step: int
    path: str
    bytes: int


def prune(storage: Storage, rank: int, keep_last: int, complete: int) -> list[Pruned]:
    """Remove this rank's files of committed steps beyond the newest ``keep_last``.

    Only steps older than ``complete``, a step known to be committed on every rank, are ever
    removed: the newest complete set survives whatever happened to the newer ones. Steps are
    ordered by the step recorded in the commit record, not by names or times. The commit
    record goes first, so a step being pruned is never mistaken for complete. Runs in a worker
    thread.
    """
    steps = committed_steps(storage, rank)
    out: list[Pruned] = []
    for step, dir_name in sorted(steps.items(), reverse=True)[keep_last:]:
        if step >= complete:
            continue
        sizes = {e.name: e.size for e in storage.list_dir(dir_name)}
        size = 0
        for name in (commit_name(rank), manifest_name(rank), shard_name(rank)):
            size += sizes.get(name, 0)
            storage.unlink(os.path.join(dir_name, name))
            if name == commit_name(rank):
                # Durable before the data go: whatever a power cut keeps of the rest, this
                # step can no longer look complete.
                storage.fsync_dir(dir_name)
                crash_point("retain.commit_removed")
        tidy_step_dir(storage, dir_name)
        out.append(Pruned(step, os.path.join(str(storage.root), dir_name), size))
    return out
