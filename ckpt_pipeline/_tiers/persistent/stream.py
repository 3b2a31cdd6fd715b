"""A rank's shard of a persisted step, downloaded into its root while the restore reads it.

The manifest and commit record are fetched first and checked against the step's commit
object. The shard then arrives in a temporary file of the step's directory (sized up front),
``threads`` parts at once, each checked against the commit object before it is written: the
first and last parts first (the preamble and the header, which the restore needs before
anything else), then the data in file order. The restore reads the temporary file as the parts
land (``wait``), so its reads, checksums and host-to-device copies overlap the download. When
the restore has read everything, ``publish`` makes the files durable under their final names
as a save does (commit record last), so the step stays in the local tier; ``discard`` stops the
download and removes everything it wrote.
"""

from __future__ import annotations

import os
import threading
import time

from ..._format.filesets import FileSet
from ..._format.names import step_dir_name
from ..._format.publish import ArrivingShard
from ..._format.scan import StepStatus, check_arriving
from ..._format.shard import PREAMBLE_SIZE, decode_preamble
from ...errors import CheckpointError, CheckpointIntegrityError, StorageError
from ...storage import RangeSource, Storage
from .layout import MAX_COMMIT_BYTES, StepRecord, rank_keys
from .remote import ObjectSum, Remote

__all__ = ("RankObjects", "ShardStream", "fetch_small")


class _Stopped(Exception):
    """Raised into the download by ``discard``: the parts not started are dropped."""


def fetch_small(remote: Remote, record: StepRecord, rank: int) -> dict[str, bytes]:
    """``rank``'s manifest and commit record of ``record``'s step, each checked against the
    commit object: ``{file name: bytes}``."""
    step, files = record.step, FileSet(rank)
    sums = record.rank_objects(rank)
    if len(sums) != 3:
        raise CheckpointIntegrityError(f"the commit object does not list rank {rank}'s files",
                                       step=step, rank=rank, path=remote.url)
    keys = rank_keys(step, rank)
    small: dict[str, bytes] = {}
    for name in (files.manifest, files.commit):
        raw = remote.get_small(keys[name], MAX_COMMIT_BYTES)
        expected = sums[name]
        if raw is None or ObjectSum.of(raw, expected.part_bytes) != expected:
            where = f"{remote.url}/{keys[name]}"
            raise CheckpointIntegrityError(
                f"{where} is " + ("missing" if raw is None else "not what was uploaded"),
                step=step, rank=rank, path=where)
        small[name] = raw
    return small


class RankObjects:
    """One rank's files of a persisted step in the store: the manifest and commit record,
    fetched and checked against the step's commit object (``small``), and the shard's
    object (``key``, its ``shard`` sum), which a ``ShardStream`` downloads and a reshard's
    ``RemoteShard`` (``ranged.py``) reads in ranges."""

    def __init__(self, remote: Remote, record: StepRecord, rank: int) -> None:
        self.remote = remote
        self.step = record.step
        self.rank = rank
        self.files = FileSet(rank)
        self.dir_name = step_dir_name(record.step)
        try:
            self.small = fetch_small(remote, record, rank)
            self.shard = record.rank_objects(rank)[self.files.shard]
            self.key = rank_keys(record.step, rank)[self.files.shard]
        except CheckpointError as exc:
            raise self._named(exc) from None

    def check(self, storage: RangeSource, shard_file: str) -> StepStatus:
        """The rank's files checked as a restore checks any shard's: the commit record and
        manifest (against the commit object already), the shard's header, read from
        ``shard_file`` of ``storage``, against the manifest."""
        return check_arriving(storage, self.step, self.dir_name, self.rank,
                              commit_raw=self.small[self.files.commit],
                              manifest_raw=self.small[self.files.manifest],
                              shard_file=shard_file)

    def _named(self, exc: BaseException) -> BaseException:
        """``exc`` with this rank's step and rank where it names neither (an error of the
        store names only its URL and key)."""
        if isinstance(exc, CheckpointError):
            exc.step = self.step if exc.step is None else exc.step
            exc.rank = self.rank if exc.rank is None else exc.rank
        return exc


class ShardStream(RankObjects):
    """See the module docstring. ``wait`` may be called from several threads at once."""

    def __init__(self, remote: Remote, storage: Storage, record: StepRecord, rank: int
                 ) -> None:
        super().__init__(remote, record, rank)
        self.storage = storage
        try:
            self.started = time.perf_counter()
            self.incoming = ArrivingShard(storage, self.dir_name, self.files)
        except CheckpointError as exc:
            raise self._named(exc) from None
        try:
            storage.truncate(self.incoming.fd, self.shard.size)  # reads may start anywhere
        except StorageError as exc:
            self.incoming.discard()
            raise StorageError(f"cannot size the download of step {self.step}: "
                               f"{exc.message}", step=self.step, rank=rank,
                               path=self.incoming.path, errno=exc.errno) from exc
        self.shard_file = self.incoming.temp
        self._arrived = [False] * len(self.shard.parts)
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stop = False
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="ckpt-persist-download",
                                        daemon=True)
        self._thread.start()

    # -- the download --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.remote.download(self.key, self.storage, self.incoming.fd, self.shard,
                                 first=(0, len(self.shard.parts) - 1), on_part=self._landed)
        except BaseException as exc:
            with self._cond:
                self._error = self._named(exc)
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _landed(self, index: int) -> None:
        with self._cond:
            if self._stop:
                raise _Stopped
            self._arrived[index] = True
            self._cond.notify_all()

    def wait(self, start: int, end: int) -> None:
        """Block until bytes [start, end) of the shard are in the file; raise the download's
        error if it failed."""
        if end <= start:
            return
        lo, hi = start // self.shard.part_bytes, (end - 1) // self.shard.part_bytes
        with self._cond:
            while not all(self._arrived[lo:hi + 1]):
                if self._error is not None:
                    raise self._error
                if self._ended:
                    raise CheckpointIntegrityError(
                        f"the download ended without bytes [{start}, {end})", step=self.step,
                        rank=self.rank, path=self.incoming.path)
                self._cond.wait()

    # -- the restore's view --------------------------------------------------------------

    def status(self) -> StepStatus:
        """``scan_files`` of the arriving files, once the preamble and header are in."""
        rel = os.path.join(self.dir_name, self.shard_file)
        self.wait(0, min(PREAMBLE_SIZE, self.shard.size))
        fd, size = self.storage.open_read(rel, self.shard.size)
        try:
            pre = bytearray(min(size, PREAMBLE_SIZE))
            self.storage.pread_into(fd, memoryview(pre), 0)
        finally:
            self.storage.close(fd)
        _, offset, length, _ = decode_preamble(bytes(pre), size, self.incoming.path)
        self.wait(offset, offset + length)
        return self.check(self.storage, self.shard_file)

    def publish(self) -> tuple[str, int, float]:
        """Wait for the download's end and publish the files (commit record last). Returns
        (path of the shard, bytes, seconds since the download started)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        try:
            self.incoming.publish(self.small[self.files.manifest],
                                  self.small[self.files.commit])
        except CheckpointError as exc:
            raise self._named(exc) from None
        size = self.shard.size + sum(len(v) for v in self.small.values())
        return self.incoming.path, size, time.perf_counter() - self.started

    def discard(self) -> None:
        """Stop the download (parts in flight end first) and remove what it wrote."""
        with self._cond:
            self._stop = True
        self._thread.join()
        self.incoming.discard()

