"""A shard arriving over a copy connection: a temporary file, checked, then published.

Used on both ends of replication: the holder receiving a copy of another rank's shard at save
time, and a rank fetching its own shard from a holder at restore. Either way nothing is
published before every byte has arrived and matches both the xxh3 it was sent with and the
shard's own checksums (header against the manifest, every checksummed range of the data
region against the header), and files are published as a save publishes them: temporary
name, fsync, link to the final name, fsync of the directory, commit record (if any) last
(``_format/publish.py``: ``ArrivingShard``).
"""

from __future__ import annotations

import os

from ..._format.documents import Manifest, decode_manifest
from ..._format.filesets import FileSet
from ..._format.header import ShardHeader
from ..._format.publish import ArrivingShard
from ..._format.scan import ARRIVING_COPY, read_shard_header
from ...errors import CheckpointError, CheckpointIntegrityError
from ...storage import Storage
from .wire import Received

__all__ = ("Incoming",)


class Incoming(ArrivingShard):
    """One shard file being received over a copy connection into ``dir_name`` of ``storage``
    (see the module docstring): what has arrived (``received``), checked by ``verify``."""

    def __init__(self, storage: Storage, dir_name: str, files: FileSet, size: int) -> None:
        super().__init__(storage, dir_name, files)
        self.received = Received(size)

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
        header = read_shard_header(self.storage, os.path.join(self.dir_name, self.temp),
                                   manifest, path=path, wording=ARRIVING_COPY)
        for start, end, expected in header.checks():
            if self.received.digest_of(start, end) != expected:
                raise CheckpointIntegrityError(
                    f"bytes [{start}, {end}) of the copy do not match the shard's checksum",
                    step=step, rank=source, path=path, hint="the shard is corrupt at its source")
        return manifest, header
