"""The cheap validation of a rank's file sets: commit record, manifest, shard size and header
agree, without reading the tensor data (each step's ``StepStatus``); and the decoding of a
validated step's state tree and TrainState.

Every file is opened without following symlinks and must be a regular file of the size its
manifest records; the data's checksums are checked where the data are read (``_restore/read.py``).
``read_shard_header`` is the one check of a shard's header against its manifest, for files on
disk and for a copy that is still arriving (replication, the persistent tier's download).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointIntegrityError, StateError, StorageError
from ..storage import RangeSource, Storage
from ..train_state import TrainState
from .documents import CommitRecord, Manifest, decode_manifest, decode_tree
from .filesets import FileSet, owned_sets, rank_sets
from .header import ShardHeader
from .region import checksum
from .shard import PREAMBLE_SIZE, decode_header, decode_preamble
from .steps import check_commit, read_commit, read_small, step_dirs
from .timeline import Lineage

__all__ = (
    "ARRIVING_COPY",
    "ON_DISK",
    "HeaderWording",
    "StepStatus",
    "check_arriving",
    "decode_contents",
    "read_shard_header",
    "scan",
    "scan_files",
    "scan_replicas",
)




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


def scan(storage: Storage, rank: int) -> list[StepStatus]:
    """Cheaply validate this rank's files of every step, newest first. Worker thread."""
    out: list[StepStatus] = []
    for step, dir_name in sorted(step_dirs(storage).items(), reverse=True):
        out.append(scan_files(storage, FileSet(rank), step, dir_name))
    return out


def scan_any_copy(storage: Storage, rank: int) -> list[StepStatus]:
    """``scan`` of ``rank``'s shard as the root holds it in any name, newest first
    (``scan_any_name`` of every step). For a reshard, which reads other ranks' shards from
    wherever the root has them. Worker thread."""
    return [scan_any_name(storage, rank, step, dir_name)
            for step, dir_name in sorted(step_dirs(storage).items(), reverse=True)]


def scan_any_name(storage: Storage, rank: int, step: int, dir_name: str,
                  save_id: str | None = None) -> StepStatus:
    """``rank``'s files of one step under any name the root holds them: its own, else the
    first valid copy another rank holds of it (by holder); of save ``save_id`` when given. The
    status of its own files (which says why not) where none is valid. Worker thread."""
    names = {e.name for e in storage.list_dir(dir_name)}
    found = [scan_files(storage, files, step, dir_name, names)
             for files in rank_sets(names, rank)]
    return next((s for s in found if s.valid and save_id in (None, s.save_id)), found[0])


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
        rel = os.path.join(dir_name, files.shard)
        header = read_shard_header(storage, rel, manifest, path=os.path.join(storage.root, rel))
    except (CheckpointIntegrityError, StorageError) as exc:
        return StepStatus(step, dir_name, path, complete=True, valid=False,
                          reason=f"{exc}{what}", files=files)
    return StepStatus(step, dir_name, path, complete=True, valid=True, reason=None,
                      save_id=record.save_id, world_size=record.world_size,
                      shard_size=manifest.shard_size, data_bytes=manifest.data_bytes,
                      committed_unix=record.committed_unix, header=header, files=files,
                      lineage=record.lineage)


def check_arriving(storage: RangeSource, step: int, dir_name: str, rank: int, *,
                   commit_raw: bytes, manifest_raw: bytes, shard_file: str) -> StepStatus:
    """``scan_files`` for this rank's files of a step that are still arriving: the commit
    record and manifest as bytes (not yet published), the shard under a temporary name in
    ``dir_name`` whose preamble and header have arrived. Raises CheckpointIntegrityError (or
    StorageError) naming what does not agree."""
    path = os.path.join(storage.root, dir_name)
    files = FileSet(rank)
    record = check_commit(commit_raw, os.path.join(path, files.commit), step, rank)
    manifest = _check_manifest(manifest_raw, os.path.join(path, files.manifest), step, rank,
                               record)
    rel = os.path.join(dir_name, shard_file)
    header = read_shard_header(storage, rel, manifest, path=os.path.join(storage.root, rel))
    return StepStatus(step, dir_name, path, complete=True, valid=True, reason=None,
                      save_id=record.save_id, world_size=record.world_size,
                      shard_size=manifest.shard_size, data_bytes=manifest.data_bytes,
                      committed_unix=record.committed_unix, header=header, files=files,
                      lineage=record.lineage)


def _read_manifest(storage: Storage, dir_name: str, step: int, rank: int,
                   record: CommitRecord, files: FileSet | None = None) -> Manifest:
    rel = os.path.join(dir_name, (files or FileSet(rank)).manifest)
    return _check_manifest(read_small(storage, rel), os.path.join(storage.root, rel), step,
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


@dataclass(frozen=True, slots=True)
class HeaderWording:
    """How ``read_shard_header`` reports a header that does not check out: as a file on disk
    (``ON_DISK``) or as a copy that arrived from elsewhere (``ARRIVING_COPY``)."""

    corrupt: str
    """Its checksum matches neither the preamble's nor the manifest's."""
    corrupt_hint: str | None
    other_save: str
    """It names another step, rank, save or world size than its manifest."""
    other_save_hint: str | None


ON_DISK = HeaderWording("shard header checksum does not match", "the shard is corrupt",
                        "shard header does not match its manifest",
                        "a shard was swapped between steps or ranks")
ARRIVING_COPY = HeaderWording("the copy's shard header does not match its manifest", None,
                              "the copy's shard header is for another save", None)


def read_shard_header(storage: RangeSource, rel: str, manifest: Manifest, *, path: str,
                      wording: HeaderWording = ON_DISK) -> ShardHeader:
    """Open the shard file ``rel`` (it must be the manifest's ``shard_size``), decode its
    preamble and header, and check the header against ``manifest``: its checksum, and the
    step, rank, save and world size it names. ``path`` names the shard in errors."""
    fd, size = storage.open_read(rel, manifest.shard_size)
    try:
        pre = bytearray(min(size, PREAMBLE_SIZE))
        storage.pread_into(fd, memoryview(pre), 0)
        version, offset, length, digest = decode_preamble(bytes(pre), size, path)
        raw = bytearray(length)
        storage.pread_into(fd, memoryview(raw), offset)
    finally:
        storage.close(fd)
    step, rank = manifest.step, manifest.rank
    if checksum(bytes(raw)) != digest or digest != manifest.header_checksum:
        raise CheckpointIntegrityError(wording.corrupt, step=step, rank=rank, path=path,
                                       hint=wording.corrupt_hint)
    header = decode_header(bytes(raw), path, file_size=size, header_offset=offset,
                           version=version)
    if (header.step, header.rank, header.save_id, header.world_size) != (
        step, rank, manifest.save_id, manifest.world_size
    ):
        raise CheckpointIntegrityError(wording.other_save, step=step, rank=rank, path=path,
                                       hint=wording.other_save_hint)
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

