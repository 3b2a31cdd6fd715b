"""Promotion of committed steps to the persistent tier, and download at restore.

Each rank uploads its own committed files of a step (shard, manifest, commit record) from its
local root, in a thread of its own, one step after the other: never from the training's memory,
never on the event loop. Which steps are promoted, which are skipped and when a step is complete
are decided from what every rank reports in the first commit vote of each save (and in one more
exchange at close), so every rank takes the same decisions in the same order:

- every ``persist_every``-th committed step is assigned, unless some rank cannot reach the
  tier, or still has two promotions unfinished (one uploading, one queued): then it is
  skipped (``PersistSkipped``);
- a rank reports each finished upload once: every rank reads which steps it finished, and rank
  0 alone gets the checksum of every object (``PersistReport.root_msg``), so that ranks that
  finished the same steps send equal reports; once every rank has reported a step, rank 0
  checks the objects are there and writes ``step.commit`` last (``StepPersisted``), then
  applies ``persistent_keep``;
- a rank that failed (after the remote layer's retries) reports its error: every rank emits
  ``PersistFailed`` and rank 0 removes what was uploaded of the step;
- a rewind (``rewound``) is recorded in the tier by rank 0 (``rewinds.py``), which then takes
  the abandoned steps off it; a promotion of an abandoned step is never committed. While the
  tier cannot be reached the rewind stays pending, and is recorded before the next commit
  object.

The URL belongs to one open (``owner.Ownership``, rank 0's): before each commit object rank 0
re-reads the owner object, and checks that every object of the step is the one its rank
uploaded (the stamp the rank reported: an S3 ETag, a file's inode and modification time;
where a store has none, the content of each rank's commit record). A step whose objects are
another job's is not committed. Once the URL is another job's, rank 0 commits, prunes and
removes nothing more and says so in its next report: every rank then emits ``PersistFailed``
for its steps in flight, and for every step due later, and stops promoting (logged once, at
ERROR).

A step being uploaded is kept in the local tier until its upload ends (``protected``). Saves
come first: while a save of this rank writes its shard, uploads wait between parts
(``writing``), so the disk is shared in the gaps between saves, not during them.

The store never holds a job up (see ``connect`` and ``workers``): ``open`` waits at most
``OPEN_WAIT_S`` for it and opens from the local tier when it is unreachable, trying again in
the background; a restore waits at most ``LIST_WAIT_S`` for its steps; every thread that
waits on the store is a daemon, and ``close`` gives up on what did not end in time: such a
step never gets its commit object and is reported (``PersistFailed``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable

from ..._config_groups import PersistentConfig
from ...events import Event, PersistFailed
from ...storage import Storage
from . import state
from .connect import Connection
from .download import Restoring, download_rank
from .due import Assigning
from .records import complete_steps, read_step_record
from .remote import Remote
from .state import LIST_WAIT_S, OPEN_WAIT_S
from .urls import open_remote

__all__ = ("LIST_WAIT_S", "OPEN_WAIT_S", "Promoter", "complete_steps", "download_rank",
           "read_step_record")


class Promoter(Assigning, Restoring):
    """This rank's side of the persistent tier (see the module docstring), composed of its
    parts: ``acquire`` (the URL), ``due`` (what is promoted), ``upload``, ``commit_object``,
    ``prune``, ``rewinding`` and ``download``."""

    def __init__(self, storage: Storage, config: PersistentConfig,
                 emit: Callable[[Event], None], *, rank: int, world_size: int,
                 io_threads: int) -> None:
        super().__init__(storage, config, emit, rank=rank, world_size=world_size,
                         io_threads=io_threads)
        self._connection = Connection(
            self.url, self.rank, self._open_steps, self._connected, _close_quietly, emit)

    def open(self) -> None:
        """Open the persistent tier (``_open_steps``), waiting at most ``OPEN_WAIT_S``: a
        configuration or permission error raises a ConfigError here; an unreachable store
        does not keep the pipeline from opening from the local tier: it is tried again in
        the background (``PersistentUnavailable``, ``PersistentAvailable``; see
        ``connect``). Runs in a worker thread."""
        self._connection.start(state.OPEN_WAIT_S)
        with self._lock:
            self._opened = True
        if self.remote is not None:
            self._acquire_at_open()

    def _open_steps(self) -> Remote:
        """The steps of opening the persistent tier, at open and at every later attempt:
        open the root and list it once, so that a wrong URL or missing credentials fail at
        open, not at the first promotion. Runs in a daemon thread (``connect``)."""
        remote = open_remote(self._spec, threads=self.io_threads,
                             retries=self.config.retries,
                             options=self.config.options)
        retries, remote.retries = remote.retries, 0  # the connection's backoff retries it
        try:
            remote.gate = self._wait_for_quiet
            remote.list_steps()
            remote.retries = retries
            with self._lock:
                later = self._opened
            if later:  # a later attempt: the URL is taken before the tier counts as reached
                self.acquire(remote=remote)
        except BaseException:
            _close_quietly(remote)
            raise
        return remote

    def _connected(self, remote: Remote) -> None:
        self.url = remote.url
        self.remote = remote
        with self._lock:
            later = self._opened
        if later and self.rank == 0 and self._owner is None and self._refused is None:
            # reached by an attempt that began before open() returned: take the URL now
            threading.Thread(target=self._acquire_in_background, daemon=True,
                             name=f"ckpt-persist-acquire-r{self.rank}").start()

    def wait(self, timeout: float, *, uploads: bool = True) -> bool:
        """Wait until this rank's uploads (unless not ``uploads``) and rank 0's commit
        objects are done (True), or ``timeout`` passed (False). Runs in a worker thread."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._futures = [(u, f) for u, f in self._futures if not f.done()]
                futures = [f for u, f in self._futures if uploads or not u]
            if not futures:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            concurrent.futures.wait(futures, timeout=left)

    def close(self) -> None:
        """Stop: uploads in flight stop at their next part and rank 0 writes no more commit
        objects; a step whose promotion did not end is never committed (the next promotion,
        or rank 0's pruning, removes its objects) and is reported (``PersistFailed``). The
        threads still waiting on the store are daemons: they never keep the process alive."""
        with self._quiet:
            self._stopped = True
            self._quiet.notify_all()
            owner = self._owner
        self._connection.close()
        self._uploads.shutdown(wait=False, cancel_futures=True)
        self._meta.shutdown(wait=False, cancel_futures=True)
        if owner is not None:
            owner.stop()
        unfinished = {**{s: a.save_id for s, a in self._assigned.items()}, **self._committing}
        self._assigned.clear()
        for step, save_id in sorted(unfinished.items()):
            self._emit(PersistFailed(
                step=step, rank=self.rank, save_id=save_id, url=self.url,
                error="the promotion did not end before the pipeline closed (within "
                      f"PersistentConfig.timeout_s={self.config.timeout_s:g} s at a clean "
                      "close); the step was not committed in the persistent tier and stays "
                      "in the local tier"))
        if self.remote is not None:
            _close_quietly(self.remote)


def _close_quietly(remote: Remote) -> None:
    with contextlib.suppress(Exception):
        remote.close()
