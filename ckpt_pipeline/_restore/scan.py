"""Recovery: scrub what crashed saves left, scan and validate steps, read shards back.

Every name from disk is matched against a strict pattern, every file is opened without
following symlinks and must be a regular file of the size its manifest records, and every byte
of tensor data is checked against its xxh3 checksum before it is used.
"""

from __future__ import annotations

import errno
import os
import secrets
from dataclasses import dataclass
from typing import Any

from .._crash import crash_point
from .._format.documents import CommitRecord, Manifest, decode_commit, decode_manifest, decode_tree
from .._format.names import (
    TEMP_FILE,
    commit_name,
    manifest_name,
    parse_rank_file,
    parse_step_dir,
    rejected_dir_name,
    shard_name,
)
from .._format.shard import PREAMBLE_SIZE, ShardHeader, checksum, decode_header, decode_preamble
from ..errors import CheckpointIntegrityError, StateError, StorageError
from ..storage import Storage
from ..train_state import TrainState

__all__ = (
    "StepStatus",
    "committed_steps",
    "decode_contents",
    "quarantine",
    "read_header",
    "scan",
    "scrub",
    "step_dirs",
    "tidy_step_dir",
)

_SMALL_LIMIT = 1024 * 1024
_STAGING_BYTES = 8 * 1024 * 1024  # pinned piece size for reads bound for a GPU


@dataclass(frozen=True, slots=True)
class StepStatus:
    """What a cheap look at one step directory found for one rank."""

    step: int
    dir_name: str
    path: str
    complete: bool
    """This rank's commit record is present."""
    valid: bool
    """Complete, and commit record, manifest, shard size and header agree."""
    reason: str | None
    save_id: str | None = None
    world_size: int | None = None
    shard_size: int = 0
    data_bytes: int = 0
    committed_unix: float | None = None
    header: ShardHeader | None = None


def step_dirs(storage: Storage) -> dict[int, str]:
    """Step directories under the root, by step (names that do not match are ignored)."""
    out: dict[int, str] = {}
    for entry in storage.list_dir(""):
        step = parse_step_dir(entry.name)
        if step is not None and entry.is_dir and not entry.is_symlink:
            out[step] = entry.name
    return out


def _read_small(storage: Storage, rel: str) -> bytes:
    fd, size = storage.open_read(rel)
    try:
        if size > _SMALL_LIMIT:
            raise CheckpointIntegrityError(f"file is {size} bytes, more than a metadata file "
                                           "can be", path=os.path.join(storage.root, rel))
        buf = bytearray(size)
        storage.pread_into(fd, memoryview(buf), 0)
        return bytes(buf)
    finally:
        storage.close(fd)


def _read_commit(storage: Storage, dir_name: str, step: int, rank: int) -> CommitRecord:
    rel = os.path.join(dir_name, commit_name(rank))
    path = os.path.join(storage.root, rel)
    record = decode_commit(_read_small(storage, rel), path)
    if record.step != step or record.rank != rank:
        raise CheckpointIntegrityError(
            f"commit record is for step {record.step} rank {record.rank}", step=step,
            rank=rank, path=path, hint="a file was moved between steps or ranks")
    return record


def committed_steps(storage: Storage, rank: int) -> dict[int, str]:
    """Steps with this rank's commit record, keyed by the step recorded inside it."""
    out: dict[int, str] = {}
    for step, dir_name in step_dirs(storage).items():
        names = {e.name for e in storage.list_dir(dir_name)}
        if commit_name(rank) not in names:
            continue
        try:
            record = _read_commit(storage, dir_name, step, rank)
        except (CheckpointIntegrityError, StorageError):
            continue
        out[record.step] = dir_name
    return out


def scrub(storage: Storage, rank: int) -> list[tuple[str, int]]:
    """Remove this rank's temporaries and uncommitted files; return (path, bytes) removed.

    A committed step is never touched. Runs in a worker thread, before any save starts.
    """
    removed: list[tuple[str, int]] = []
    prefix = f".rank-{rank:05d}."
    for _step, dir_name in sorted(step_dirs(storage).items()):
        entries = storage.list_dir(dir_name)
        names = {e.name for e in entries}
        committed = commit_name(rank) in names
        for entry in entries:
            own_temp = entry.name.startswith(prefix) and TEMP_FILE.match(entry.name)
            parsed = parse_rank_file(entry.name)
            own_uncommitted = (not committed and parsed is not None and parsed[0] == rank)
            if (own_temp or own_uncommitted) and not entry.is_dir:
                storage.unlink(os.path.join(dir_name, entry.name))
                removed.append((os.path.join(storage.root, dir_name, entry.name), entry.size))
                crash_point("scrub.removed")
        here = os.path.join(storage.root, dir_name)
        tidy_step_dir(storage, dir_name,
                      changed=any(os.path.dirname(p) == here for p, _ in removed))
    return removed


def tidy_step_dir(storage: Storage, dir_name: str, *, changed: bool = True) -> None:
    """After this rank removed files from a step directory: fsync it, remove it if empty.

    Ranks sharing a root do this at the same time: the directory may vanish (another rank
    removed it) or gain files (another rank is saving) between two calls; both are fine.
    """
    try:
        if changed:
            storage.fsync_dir(dir_name)
        if storage.list_dir(dir_name):
            return
        storage.rmdir(dir_name)
    except StorageError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            return
        raise
    storage.fsync_dir("")


def scan(storage: Storage, rank: int) -> list[StepStatus]:
    """Cheaply validate this rank's files of every step, newest first. Worker thread."""
    out: list[StepStatus] = []
    for step, dir_name in sorted(step_dirs(storage).items(), reverse=True):
        out.append(_scan_step(storage, rank, step, dir_name))
    return out


def _scan_step(storage: Storage, rank: int, step: int, dir_name: str) -> StepStatus:
    path = os.path.join(storage.root, dir_name)
    names = {e.name: e for e in storage.list_dir(dir_name)}
    if commit_name(rank) not in names:
        return StepStatus(step, dir_name, path, complete=False, valid=False,
                          reason=f"no commit record for rank {rank}")
    try:
        record = _read_commit(storage, dir_name, step, rank)
        manifest = _read_manifest(storage, dir_name, step, rank, record)
        header = read_header(storage, dir_name, rank, manifest)
    except (CheckpointIntegrityError, StorageError) as exc:
        return StepStatus(step, dir_name, path, complete=True, valid=False, reason=str(exc))
    return StepStatus(step, dir_name, path, complete=True, valid=True, reason=None,
                      save_id=record.save_id, world_size=record.world_size,
                      shard_size=manifest.shard_size, data_bytes=manifest.data_bytes,
                      committed_unix=record.committed_unix, header=header)


def _read_manifest(storage: Storage, dir_name: str, step: int, rank: int,
                   record: CommitRecord) -> Manifest:
    rel = os.path.join(dir_name, manifest_name(rank))
    path = os.path.join(storage.root, rel)
    manifest = decode_manifest(_read_small(storage, rel), path)
    if (manifest.step, manifest.rank, manifest.save_id, manifest.world_size) != (
        step, rank, record.save_id, record.world_size
    ):
        raise CheckpointIntegrityError("manifest does not match the commit record", step=step,
                                       rank=rank, path=path,
                                       hint="files of different saves are mixed")
    return manifest


def read_header(storage: Storage, dir_name: str, rank: int, manifest: Manifest) -> ShardHeader:
    """Open the shard, check its size, preamble and header against the manifest."""
    rel = os.path.join(dir_name, shard_name(rank))
    path = os.path.join(storage.root, rel)
    fd, size = storage.open_read(rel, manifest.shard_size)
    try:
        pre = bytearray(min(size, PREAMBLE_SIZE))
        storage.pread_into(fd, memoryview(pre), 0)
        version, offset, length, digest = decode_preamble(bytes(pre), size, path)
        raw = bytearray(length)
        storage.pread_into(fd, memoryview(raw), offset)
    finally:
        storage.close(fd)
    if checksum(bytes(raw)) != digest or digest != manifest.header_checksum:
        raise CheckpointIntegrityError("shard header checksum does not match", step=manifest.step,
                                       rank=rank, path=path, hint="the shard is corrupt")
    header = decode_header(bytes(raw), path, file_size=size, header_offset=offset,
                           version=version)
    if (header.step, header.rank, header.save_id, header.world_size) != (
        manifest.step, rank, manifest.save_id, manifest.world_size
    ):
        raise CheckpointIntegrityError("shard header does not match its manifest",
                                       step=manifest.step, rank=rank, path=path,
                                       hint="a shard was swapped between steps or ranks")
    return header


def decode_contents(status: StepStatus, rank: int) -> tuple[dict[str, Any], TrainState]:
    """Decode and validate the state tree and TrainState of a validated step."""
    header = status.header
    if header is None:
        raise CheckpointIntegrityError("step was not validated", step=status.step, rank=rank,
                                       path=status.path)
    try:
        tree = decode_tree(header.tree, status.path, len(header.tensors))
        train_state = TrainState.from_plain(header.train_state)
    except CheckpointIntegrityError as exc:
        raise CheckpointIntegrityError(exc.message, step=status.step, rank=rank,
                                       path=status.path) from exc
    except (StateError, TypeError, ValueError) as exc:
        message = exc.message if isinstance(exc, StateError) else str(exc)
        raise CheckpointIntegrityError(f"train state is invalid: {message}", step=status.step,
                                       rank=rank, path=status.path) from exc
    if train_state.step != status.step:
        raise CheckpointIntegrityError(f"train state says step {train_state.step}",
                                       step=status.step, rank=rank, path=status.path)
    return tree, train_state


def quarantine(storage: Storage, step: int, dir_name: str, rank: int) -> str | None:
    """Move this rank's files of a step aside (kept for inspection, invisible to scans).

    Only this rank's files move, into a directory of this rank's own, so ranks sharing a root
    never touch each other's files. Returns the new directory, or None if nothing was there.
    Runs in a worker thread.
    """
    prefix = f".rank-{rank:05d}."
    own = [e.name for e in storage.list_dir(dir_name)
           if (parse_rank_file(e.name) or (-1, ""))[0] == rank
           or (e.name.startswith(prefix) and TEMP_FILE.match(e.name))]
    if not own:
        return None
    target = rejected_dir_name(step, rank, secrets.token_hex(4))
    storage.make_dir(target)
    for name in own:
        storage.move(os.path.join(dir_name, name), os.path.join(target, name))
    storage.fsync_dir(target)
    tidy_step_dir(storage, dir_name)
    return os.path.join(storage.root, target)
