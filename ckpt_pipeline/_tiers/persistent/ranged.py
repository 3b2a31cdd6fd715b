"""A saved rank's shard of a persisted step, read in byte ranges straight from the store.

A reshard needs only some ranges of each saved rank's shard. Where the root lacks a saved
rank's files, it reads them from the persistent tier this way (``RemoteShard``) rather than
downloading the whole shard first: the manifest and commit record are fetched and checked
against the step's commit object (``fetch_small``), then the preamble and the header are read
as ranges and the header checked against the manifest's checksum of it (``check_arriving``,
as for any shard), and then each range the reshard plans is read, in requests of at most the
tier's ``part_bytes``, and verified by its checksum blocks (``_reshard/ranges.py``) before any
of its bytes is used. Nothing is written to the root.
"""

from __future__ import annotations

import threading

from ..._format.scan import StepStatus
from ...errors import CheckpointError, StorageError
from .layout import StepRecord
from .remote import Remote
from .stream import RankObjects

__all__ = ("RemoteShard",)


class RemoteShard(RankObjects):
    """One saved rank's shard of a persisted step, as a ``RangeSource`` (``open_read``,
    ``pread_into``, ``close``) over the object that holds it. ``bytes`` counts what was read
    from the store. Thread-safe."""

    def __init__(self, remote: Remote, record: StepRecord, rank: int) -> None:
        super().__init__(remote, record, rank)
        self.size = self.shard.size
        self.bytes = 0
        self._lock = threading.Lock()

    @property
    def root(self) -> str:
        return self.remote.url.rstrip("/")

    def status(self) -> StepStatus:
        """The shard's files checked as a restore checks any shard's (``check``)."""
        try:
            return self.check(self, self.files.shard)
        except CheckpointError as exc:
            raise self._named(exc) from None

    def open_read(self, rel: str, expected_size: int | None = None) -> tuple[int, int]:
        if expected_size is not None and expected_size != self.size:
            raise StorageError(f"size is {self.size} bytes, expected {expected_size}",
                               path=f"{self.root}/{self.key}", step=self.step, rank=self.rank,
                               hint="the object is not the one the commit object lists; "
                                    "restore another step")
        return 0, self.size

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> None:
        if offset < 0 or offset + len(buf) > self.size:
            raise StorageError(f"bytes [{offset}, {offset + len(buf)}) lie beyond the "
                               f"{self.size} bytes of the object", path=f"{self.root}/{self.key}",
                               step=self.step, rank=self.rank, hint="the shard is corrupt")
        try:
            self.remote.read_into(self.key, offset, buf)
        except CheckpointError as exc:
            raise self._named(exc) from None
        with self._lock:
            self.bytes += len(buf)

    def close(self, fd: int) -> None:
        return None
