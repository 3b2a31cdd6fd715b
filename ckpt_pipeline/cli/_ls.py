"""``ckpt-pipeline ls``: the step directories under a root as one rank sees them.

A cheap look: names, sizes, commit records, manifests and shard headers (``scan``), never the
tensor data. Each step is complete, incomplete (no commit record of this rank), corrupt (its
files do not check out), rejected (moved aside by recovery: it failed verification, or was
newer than the restored step) or rewound (moved aside by a rewind, ``restore(step=N)``); a
complete step that a rewind recorded in the root abandons, not moved aside yet, says so; a step
that a running job's retention could not remove says so. The copies of other ranks' shards that the rank holds in a
step directory (replication, ``replica-S-on-H.*``) are listed with the step, each complete,
incomplete or corrupt by the same cheap checks (``scan_replicas``). Nothing under the root is
created, changed or removed.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .._format.markers import read_markers
from .._format.names import (
    commit_name,
    manifest_name,
    parse_foreign_dir,
    parse_rank_file,
    parse_rejected_dir,
    parse_rewound_dir,
    shard_name,
)
from .._format.scan import StepStatus, scan, scan_replicas
from .._format.steps import readable_commit
from .._format.timeline import Lineage, abandoned
from .._lineage import local_marks
from .._tiers.memory.shm import free_bytes
from .._tiers.memory.steps import is_memory_root, memory_ranks, usage_bytes
from ..storage import Storage
from ..train_state import TrainState
from ._output import human_age, human_bytes, print_json, ranks_text, rounded, table_lines
from ._status import EXIT_OK

__all__ = ("cmd_ls", "copies_by_dir")

@dataclass(frozen=True, slots=True)
class _Copy:
    """A copy of another rank's shard that the listed rank holds in a step directory."""

    source: int
    """The rank whose shard it is."""
    holder: int
    """The rank that holds (owns) the copy: the rank listed."""
    status: str
    """complete, incomplete or corrupt, as for the rank's own files."""
    reason: str | None
    bytes: int
    """Size of the copy's files in the directory."""
    save_id: str | None
    shard: str
    """Path of the copy's shard file."""


@dataclass(frozen=True, slots=True)
class _Listing:
    """One row of ``ls``: a step directory as seen by one rank."""

    step: int
    dir_name: str
    path: str
    status: str
    """complete, incomplete, corrupt or rejected."""
    reason: str | None
    bytes: int
    """Size of this rank's files in the directory."""
    committed_unix: float | None
    mtime_unix: float | None
    save_id: str | None
    world_size: int | None
    ranks_committed: tuple[int, ...]
    ranks_present: tuple[int, ...]
    retention_failed: str | None = None
    """Why a running job's retention could not remove this step (its marker in the root)."""
    copies: tuple[_Copy, ...] = ()
    """The copies of other ranks' shards this rank holds in the directory, by source rank."""
    samples: int | None = None
    """The TrainState's consumed_train_samples (a complete step)."""
    extra: dict[str, Any] | None = None
    """The TrainState's ``extra`` (a complete step), to choose a step by its loss."""

    def age_seconds(self, now: float) -> float | None:
        when = self.committed_unix if self.committed_unix is not None else self.mtime_unix
        return None if when is None else max(0.0, now - when)


def _list_steps(storage: Storage, rank: int) -> list[_Listing]:
    """Every step directory, and every one that recovery moved aside, newest first."""
    held = copies_by_dir(storage, rank)
    rows = [_listing(storage, rank, s.step, s.dir_name, s, held.get(s.dir_name, ()))
            for s in scan(storage, rank)]
    for entry in storage.list_dir(""):
        parsed = parse_rejected_dir(entry.name)
        rewound = parse_rewound_dir(entry.name)
        step = rewound[0] if rewound is not None else None if parsed is None else parsed[0]
        if step is not None and entry.is_dir and not entry.is_symlink:
            rows.append(_listing(storage, rank, step, entry.name, None,
                                 rewound_to=None if rewound is None else rewound[1]))
        foreign = parse_foreign_dir(entry.name)
        if foreign is not None and entry.is_dir and not entry.is_symlink:
            row = _listing(storage, rank, foreign[0], entry.name, None)
            rows.append(replace(row, reason="of another save than the run's (another run's "
                                            "root?): set aside at restore, never loaded"))
    failed = read_markers(storage, rank)
    aside = ("rejected", "rewound")
    rows = [replace(r, retention_failed=failed[r.step],
                    reason=r.reason or f"retention could not remove it: {failed[r.step]}")
            if r.step in failed and r.status not in aside else r for r in rows]
    rows = _abandoned(storage, rank, rows)
    rows.sort(key=lambda r: (r.step, r.status not in aside, r.dir_name), reverse=True)
    return rows


def _abandoned(storage: Storage, rank: int, rows: list[_Listing]) -> list[_Listing]:
    """Say so on a complete step that the root's rewind records (or a newer timeline's
    lineage) abandon: a rewind that ended before it moved the step aside."""
    lineages = {r.step: _lineage(storage, rank, r) for r in rows if r.status == "complete"}
    marks = local_marks(storage, lineages.values())
    return [replace(r, reason="abandoned by a rewind: never restored, moved aside at the "
                              "next restore") if r.step in lineages
            and abandoned(r.step, lineages[r.step], marks) else r for r in rows]


def _lineage(storage: Storage, rank: int, row: _Listing) -> Lineage | None:
    record = readable_commit(storage, row.dir_name, row.step, rank)
    return None if record is None else record.lineage


def copies_by_dir(storage: Storage, rank: int) -> dict[str, list[StepStatus]]:
    """The cheap look at every copy this rank holds, by step directory (by source rank)."""
    out: dict[str, list[StepStatus]] = {}
    for status in scan_replicas(storage, rank):
        out.setdefault(status.dir_name, []).append(status)
    return out


def _listing(storage: Storage, rank: int, step: int, dir_name: str,
             status: StepStatus | None,
             copies: Sequence[StepStatus] = (), *,
             rewound_to: int | None = None) -> _Listing:
    """Describe one directory; ``status`` is None for a directory that recovery moved aside
    (``rewound_to``: a rewind to that step did); ``copies``: the cheap look at the copies
    this rank holds in it."""
    entries = storage.list_dir(dir_name)
    own = {shard_name(rank), manifest_name(rank), commit_name(rank)}
    size = sum(e.size for e in entries if e.is_file and e.name in own)
    sizes = {e.name: e.size for e in entries if e.is_file}
    held = tuple(_copy(storage, c, sizes) for c in copies)
    committed: set[int] = set()
    present: set[int] = set()
    for entry in entries:
        parsed = parse_rank_file(entry.name)
        if parsed is None or not entry.is_file:
            continue
        present.add(parsed[0])
        if parsed[1] == "commit":
            committed.add(parsed[0])
    path = os.path.join(storage.root, dir_name)
    try:
        mtime: float | None = os.lstat(path).st_mtime
    except OSError:
        mtime = None
    if status is not None and status.valid:
        samples, extra = _train_state(status)
        return _Listing(step, dir_name, path, "complete", None, size, status.committed_unix,
                        mtime, status.save_id, status.world_size, tuple(sorted(committed)),
                        tuple(sorted(present)), copies=held, samples=samples, extra=extra)
    reason: str | None
    if status is None and rewound_to is not None:
        state, reason = "rewound", (f"moved aside by a rewind to step {rewound_to}; removed "
                                    f"once a step after {rewound_to} is committed")
    elif status is None:
        state, reason = "rejected", "moved aside by recovery"
    elif not status.complete:
        state, reason = "incomplete", status.reason
    elif commit_name(rank) not in {e.name for e in entries}:
        # Complete when scanned, its commit record gone now: a running job pruned the step
        # (the commit record goes first) between the scan's reads. Not corruption.
        state, reason = "incomplete", ("its commit record was removed while it was being "
                                       "listed (pruned by a running job?)")
    else:
        state, reason = "corrupt", status.reason
    record = readable_commit(storage, dir_name, step, rank)
    return _Listing(step, dir_name, path, state, reason, size,
                    None if record is None else record.committed_unix, mtime,
                    None if record is None else record.save_id,
                    None if record is None else record.world_size,
                    tuple(sorted(committed)), tuple(sorted(present)), copies=held)


def _train_state(status: StepStatus) -> tuple[int | None, dict[str, Any] | None]:
    """(consumed samples, extra) of a complete step's TrainState; (None, None) when it does
    not decode (``verify`` says why)."""
    if status.header is None:
        return None, None
    try:
        state = TrainState.from_plain(status.header.train_state)
    except Exception:
        return None, None
    return state.consumed_train_samples, dict(state.extra)


def _extra_text(row: _Listing, width: int = 40) -> str:
    """The EXTRA cell: samples, then the scalar fields of ``extra`` (``loss=2.31``)."""
    parts = [f"samples={row.samples}"] if row.samples else []
    for key, value in (row.extra or {}).items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif isinstance(value, (int, str, bool)) and len(str(value)) <= 24:
            parts.append(f"{key}={value}")
    text = " ".join(parts) or "-"
    return text if len(text) <= width else text[:width - 3] + "..."


def _copy(storage: Storage, status: StepStatus, sizes: dict[str, int]) -> _Copy:
    """Describe one copy; ``sizes``: the files of its directory, listed after it was scanned."""
    files = status.files
    assert files is not None and files.holder is not None
    size = sum(sizes.get(name, 0) for name in files.names())
    shard = os.path.join(storage.root, status.dir_name, files.shard)
    if status.valid:
        return _Copy(files.source, files.holder, "complete", None, size, status.save_id, shard)
    if not status.complete:
        state, reason = "incomplete", status.reason
    elif files.commit not in sizes:
        # As for the rank's own files: pruned between the scan's reads, not corruption.
        state, reason = "incomplete", ("its commit record was removed while it was being "
                                       "listed (pruned by a running job?)")
    else:
        state, reason = "corrupt", status.reason
    record = readable_commit(storage, status.dir_name, status.step, files.source, files)
    return _Copy(files.source, files.holder, state, reason, size,
                 None if record is None else record.save_id, shard)


def cmd_ls(storage: Storage, args: argparse.Namespace) -> int:
    """List the steps under the root (``--json``: as a document); exit status 0."""
    rank: int = args.rank
    rows = _list_steps(storage, rank)
    now = time.time()
    memory = _memory_usage(storage)
    if args.json:
        print_json({
            "root": str(storage.root),
            "rank": rank,
            "memory_tier": memory,
            "steps": [{
                "step": r.step,
                "dir": r.dir_name,
                "path": r.path,
                "status": r.status,
                "reason": r.reason,
                "bytes": r.bytes,
                "age_seconds": rounded(r.age_seconds(now)),
                "committed_unix": r.committed_unix,
                "mtime_unix": r.mtime_unix,
                "save_id": r.save_id,
                "world_size": r.world_size,
                "ranks_committed": list(r.ranks_committed),
                "ranks_present": list(r.ranks_present),
                "retention_failed": r.retention_failed,
                "consumed_train_samples": r.samples,
                "extra": r.extra,
                "copies": [{
                    "source": c.source,
                    "holder": c.holder,
                    "status": c.status,
                    "valid": c.status == "complete",
                    "reason": c.reason,
                    "bytes": c.bytes,
                    "save_id": c.save_id,
                    "shard": c.shard,
                } for c in r.copies],
            } for r in rows],
        })
        return EXIT_OK
    if not rows:
        print(f"no checkpoints under {storage.root}")
        if memory is not None:
            print(f"memory tier: {human_bytes(memory['bytes_in_use'])} in use")
        return EXIT_OK
    headers = ["STEP", "STATUS", "SIZE", "AGE", "RANKS", "SAVE ID"]
    table = [[str(r.step), r.status, human_bytes(r.bytes), human_age(r.age_seconds(now)),
              ranks_text(r.ranks_committed, r.world_size), r.save_id or "-"] for r in rows]
    if any(r.samples or r.extra for r in rows):  # only when some step has something to say
        headers.append("EXTRA")
        for cells, r in zip(table, rows):
            cells.append(_extra_text(r))
    if any(r.copies for r in rows):
        headers.append("COPIES")
        for cells, r in zip(table, rows):
            cells.append(", ".join(f"{c.source} {c.status}" for c in r.copies) or "-")
    reasons = [_reason_text(r) for r in rows]
    if any(reasons):
        headers.append("REASON")
        for cells, reason in zip(table, reasons):
            cells.append(reason)
    for line in table_lines(headers, table, right={0, 2, 3}):
        print(line)
    if memory is not None:
        print(f"memory tier: {human_bytes(memory['bytes_in_use'])} in use (steps and buffers "
              f"of ranks {memory['ranks']}), {human_bytes(memory['free_bytes'])} free on its "
              "file system")
    return EXIT_OK


def _memory_usage(storage: Storage) -> dict[str, Any] | None:
    """What a memory tier's directory holds (None for a disk root)."""
    if not is_memory_root(storage):
        return None
    return {"bytes_in_use": usage_bytes(storage), "free_bytes": free_bytes(str(storage.root)),
            "ranks": memory_ranks(storage)}


def _reason_text(row: _Listing) -> str:
    """The REASON cell: why the step is not complete, then why each copy is not."""
    parts = [row.reason] if row.reason else []
    parts += [f"copy of rank {c.source}: {c.reason}" for c in row.copies if c.reason]
    return "; ".join(parts)
