"""Recovery: scrub what crashed saves left, scan and validate steps, read shards back.

Every name from disk is matched against a strict pattern, every file is opened without
following symlinks and must be a regular file of the size its manifest records, and every byte
of tensor data is checked against its xxh3 checksum before it is used.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from .._crash import crash_point
from ..errors import CheckpointIntegrityError, StateError, StorageError
from ..storage import Storage
from ..train_state import TrainState
from .documents import CommitRecord, Manifest, decode_commit, decode_manifest, decode_tree
from .header import ShardHeader
from .names import (
    foreign_dir_name,
    parse_rank_file,
    parse_replica_file,
    parse_step_dir,
    rejected_dir_name,
    replica_name,
    rewound_dir_name,
    temp_owner,
)
from .region import checksum
from .shard import PREAMBLE_SIZE, decode_header, decode_preamble
from .timeline import Lineage

__all__ = (
    "FileSet",
    "StepStatus",
    "check_arriving",
    "committed_steps",
    "decode_contents",
    "owned_sets",
    "quarantine",
    "rank_sets",
    "read_commit",
    "read_header",
    "scan",
    "scan_replicas",
    "scrub",
    "set_aside_files",
    "step_dirs",
    "tidy_step_dir",
)

_SMALL_LIMIT = 1024 * 1024
_STAGING_BYTES = 8 * 1024 * 1024  # pinned piece size for reads bound for a GPU


@dataclass(frozen=True, slots=True)
class FileSet:
    """The three files of one rank's shard of a step, as one rank holds them: its own
    (``rank-S.*``, ``holder`` None) or a copy held for rank ``source`` (``replica-S-on-H.*``).
    The files are the same bytes either way; only the names differ."""

    source: int
    holder: int | None = None

    def name(self, kind: str) -> str:
        if self.holder is None:
            return f"rank-{self.source:05d}.{kind}"
        return replica_name(self.source, self.holder, kind)

    @property
    def shard(self) -> str:
        return self.name("shard")

    @property
    def manifest(self) -> str:
        return self.name("manifest")

    @property
    def commit(self) -> str:
        return self.name("commit")

    def names(self) -> tuple[str, str, str]:
        """Commit record first: the order in which a set is taken off the disk."""
        return self.commit, self.manifest, self.shard


def owned_sets(names: Iterable[str], rank: int) -> list[FileSet]:
    """The file sets ``rank`` owns among ``names`` (its own and the copies it holds), each
    named by at least one of its files."""
    out: dict[tuple[int, int | None], FileSet] = {}
    for name in names:
        parsed = parse_rank_file(name)
        if parsed is not None and parsed[0] == rank:
            out.setdefault((rank, None), FileSet(rank))
            continue
        replica = parse_replica_file(name)
        if replica is not None and replica[1] == rank:
            out.setdefault((replica[0], rank), FileSet(replica[0], rank))
    return sorted(out.values(), key=lambda f: (f.holder is not None, f.source))


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
    files: FileSet | None = None
    """Which files were looked at (None: this rank's own)."""
    lineage: Lineage | None = None
    """The commit record's lineage (None: none recorded)."""

    @property
    def source(self) -> int | None:
        """The rank whose shard this is, for a copy; None for the scanning rank's own."""
        return None if self.files is None or self.files.holder is None else self.files.source

    @property
    def shard_file(self) -> str | None:
        return None if self.files is None else self.files.shard


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


def read_commit(storage: Storage, dir_name: str, step: int, rank: int,
                 files: FileSet | None = None) -> CommitRecord:
    """The commit record of ``rank``'s files of ``step`` (``files``: a copy's), checked to be
    for that step and rank; CheckpointIntegrityError or StorageError otherwise."""
    rel = os.path.join(dir_name, (files or FileSet(rank)).commit)
    return _check_commit(_read_small(storage, rel), os.path.join(storage.root, rel), step, rank)


def _check_commit(raw: bytes, path: str, step: int, rank: int) -> CommitRecord:
    record = decode_commit(raw, path)
    if record.step != step or record.rank != rank:
        raise CheckpointIntegrityError(
            f"commit record is for step {record.step} rank {record.rank}", step=step,
            rank=rank, path=path, hint="a file was moved between steps or ranks")
    return record


def committed_steps(storage: Storage, rank: int, *, copies: bool = False) -> dict[int, str]:
    """Steps with this rank's commit record, keyed by the step recorded inside it; with
    ``copies``, also the steps where only a copy of the rank's files, held by another rank,
    is committed."""
    out: dict[int, str] = {}
    for step, dir_name in step_dirs(storage).items():
        names = {e.name for e in storage.list_dir(dir_name)}
        sets = rank_sets(names, rank) if copies else [FileSet(rank)]
        for files in sets:
            if files.commit not in names:
                continue
            try:
                record = read_commit(storage, dir_name, step, rank, files)
            except (CheckpointIntegrityError, StorageError):
                continue
            out[record.step] = dir_name
            break
    return out


def rank_sets(names: Collection[str], rank: int) -> list[FileSet]:
    """The file sets of ``rank``'s shard in a step directory holding ``names``: its own
    first, then each committed copy another rank holds of it, by holder."""
    holders = sorted(parsed[1] for parsed in map(parse_replica_file, names)
                     if parsed is not None and parsed[0] == rank and parsed[2] == "commit")
    return [FileSet(rank), *(FileSet(rank, holder) for holder in holders)]


def scrub(storage: Storage, rank: int) -> list[tuple[str, int]]:
    """Remove this rank's temporaries and uncommitted files; return (path, bytes) removed.

    This rank's files are its own and the copies it holds for other ranks; a copy without its
    commit record is uncommitted too. A committed step is never touched. Runs in a worker thread, before any save starts.
    """
    removed: list[tuple[str, int]] = []
    for _step, dir_name in sorted(step_dirs(storage).items()):
        entries = storage.list_dir(dir_name)
        names = {e.name for e in entries}
        uncommitted = {name for files in owned_sets(names, rank) if files.commit not in names
                       for name in files.names()}
        for entry in entries:
            own_temp = temp_owner(entry.name) == rank
            if (own_temp or entry.name in uncommitted) and not entry.is_dir:
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


def scan_replicas(storage: Storage, rank: int) -> list[StepStatus]:
    """Cheaply validate every copy this rank holds for other ranks, newest step first (then
    by source rank). Worker thread."""
    out: list[StepStatus] = []
    for step, dir_name in sorted(step_dirs(storage).items(), reverse=True):
        names = {e.name for e in storage.list_dir(dir_name)}
        for files in owned_sets(names, rank):
            if files.holder is not None:
                out.append(scan_files(storage, files, step, dir_name, names))
    return out


def _scan_step(storage: Storage, rank: int, step: int, dir_name: str) -> StepStatus:
    return scan_files(storage, FileSet(rank), step, dir_name)


def scan_files(storage: Storage, files: FileSet, step: int, dir_name: str,
               names: Collection[str] | None = None) -> StepStatus:
    """Cheaply validate one file set of a step: commit record, manifest, shard size, header."""
    rank = files.source
    path = os.path.join(storage.root, dir_name)
    if names is None:
        names = {e.name for e in storage.list_dir(dir_name)}
    what = "" if files.holder is None else f" (copy held by rank {files.holder})"
    if files.commit not in names:
        return StepStatus(step, dir_name, path, complete=False, valid=False,
                          reason=f"no commit record for rank {rank}{what}", files=files)
    try:
        record = read_commit(storage, dir_name, step, rank, files)
        manifest = _read_manifest(storage, dir_name, step, rank, record, files)
        header = read_header(storage, dir_name, rank, manifest, files)
    except (CheckpointIntegrityError, StorageError) as exc:
        return StepStatus(step, dir_name, path, complete=True, valid=False,
                          reason=f"{exc}{what}", files=files)
    return StepStatus(step, dir_name, path, complete=True, valid=True, reason=None,
                      save_id=record.save_id, world_size=record.world_size,
                      shard_size=manifest.shard_size, data_bytes=manifest.data_bytes,
                      committed_unix=record.committed_unix, header=header, files=files,
                      lineage=record.lineage)


def check_arriving(storage: Storage, step: int, dir_name: str, rank: int, *,
                   commit_raw: bytes, manifest_raw: bytes, shard_file: str) -> StepStatus:
    """``scan_files`` for this rank's files of a step that are still arriving: the commit
    record and manifest as bytes (not yet published), the shard under a temporary name in
    ``dir_name`` whose preamble and header have arrived. Raises CheckpointIntegrityError (or
    StorageError) naming what does not agree."""
    path = os.path.join(storage.root, dir_name)
    files = FileSet(rank)
    record = _check_commit(commit_raw, os.path.join(path, files.commit), step, rank)
    manifest = _check_manifest(manifest_raw, os.path.join(path, files.manifest), step, rank,
                               record)
    header = read_header(storage, dir_name, rank, manifest, files, shard_file)
    return StepStatus(step, dir_name, path, complete=True, valid=True, reason=None,
                      save_id=record.save_id, world_size=record.world_size,
                      shard_size=manifest.shard_size, data_bytes=manifest.data_bytes,
                      committed_unix=record.committed_unix, header=header, files=files,
                      lineage=record.lineage)


def _read_manifest(storage: Storage, dir_name: str, step: int, rank: int,
                   record: CommitRecord, files: FileSet | None = None) -> Manifest:
    rel = os.path.join(dir_name, (files or FileSet(rank)).manifest)
    return _check_manifest(_read_small(storage, rel), os.path.join(storage.root, rel), step,
                           rank, record)


def _check_manifest(raw: bytes, path: str, step: int, rank: int,
                    record: CommitRecord) -> Manifest:
    manifest = decode_manifest(raw, path)
    if (manifest.step, manifest.rank, manifest.save_id, manifest.world_size) != (
        step, rank, record.save_id, record.world_size
    ):
        raise CheckpointIntegrityError("manifest does not match the commit record", step=step,
                                       rank=rank, path=path,
                                       hint="files of different saves are mixed")
    return manifest


def read_header(storage: Storage, dir_name: str, rank: int, manifest: Manifest,
                files: FileSet | None = None, shard_file: str | None = None) -> ShardHeader:
    """Open the shard (``shard_file`` in ``dir_name``, default the file set's), check its size,
    preamble and header against the manifest."""
    rel = os.path.join(dir_name, shard_file or (files or FileSet(rank)).shard)
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


def quarantine(storage: Storage, step: int, dir_name: str, rank: int, *,
               own_only: bool = False, rewound_to: int | None = None) -> str | None:
    """Move this rank's files of a step aside (kept for inspection, invisible to scans).

    Only this rank's files move (its own, and the copies it holds), into a directory of this
    rank's own, so ranks sharing a root never touch each other's files. ``own_only``: only
    its own shard's files (a corrupt shard about to be replaced by a fetched copy).
    ``rewound_to``: the step is abandoned by a rewind to that step (the directory is named
    so; retention removes it, see ``retain.py``). Returns the new directory, or None if
    nothing was there. Runs in a worker thread.
    """
    names = [e.name for e in storage.list_dir(dir_name)]
    held = {name for files in owned_sets(names, rank)
            if not (own_only and files.holder is not None) for name in files.names()}
    own = [name for name in names if name in held or temp_owner(name) == rank]
    if not own:
        return None
    token = secrets.token_hex(4)
    target = (rejected_dir_name(step, rank, token) if rewound_to is None
              else rewound_dir_name(step, rewound_to, rank, token))
    storage.make_dir(target)
    for name in own:
        storage.move(os.path.join(dir_name, name), os.path.join(target, name))
    storage.fsync_dir(target)
    tidy_step_dir(storage, dir_name)
    return os.path.join(storage.root, target)


def set_aside_files(storage: Storage, step: int, dir_name: str, rank: int,
                    sets: Iterable[FileSet], *, foreign: bool
                    ) -> tuple[str, tuple[str, ...]] | None:
    """Move the file sets ``sets`` of this rank (its own, copies it holds) of a step aside,
    into a directory of its own: labelled as another save's files (``foreign``:
    ``foreign_dir_name``) or as rejected by recovery. Kept for inspection, invisible to
    scans, never loaded. Returns the new directory and the names moved, or None if none of the
    files was there. Runs in a worker thread."""
    names = {e.name for e in storage.list_dir(dir_name)}
    moving = [name for files in sets for name in files.names() if name in names]
    if not moving:
        return None
    token = secrets.token_hex(4)
    target = (foreign_dir_name if foreign else rejected_dir_name)(step, rank, token)
    storage.make_dir(target)
    for name in moving:
        storage.move(os.path.join(dir_name, name), os.path.join(target, name))
    storage.fsync_dir(target)
    tidy_step_dir(storage, dir_name)
    return os.path.join(storage.root, target), tuple(moving)
