"""This rank's upload of one step (shard, manifest, commit record, from the local root), in
the promoter's upload thread, pausing between parts while a save of this rank writes."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from ..._format.names import step_dir_name
from ..._logging import log
from ...errors import CheckpointError
from ...events import ShardUploaded
from .acquire import Acquiring
from .layout import rank_keys
from .objects import ObjectSum
from .reports import UploadReport
from .retries import UNAVAILABLE_HINT, RemoteError

__all__ = ("Uploading",)

_PAUSE_MAX_S = 30.0


class _Stopped(Exception):
    """Raised into an upload between two parts once the promoter is closed."""


class Uploading(Acquiring):
    """Uploading this rank's files of a step; saves come first."""

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around a save's disk writes: uploads of this rank pause between parts meanwhile,
        so that a promotion never slows a save down (it only finishes later)."""
        with self._quiet:
            self._writing += 1
        try:
            yield
        finally:
            with self._quiet:
                self._writing -= 1
                if not self._writing:
                    self._quiet.notify_all()

    def _wait_for_quiet(self) -> None:
        """Before each part of an upload: wait while a save writes (at most
        ``_PAUSE_MAX_S`` at a time, so that back-to-back saves cannot starve uploads); once
        closed, stop the upload."""
        with self._quiet:
            self._quiet.wait_for(lambda: not self._writing or self._stopped,
                                 timeout=_PAUSE_MAX_S)
        if self._stopped:
            raise _Stopped

    def _upload(self, step: int, save_id: str) -> None:
        """Upload this rank's files of ``step``, commit record last."""
        started = time.perf_counter()
        remote = self.remote
        dir_name = step_dir_name(step)
        try:
            if remote is None:  # not assigned while a rank cannot reach the tier
                raise RemoteError(f"{self.url} is not reachable", path=self.url,
                                  transient=True, hint=UNAVAILABLE_HINT)
            # Once the URL is known to be another job's, nothing more is written into it.
            lost = self._lost_url if self.rank != 0 else self._lost()
            if lost is not None:
                raise CheckpointError(f"not uploaded: {lost}")
            sums: dict[str, ObjectSum] = {}
            stamps: dict[str, str | None] = {}
            for name, key in rank_keys(step, self.rank).items():
                rel = os.path.join(dir_name, name)
                sums[name] = remote.upload(self.storage, rel, key)
                stamps[name] = remote.stamp(key)
            size = sum(s.size for s in sums.values())
            self._emit(ShardUploaded(step=step, rank=self.rank, save_id=save_id,
                                     url=self.url, bytes=size,
                                     seconds=time.perf_counter() - started))
            with self._lock:
                self._finished[step] = UploadReport(sums, stamps)
        except Exception as exc:
            if self._stopped:  # closed meanwhile: close() reports the step
                return
            error = exc.message if isinstance(exc, CheckpointError) else (
                f"{type(exc).__name__}: {exc}")
            log.warning("ckpt.persist.upload_failed", step=step, rank=self.rank, url=self.url,
                        error=error)
            with self._lock:
                self._failures[step] = error
        finally:
            with self._lock:
                self._unfinished.pop(step, None)
