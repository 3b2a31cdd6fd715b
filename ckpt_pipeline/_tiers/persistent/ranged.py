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

from ..._format.filesets import FileSet
from ..._format.names import step_dir_name
from ..._format.scan import StepStatus, check_arriving
from ...errors import CheckpointError, StorageError
from .layout import StepRecord, rank_keys
from .remote import Remote
from .stream import fetch_small

__all__ = ("RemoteShard",)


class RemoteShard:
    """One saved rank's shard of a persisted step, as a ``RangeSource`` (``open_read``,
    ``pread_into``, ``close``) over the object that holds it. ``bytes`` counts what was read
    from the store. Thread-safe."""

    def __init__(self, remote: Remote, record: StepRecord, rank: int) -> None:
        self.remote = remote
        self.step = record.step
        self.rank = rank
        self.files = FileSet(rank)
        self.dir_name = step_dir_name(record.step)
        try:
            self.small = fetch_small(remote, record, rank)
            self.size = record.rank_objects(rank)[self.files.shard].size
        except CheckpointError as exc:
            raise self._named(exc) from None
        self.key = rank_keys(record.step, rank)[self.files.shard]
        self.bytes = 0
        self._lock = threading.Lock()

    @property
    def root(self) -> str:
        return self.remote.url.rstrip("/")

    def status(self) -> StepStatus:
        """The shard's files checked as a restore checks any shard's: the commit record and
        the manifest (against the commit object already), the header against the manifest."""
        try:
            return check_arriving(self, self.step, self.dir_name, self.rank,
                                  commit_raw=self.small[self.files.commit],
                                  manifest_raw=self.small[self.files.manifest],
                                  shard_file=self.files.shard)
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

    def _named(self, exc: CheckpointError) -> CheckpointError:
        """``exc`` with this shard's step and rank where it names neither."""
        exc.step = self.step if exc.step is None else exc.step
        exc.rank = self.rank if exc.rank is None else exc.rank
        return exc
