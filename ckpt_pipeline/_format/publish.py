"""Publishing a file set in a step directory, and undoing it: the one mechanism the save path,
replication and the persistent tier's download share.

A file is published as: create a temporary name, write everything, fsync, close, link to the
final name (never replacing one), fsync the directory; the commit record, if any, last. Whoever
writes a set records each temporary and each published name in a ``PendingFiles``; a set that
fails, or is abandoned, is taken off the disk by ``PendingFiles.remove``, commit record first
and durably so, so that nothing on disk looks complete while the rest goes. ``ArrivingShard``
is a set whose shard arrives from elsewhere (a copy connection, the persistent tier) at offsets
of a temporary file, published with its manifest and commit record once it is all there.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass, field

from ..errors import CheckpointError, StorageError
from ..storage import Storage
from .filesets import FileSet
from .tidy import tidy_step_dir

__all__ = ("ArrivingShard", "PendingFiles", "close_quietly", "publish_file")


def close_quietly(storage: Storage, fd: int) -> None:
    """Close a descriptor on a path that is failing already: a close error adds nothing."""
    with contextlib.suppress(StorageError):
        storage.close(fd)


def _write_durably(storage: Storage, fd: int, data: bytes) -> None:
    """Write all of ``data`` to the new file ``fd``, fsync and close it."""
    try:
        storage.pwrite(fd, memoryview(data), 0)
        storage.fsync(fd)
    except BaseException:
        close_quietly(storage, fd)
        raise
    storage.close(fd)


def publish_file(storage: Storage, dir_name: str, final: str, data: bytes) -> None:
    """Publish one small file of its own (no set to undo: a retention marker, a rewind
    record) durably as ``final`` in ``dir_name``; its temporary is removed again if that
    fails. Worker thread."""
    fd, temp = storage.create_temp(dir_name, final)
    try:
        _write_durably(storage, fd, data)
        storage.publish(dir_name, temp, final)
    except CheckpointError:
        with contextlib.suppress(CheckpointError):
            storage.unlink(os.path.join(dir_name, temp))
        raise
    storage.fsync_dir(dir_name)


@dataclass(slots=True)
class PendingFiles:
    """What one writer of a file set has on disk so far in a step directory, uncommitted (see
    the module docstring). A committed set never reaches ``remove``."""

    dir_name: str = ""
    """The step directory (relative to the root), once the writer created it."""
    fd: int | None = None
    """The temporary shard while it is open for writing."""
    temps: list[str] = field(default_factory=list)
    published: list[str] = field(default_factory=list)

    def created(self, temp: str) -> None:
        self.temps.append(temp)

    def published_as(self, temp: str, final: str) -> None:
        """``temp`` was linked to its final name (and unlinked)."""
        self.temps.remove(temp)
        self.published.append(final)

    def publish(self, storage: Storage, temp: str, final: str) -> None:
        """Link the closed, fsynced temporary ``temp`` to ``final`` (the directory's fsync is
        the caller's: one may cover several files)."""
        storage.publish(self.dir_name, temp, final)
        self.published_as(temp, final)

    def publish_small(self, storage: Storage, final: str, data: bytes) -> None:
        """Publish ``data`` durably as ``final`` (directory fsynced too). Worker thread."""
        fd, temp = storage.create_temp(self.dir_name, final)
        self.created(temp)
        _write_durably(storage, fd, data)
        self.publish(storage, temp, final)
        storage.fsync_dir(self.dir_name)

    def remove(self, storage: Storage) -> None:
        """Undo: the temporaries and the published files of the set (commit record first,
        its removal durable before the data go), then tidy the directory. Worker thread."""
        if self.fd is not None:
            close_quietly(storage, self.fd)
            self.fd = None
        if not self.dir_name:
            return
        names = sorted(self.published, key=lambda n: not n.endswith(".commit"))
        for name in [*names, *self.temps]:
            with contextlib.suppress(StorageError):
                storage.unlink(os.path.join(self.dir_name, name))
                if name.endswith(".commit"):
                    storage.fsync_dir(self.dir_name)  # gone for good before the data go
        self.published.clear()
        self.temps.clear()
        with contextlib.suppress(StorageError):
            tidy_step_dir(storage, self.dir_name)


class ArrivingShard:
    """A file set of ``dir_name`` whose shard arrives from elsewhere: a temporary file that
    the receiver writes at offsets, then ``publish``. Not thread-safe: one thread drives it."""

    def __init__(self, storage: Storage, dir_name: str, files: FileSet) -> None:
        self.storage = storage
        self.dir_name = dir_name
        self.files = files
        self.pending = PendingFiles(dir_name)
        for attempt in range(3):  # the directory may vanish under us: a prune or tidy of it
            storage.make_dir(dir_name)
            try:
                fd, temp = storage.create_temp(dir_name, files.shard)
                break
            except StorageError as exc:
                if exc.errno != errno.ENOENT or attempt == 2:
                    raise
        self.pending.fd = fd
        self.pending.created(temp)
        self.temp = temp
        """The shard's temporary name in ``dir_name``."""
        self.path = os.path.join(str(storage.root), dir_name, files.shard)
        """The shard's final path (errors name it)."""

    @property
    def fd(self) -> int:
        """The temporary file being written (for a writer that writes at offsets itself)."""
        assert self.pending.fd is not None
        return self.pending.fd

    def write(self, view: memoryview, offset: int) -> None:
        self.storage.pwrite(self.fd, view, offset)

    def publish(self, manifest_raw: bytes, commit_raw: bytes | None = None) -> None:
        """Make the shard durable under its final name, then the manifest, then (if given)
        the commit record; the directory is fsynced after each."""
        fd, self.pending.fd = self.pending.fd, None
        assert fd is not None
        try:
            self.storage.fsync(fd)
        finally:
            self.storage.close(fd)
        self.pending.publish(self.storage, self.temp, self.files.shard)
        self.storage.fsync_dir(self.dir_name)
        self.pending.publish_small(self.storage, self.files.manifest, manifest_raw)
        if commit_raw is not None:
            self.publish_commit(commit_raw)

    def publish_commit(self, commit_raw: bytes) -> None:
        """Publish the set's commit record (last: the set is complete once it is durable)."""
        self.pending.publish_small(self.storage, self.files.commit, commit_raw)

    def discard(self) -> None:
        """Take everything this arrival put on disk off it again (commit record first)."""
        self.pending.remove(self.storage)
