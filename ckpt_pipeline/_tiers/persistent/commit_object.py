"""When a step is complete in the persistent tier: rank 0 checks that every rank's objects of
the step are there and are the ones it uploaded, then writes the step's commit object last
(readers find the complete steps by it: ``records``)."""

from __future__ import annotations

import time

from ..._format.names import step_dir_name
from ..._format.timeline import abandoned
from ..._logging import log
from ...errors import CheckpointError, CheckpointIntegrityError
from ...events import PersistFailed, StepPersisted
from .acquire import Acquiring
from .layout import (
    STEP_COMMIT,
    StepRecord,
    encode_step_record,
    rank_keys,
)
from .objects import ObjectSum
from .remote import Remote
from .rewinding import Rewinding
from .state import Assigned

__all__ = ("Committing",)


class Committing(Rewinding, Acquiring):
    """Rank 0: the commit object of each step every rank finished uploading."""

    def _commit_step(self, step: int, assigned: Assigned) -> None:
        """Rank 0: check the URL is still this open's and every object of the step is the
        one its rank uploaded, then write ``step.commit`` last (not once closed: ``close``
        reports the step instead)."""
        try:
            self._write_commit(step, assigned)
        finally:
            self._committing.pop(step, None)

    def _write_commit(self, step: int, assigned: Assigned) -> None:
        remote = self.remote
        assert remote is not None  # assigned only while every rank reaches the tier
        dir_name = step_dir_name(step)
        self._flush_rewinds()
        if abandoned(step, assigned.lineage, self.marks()):
            log.info("ckpt.persist.abandoned_not_committed", step=step, rank=self.rank,
                     url=self.url, save_id=assigned.save_id)
            self._remove_step(step)
            return
        try:
            lost = self._lost()
        except Exception as exc:
            lost = None
            error = exc.message if isinstance(exc, CheckpointError) else (
                f"{type(exc).__name__}: {exc}")
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=assigned.save_id,
                                     url=self.url, error=f"owner object: {error}"))
            return  # what it could not read is no reason to remove the step's objects
        if lost is not None:  # the objects may be the new holder's now: leave them
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=assigned.save_id,
                                     url=self.url, error=f"not committed: {lost}"))
            return
        try:
            objects, stamps = self._reported(step, assigned)
            self._check_objects(remote, dir_name, objects, stamps)
            record = StepRecord(step, assigned.save_id, self.world_size, objects,
                                lineage=assigned.lineage)
            if self._stopped:
                return
            remote.put_small(f"{dir_name}/{STEP_COMMIT}", encode_step_record(record))
        except Exception as exc:
            if self._stopped:
                return
            error = exc.message if isinstance(exc, CheckpointError) else (
                f"{type(exc).__name__}: {exc}")
            self._emit(PersistFailed(step=step, rank=self.rank, save_id=assigned.save_id,
                                     url=self.url, error=f"commit object: {error}"))
            self._remove_step(step)
            return
        self._emit(StepPersisted(step=step, rank=self.rank, save_id=assigned.save_id,
                                 url=self.url,
                                 seconds=time.monotonic() - assigned.committed_at))
        self._sweep(step)
        self._prune(step)

    def _reported(self, step: int, assigned: Assigned
                  ) -> tuple[dict[str, ObjectSum], dict[str, str | None]]:
        """Every rank's reported checksum and stamp of each of its objects of ``step``."""
        objects: dict[str, ObjectSum] = {}
        stamps: dict[str, str | None] = {}
        for rank in range(self.world_size):
            report = assigned.reports.get(rank)
            if report is None:
                raise CheckpointIntegrityError(
                    f"rank {rank} finished its upload, but its checksums did not reach rank 0")
            for name in rank_keys(step, rank):
                if name not in report.sums:
                    raise CheckpointIntegrityError(f"rank {rank} did not report {name}")
                objects[name] = report.sums[name]
                stamps[name] = report.stamps.get(name)
        return objects, stamps

    def _check_objects(self, remote: Remote, dir_name: str, objects: dict[str, ObjectSum],
                       stamps: dict[str, str | None]) -> None:
        """Every object is there with its size, and is the one its rank uploaded: the same
        stamp, or (where the store gives none) a rank commit record of the same content, so
        that another job's objects of the same step number cannot pass."""
        present = remote.list_dir(dir_name)
        for name, expected in objects.items():
            if present.get(name) != expected.size:
                raise CheckpointIntegrityError(
                    f"{dir_name}/{name} is {present.get(name, 'missing')} bytes in the "
                    f"persistent tier, {expected.size} were uploaded")
        stored = remote.stamps(dir_name) if any(v is not None for v in stamps.values()) else {}
        for name, expected in objects.items():
            mark = stamps.get(name)
            if mark is not None:
                same = stored.get(name) == mark
            elif name.endswith(".commit"):
                data = remote.get_small(f"{dir_name}/{name}", expected.size)
                same = data is not None and ObjectSum.of(data, expected.part_bytes) == expected
            else:
                continue
            if not same:
                raise CheckpointIntegrityError(
                    f"{dir_name}/{name} in the persistent tier is not the object this run "
                    "uploaded: another job wrote it since")
