"""Sending copies of a restored step again, to the holders that lack them (a replaced node).

A restore brings a replaced node's own shards back (fetched from their copies), not the copies
it held for the other ranks: until the next save, a second lost node would lose the newest
step. So after the restore each source rank sends its shard of the restored step again to
every holder the placement names that holds no valid copy of it, in a background thread: the
restore has returned by then, and the training thread never waits for it.

It is the save's copy, sent the same way (``Push``: the hello with the job's token, data
frames with their xxh3, the manifest at the end; the holder checks every range against the
shard's checksums before it publishes anything), from the file on disk instead of the host
buffer, each range checked against the shard's checksums as it is read (a shard corrupt on
its disk is never sent). The hello carries the step's commit record: the step is committed
already, so the holder publishes the copy with it, commit record last, once verified. A
connection cut at close, or a holder that closes, leaves nothing complete there: what arrived
without its commit record is removed by the holder (or by the next scrub).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

from ..._format.filesets import FileSet
from ..._format.names import step_dir_name
from ..._format.region import checksum
from ..._format.scan import scan_files
from ..._format.steps import read_small
from ..._logging import log
from ...errors import CheckpointError
from ...events import Event, ReplicaRestored, ReplicaRestoreFailed
from ...storage import Storage
from .push import Peer, Push, PushOutcome
from .wire import copy_frames, piece_buffer

__all__ = ("Resend",)


class Resend:
    """The copies of this rank's shard of one restored step, on their way again (see the
    module docstring). ``start`` runs them in a daemon thread; ``close`` bounds them."""

    def __init__(self, storage: Storage, peers: Sequence[Peer], *, token: str, step: int,
                 save_id: str, rank: int, timeout_s: float,
                 emit: Callable[[Event], None]) -> None:
        self.storage = storage
        self.peers = list(peers)
        self.token = token
        self.step = step
        self.save_id = save_id
        self.rank = rank
        self.timeout_s = timeout_s
        self._emit = emit
        self._push: Push | None = None
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ckpt-resend-r{rank}-s{step}")

    def start(self) -> None:
        self._thread.start()

    def close(self, wait_s: float) -> bool:
        """Let the copies finish for up to ``wait_s`` seconds, then cut their connections
        and wait (bounded by the timeout) for the thread. True when it ended."""
        self._thread.join(timeout=wait_s)
        if not self._thread.is_alive():
            return True
        with self._lock:
            self._closing = True
            push = self._push
        if push is not None:
            push.interrupt()
        self._thread.join(timeout=self.timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            outcome = self._send()
        except CheckpointError as exc:
            for peer in self.peers:
                self._failed(peer.rank, exc.message)
            return
        except Exception as exc:  # a thread of its own: nothing above it reports
            for peer in self.peers:
                self._failed(peer.rank, f"{type(exc).__name__}: {exc}")
            return
        for holder in outcome.acked:
            self._emit(ReplicaRestored(step=self.step, rank=self.rank, save_id=self.save_id,
                                       holder=holder, bytes=outcome.bytes.get(holder, 0),
                                       seconds=time.perf_counter() - started))
        for holder, error in sorted(outcome.errors.items()):
            self._failed(holder, error)

    def _failed(self, holder: int, error: str) -> None:
        log.warning("ckpt.replicate.restore_failed", step=self.step, rank=self.rank,
                    peer=holder, error=error)
        self._emit(ReplicaRestoreFailed(step=self.step, rank=self.rank, save_id=self.save_id,
                                        holder=holder, error=error))

    def _send(self) -> PushOutcome:
        """Check this rank's files of the step, then push them to every holder."""
        dir_name = step_dir_name(self.step)
        files = FileSet(self.rank)
        status = scan_files(self.storage, files, self.step, dir_name)
        if not status.valid or status.save_id != self.save_id or status.header is None:
            raise CheckpointError(f"this rank's shard of step {self.step} is not there to "
                                  f"send ({status.reason or 'another save'})",
                                  step=self.step, rank=self.rank, path=status.path)
        manifest = read_small(self.storage, os.path.join(dir_name, files.manifest))
        commit = read_small(self.storage, os.path.join(dir_name, files.commit))
        size = status.shard_size
        push = Push(self.peers, token=self.token, step=self.step, save_id=self.save_id,
                    rank=self.rank, timeout_s=self.timeout_s, commit=commit)
        with self._lock:
            if self._closing:
                raise CheckpointError("the pipeline closed before the copy was sent",
                                      step=self.step, rank=self.rank)
            self._push = push
        log.debug("ckpt.replicate.resending", step=self.step, rank=self.rank,
                  holders=[p.rank for p in self.peers], bytes=size)
        push.open(size)
        frames = copy_frames(status.header.checks(), size)
        fd, _ = self.storage.open_read(os.path.join(dir_name, files.shard), size)
        try:
            with piece_buffer(max((e - s for s, e, _ in frames), default=1)) as area:
                for start, end, digest in frames:
                    buf = area[:end - start]
                    self.storage.pread_into(fd, buf, start)
                    actual = checksum(buf)
                    if digest is not None and actual != digest:
                        push.abort("the shard is corrupt on this rank's disk")
                        raise CheckpointError(
                            f"bytes [{start}, {end}) of this rank's shard of step "
                            f"{self.step} do not match its checksum: not sent",
                            step=self.step, rank=self.rank, path=status.path)
                    push.send(start, buf, actual)
        finally:
            self.storage.close(fd)
        push.end(manifest, size)
        return push.collect()
