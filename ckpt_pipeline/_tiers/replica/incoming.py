"""A shard arriving over a copy connection: a temporary file, checked, then published.

Used on both ends of replication: the holder receiving a copy of another rank's shard at save
time, and a rank fetching its own shard from a holder at restore. Either way nothing is
published before every byte has arrived and matches both the xxh3 it was sent with and the
shard's own checksums (header against the manifest, every checksummed range of the data
region against the header), and files are published as a save publishes them: temporary
name, fsync, link to the final name, fsync of the directory, commit record (if any) last.
"""

from __future__ import annotations

import contextlib
import errno
import os

from ..._format.documents import Manifest, decode_manifest
from ..._format.header import ShardHeader
from ..._format.region import checksum
from ..._format.scan import FileSet, tidy_step_dir
from ..._format.shard import PREAMBLE_SIZE, decode_header, decode_preamble
from ...errors import CheckpointError, CheckpointIntegrityError, StorageError
from ...storage import Storage
from .wire import Received

__all__ = ("Incoming",)


class Incoming:
    """One shard file being received into ``dir_name`` of ``storage`` (see the module
    docstring). Not thread-safe: one connection's thread drives it."""

    def __init__(self, storage: Storage, dir_name: str, files: FileSet, size: int) -> None:
        self.storage = storage
        self.dir_name = dir_name
        self.files = files
        self.received = Received(size)
        self.temps: list[str] = []
        self.published: list[str] = []
        self._fd: int | None = None
        for attempt in range(3):  # the directory may vanish under us: a prune or tidy of it
            storage.make_dir(dir_name)
            try:
                self._fd, temp = storage.create_temp(dir_name, files.shard)
                break
            except StorageError as exc:
                if exc.errno != errno.ENOENT or attempt == 2:
                    raise
        self.temps.append(temp)
        self.path = os.path.join(str(storage.root), dir_name, files.shard)

    @property
    def fd(self) -> int:
        """The temporary file being written (for a writer that writes at offsets itself)."""
        assert self._fd is not None
        return self._fd

    def write(self, view: memoryview, offset: int) -> None:
        assert self._fd is not None
        self.storage.pwrite(self._fd, view, offset)

    def verify(self, manifest_raw: bytes, *, step: int, source: int, save_id: str,
               world_size: int) -> tuple[Manifest, ShardHeader]:
        """Check what arrived: complete, manifest and header of the expected save, every
        checksummed range as sent. Raises CheckpointIntegrityError naming what is wrong."""
        path = self.path
        try:
            manifest = decode_manifest(manifest_raw, path)
        except CheckpointError as exc:
            raise CheckpointIntegrityError(f"the manifest that came with the copy: {exc}",
                                           step=step, rank=source, path=path) from exc
        if (manifest.step, manifest.rank, manifest.save_id, manifest.world_size,
                manifest.shard_size) != (step, source, save_id, world_size,
                                         self.received.size):
            raise CheckpointIntegrityError(
                "the manifest that came with the copy is for another save or size",
                step=step, rank=source, path=path)
        self.received.check_complete()
        temp = os.path.join(self.dir_name, self.temps[0])
        fd, size = self.storage.open_read(temp, self.received.size)
        try:
            pre = bytearray(min(size, PREAMBLE_SIZE))
            self.storage.pread_into(fd, memoryview(pre), 0)
            version, offset, length, digest = decode_preamble(bytes(pre), size, path)
            raw = bytearray(length)
            self.storage.pread_into(fd, memoryview(raw), offset)
        finally:
            self.storage.close(fd)
        if checksum(bytes(raw)) != digest or digest != manifest.header_checksum:
            raise CheckpointIntegrityError("the copy's shard header does not match its "
                                           "manifest", step=step, rank=source, path=path)
        header = decode_header(bytes(raw), path, file_size=size, header_offset=offset,
                               version=version)
        if (header.step, header.rank, header.save_id, header.world_size) != (
            step, source, save_id, world_size
        ):
            raise CheckpointIntegrityError("the copy's shard header is for another save",
                                           step=step, rank=source, path=path)
        for start, end, expected in header.checks():
            if self.received.digest_of(start, end) != expected:
                raise CheckpointIntegrityError(
                    f"bytes [{start}, {end}) of the copy do not match the shard's checksum",
                    step=step, rank=source, path=path, hint="the shard is corrupt at its source")
        return manifest, header

    def publish(self, manifest_raw: bytes, commit_raw: bytes | None = None) -> None:
        """Make the shard durable under its final name, then the manifest, then (if given)
        the commit record; the directory is fsynced after each."""
        fd, self._fd = self._fd, None
        assert fd is not None
        try:
            self.storage.fsync(fd)
        finally:
            self.storage.close(fd)
        self._publish(self.temps[0], self.files.shard)
        self.publish_small(self.files.manifest, manifest_raw)
        if commit_raw is not None:
            self.publish_small(self.files.commit, commit_raw)

    def publish_small(self, final: str, data: bytes) -> None:
        fd, temp = self.storage.create_temp(self.dir_name, final)
        self.temps.append(temp)
        try:
            self.storage.pwrite(fd, memoryview(data), 0)
            self.storage.fsync(fd)
        finally:
            self.storage.close(fd)
        self._publish(temp, final)

    def _publish(self, temp: str, final: str) -> None:
        self.storage.publish(self.dir_name, temp, final)
        self.temps.remove(temp)
        self.published.append(final)
        self.storage.fsync_dir(self.dir_name)

    def discard(self) -> None:
        """Take everything this reception put on disk off it again (commit record first)."""
        if self._fd is not None:
            with contextlib.suppress(StorageError):
                self.storage.close(self._fd)
            self._fd = None
        names = sorted(self.published, key=lambda n: not n.endswith(".commit"))
        for name in [*names, *self.temps]:
            with contextlib.suppress(StorageError):
                self.storage.unlink(os.path.join(self.dir_name, name))
                if name.endswith(".commit"):
                    self.storage.fsync_dir(self.dir_name)
        self.published.clear()
        self.temps.clear()
        with contextlib.suppress(StorageError):
            tidy_step_dir(self.storage, self.dir_name)
