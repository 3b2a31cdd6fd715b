"""Listing the steps of a root and reading the commit records in them.

Every name from disk is matched against a strict pattern (``names.py``); a commit record or
manifest is read whole, at most ``MAX_SMALL_FILE_BYTES``, and must be for the step and rank it
is read as.
"""

from __future__ import annotations

import os

from ..errors import CheckpointError, CheckpointIntegrityError, StorageError
from ..storage import Storage
from .documents import CommitRecord, decode_commit
from .filesets import FileSet, rank_sets
from .limits import MAX_SMALL_FILE_BYTES
from .names import parse_step_dir

__all__ = ("check_commit", "committed_steps", "read_commit", "read_small", "readable_commit",
           "step_dirs")




def step_dirs(storage: Storage) -> dict[int, str]:
    """Step directories under the root, by step (names that do not match are ignored)."""
    out: dict[int, str] = {}
    for entry in storage.list_dir(""):
        step = parse_step_dir(entry.name)
        if step is not None and entry.is_dir and not entry.is_symlink:
            out[step] = entry.name
    return out


def read_small(storage: Storage, rel: str) -> bytes:
    """The whole of a small file (a commit record, a manifest): CheckpointIntegrityError if
    it is larger than any can be, StorageError if it cannot be read."""
    fd, size = storage.open_read(rel)
    try:
        if size > MAX_SMALL_FILE_BYTES:
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
    return check_commit(read_small(storage, rel), os.path.join(storage.root, rel), step, rank)


def readable_commit(storage: Storage, dir_name: str, step: int, rank: int,
                    files: FileSet | None = None) -> CommitRecord | None:
    """``read_commit``, or None where the record is missing, unreadable or for another step
    or rank (for a listing, which reports such a set and goes on)."""
    try:
        return read_commit(storage, dir_name, step, rank, files)
    except CheckpointError:
        return None


def check_commit(raw: bytes, path: str, step: int, rank: int) -> CommitRecord:
    """Decode a commit record and check that it is for ``step`` and ``rank``."""
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

