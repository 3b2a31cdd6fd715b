"""``ckpt-pipeline ls``: the step directories under a root as one rank sees them.

A cheap look: names, sizes, commit records, manifests and shard headers (``scan``), never the
tensor data. Each step is complete, incomplete (no commit record of this rank), corrupt (its
files do not check out) or rejected (moved aside by recovery); a step that a running job's
retention could not remove says so. Nothing under the root is created, changed or removed.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, replace

from .._format.documents import CommitRecord, decode_commit
from .._format.names import (
    commit_name,
    manifest_name,
    parse_rank_file,
    parse_rejected_dir,
    shard_name,
)
from .._restore import scan as _recovery
from .._save.retain import read_markers
from ..errors import CheckpointError
from ..storage import Storage
from ._output import _human_age, _human_bytes, _print_json, _ranks_text, _rounded, _table
from ._status import EXIT_OK

__all__ = ("_cmd_ls", "_commit_record")

_SMALL_FILE_MAX = 1024 * 1024


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

    def age_seconds(self, now: float) -> float | None:
        when = self.committed_unix if self.committed_unix is not None else self.mtime_unix
        return None if when is None else max(0.0, now - when)


def _list_steps(storage: Storage, rank: int) -> list[_Listing]:
    """Every step directory, and every one that recovery moved aside, newest first."""
    rows = [_listing(storage, rank, s.step, s.dir_name, s) for s in _recovery.scan(storage, rank)]
    for entry in storage.list_dir(""):
        parsed = parse_rejected_dir(entry.name)
        step = None if parsed is None else parsed[0]
        if step is not None and entry.is_dir and not entry.is_symlink:
            rows.append(_listing(storage, rank, step, entry.name, None))
    failed = read_markers(storage, rank)
    rows = [replace(r, retention_failed=failed[r.step],
                    reason=r.reason or f"retention could not remove it: {failed[r.step]}")
            if r.step in failed and r.status != "rejected" else r for r in rows]
    rows.sort(key=lambda r: (r.step, r.status != "rejected", r.dir_name), reverse=True)
    return rows


def _listing(storage: Storage, rank: int, step: int, dir_name: str,
             status: _recovery.StepStatus | None) -> _Listing:
    """Describe one directory; ``status`` is None for a directory that recovery moved aside."""
    entries = storage.list_dir(dir_name)
    own = {shard_name(rank), manifest_name(rank), commit_name(rank)}
    size = sum(e.size for e in entries if e.is_file and e.name in own)
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
        return _Listing(step, dir_name, path, "complete", None, size, status.committed_unix,
                        mtime, status.save_id, status.world_size, tuple(sorted(committed)),
                        tuple(sorted(present)))
    reason: str | None
    if status is None:
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
    record = _commit_record(storage, dir_name, step, rank)
    return _Listing(step, dir_name, path, state, reason, size,
                    None if record is None else record.committed_unix, mtime,
                    None if record is None else record.save_id,
                    None if record is None else record.world_size,
                    tuple(sorted(committed)), tuple(sorted(present)))


def _commit_record(storage: Storage, dir_name: str, step: int, rank: int) -> CommitRecord | None:
    """This rank's commit record of the step, or None where it is missing or unreadable."""
    rel = os.path.join(dir_name, commit_name(rank))
    try:
        fd, size = storage.open_read(rel)
        try:
            if size > _SMALL_FILE_MAX:
                return None
            buf = bytearray(size)
            storage.pread_into(fd, memoryview(buf), 0)
        finally:
            storage.close(fd)
        record = decode_commit(bytes(buf), os.path.join(storage.root, rel))
    except CheckpointError:
        return None
    return record if (record.step, record.rank) == (step, rank) else None


def _cmd_ls(storage: Storage, args: argparse.Namespace) -> int:
    """List the steps under the root (``--json``: as a document); exit status 0."""
    rank: int = args.rank
    rows = _list_steps(storage, rank)
    now = time.time()
    if args.json:
        _print_json({
            "root": str(storage.root),
            "rank": rank,
            "steps": [{
                "step": r.step,
                "dir": r.dir_name,
                "path": r.path,
                "status": r.status,
                "reason": r.reason,
                "bytes": r.bytes,
                "age_seconds": _rounded(r.age_seconds(now)),
                "committed_unix": r.committed_unix,
                "mtime_unix": r.mtime_unix,
                "save_id": r.save_id,
                "world_size": r.world_size,
                "ranks_committed": list(r.ranks_committed),
                "ranks_present": list(r.ranks_present),
                "retention_failed": r.retention_failed,
            } for r in rows],
        })
        return EXIT_OK
    if not rows:
        print(f"no checkpoints under {storage.root}")
        return EXIT_OK
    headers = ["STEP", "STATUS", "SIZE", "AGE", "RANKS", "SAVE ID"]
    table = [[str(r.step), r.status, _human_bytes(r.bytes), _human_age(r.age_seconds(now)),
              _ranks_text(r.ranks_committed, r.world_size), r.save_id or "-"] for r in rows]
    if any(r.reason for r in rows):
        headers.append("REASON")
        for cells, r in zip(table, rows):
            cells.append(r.reason or "")
    for line in _table(headers, table, right={0, 2, 3}):
        print(line)
    return EXIT_OK
