"""What a pipeline knows of its saves, under one lock, shared by admission, stages and restore.

The steps in flight (their handles), the snapshots ``wait_snapshot()`` still has to wait for,
the last step saved and the newest committed, the failures that the failure policy counts,
and whether a restore runs. The training thread, the pipeline's event loop and its worker
threads all read and write it, so every method takes the lock; none blocks for long.
"""

from __future__ import annotations

import threading

from .._config_groups import FailurePolicy
from .._save.control import HandleControl
from ..errors import CheckpointError, PipelineBusyError, SaveError, StepOrderError
from ..handle import SaveHandle

__all__ = ("Ledger",)


class Ledger:
    """The shared bookkeeping of one pipeline (see the module docstring)."""

    def __init__(self, failures: FailurePolicy, rank: int, root: str) -> None:
        self.failures = failures
        self.rank = rank
        self.root = root
        self.lock = threading.Lock()
        self.admission = threading.Lock()
        """Held while a save is admitted, and while a restore begins: one of them goes first."""
        self._pending: dict[int, HandleControl] = {}
        self._snapshots: list[SaveHandle] = []
        self._last_step: int | None = None
        self._latest_committed: int | None = None
        self._failures_in_row = 0
        self._unreported: CheckpointError | None = None
        self._first_since_wait: tuple[int, CheckpointError] | None = None
        """The failed save of the lowest step since ``wait()`` last returned or raised (only
        it: a run that never calls ``wait()`` keeps one error, not one per failure)."""
        self._degraded_in_row = 0
        """Of the failures in a row, the saves that committed without some of their copies."""
        self._restoring = False

    # ------------------------------------------------------------------ steps

    def resume_at(self, step: int | None) -> None:
        """At open: the newest step committed on disk (saves must come after it)."""
        with self.lock:
            self._latest_committed = step
            self._last_step = step

    @property
    def latest_committed(self) -> int | None:
        with self.lock:
            return self._latest_committed

    def check_step_order(self, step: int) -> None:
        with self.lock:
            self._check_order(step)

    def _check_order(self, step: int) -> None:
        last = self._last_step
        if last is not None and step <= last:
            raise StepOrderError(
                f"step {step} is not greater than the last saved step {last}", step=step,
                rank=self.rank, path=self.root,
                hint="save increasing steps; to start over, use a new root")

    def claim(self, step: int, *, check_restoring: bool = True) -> None:
        """Take ``step`` for a save: it must be newer than the last, and no restore runs."""
        with self.lock:
            self._check_order(step)
            if check_restoring:
                self._check_not_restoring("save()", step)
            self._last_step = step

    def register(self, control: HandleControl, *, wait_for_snapshot: bool) -> None:
        with self.lock:
            self._pending[control.step] = control
            if wait_for_snapshot:
                self._snapshots.append(control.handle)

    def settle(self, control: HandleControl) -> None:
        """The save has left the pipeline (committed and retained, or failed)."""
        with self.lock:
            self._pending.pop(control.step, None)
        control.settle()

    def pending_handles(self) -> list[SaveHandle]:
        return [control.handle for control in self.pending_controls()]

    def pending_controls(self) -> list[HandleControl]:
        """The saves in flight, by step (the pipeline's side of their handles)."""
        with self.lock:
            return sorted(self._pending.values(), key=lambda c: c.step)

    def take_snapshots(self) -> list[SaveHandle]:
        """The saves whose copies ``wait_snapshot()`` has not waited for yet."""
        with self.lock:
            handles, self._snapshots = self._snapshots, []
        return handles

    # ------------------------------------------------------------------ outcomes

    def committed(self, step: int, *, degraded: CheckpointError | None = None) -> None:
        """A save committed; ``degraded``: without some of its copies, which the failure
        policy counts like a failure (the save itself succeeded)."""
        with self.lock:
            if degraded is not None:
                self._failures_in_row += 1
                self._degraded_in_row += 1
                self._unreported = degraded
            else:
                self._failures_in_row = 0
                self._degraded_in_row = 0
                if not self.failures.strict:
                    self._unreported = None
            if self._latest_committed is None or step > self._latest_committed:
                self._latest_committed = step

    def failed(self, error: CheckpointError, step: int | None = None) -> None:
        """The save of ``step`` (default: the error's) failed."""
        with self.lock:
            self._failures_in_row += 1
            self._unreported = error
            key = step if step is not None else error.step
            first = self._first_since_wait
            if key is not None and (first is None or key < first[0]):
                self._first_since_wait = (key, error)

    @property
    def failures_in_row(self) -> int:
        with self.lock:
            return self._failures_in_row

    def policy_note(self, *, failed: bool = True) -> str:
        """What the failure policy does next, for a warning about a failed save (``failed``)
        or a save committed without some of its copies."""
        with self.lock:
            count, latest = self._failures_in_row, self._latest_committed
        limit = self.failures.max_failures_in_row
        kept = ("no step is committed yet" if latest is None
                else f"the newest committed step, {latest}, is intact")
        if self.failures.strict:
            then = "strict=True: the next save() or wait() raises"
        else:
            then = (f"the next save() raises once {limit} saves in a row have failed "
                    f"(max_failures_in_row; {count} so far)"
                    + (", and wait() raises the first failure since the last wait()"
                       if failed else ""))
        return f"Training goes on and {kept}; {then}"

    def take_failures(self) -> CheckpointError | None:
        """For ``wait()``: the first failure (by step) since the last call, and forget them."""
        with self.lock:
            first, self._first_since_wait = self._first_since_wait, None
        return None if first is None else first[1]

    def reported(self) -> None:
        """The failures so far reached the caller (``wait()`` raised one)."""
        with self.lock:
            self._unreported = None

    def raise_if_failures_due(self, step: int | None) -> None:
        """Raise when the failure policy says earlier failures must not pass unnoticed."""
        with self.lock:
            error = self._unreported
            count = self._failures_in_row
            degraded = self._degraded_in_row
            due = error is not None and (self.failures.strict
                                         or count >= self.failures.max_failures_in_row)
            if due:
                self._unreported = None
                self._failures_in_row = 0
                self._degraded_in_row = 0
                self._first_since_wait = None  # reported by this error: wait() does not
        if not due:
            return
        if count >= self.failures.max_failures_in_row:
            what = (f"{count} saves in a row failed" if not degraded else
                    f"{count} saves in a row failed or committed without all their copies "
                    f"({degraded} of them without copies)")
        else:
            what = ("a previous save committed without all its copies" if degraded
                    else "a previous save failed")
        raise SaveError(f"{what}; the last one: {error}", step=step, rank=self.rank,
                        path=self.root,
                        hint="fix the cause (disk, permissions, state); the newest committed "
                             "checkpoint is intact, and the next save() tries again")

    # ------------------------------------------------------------------ restore

    def check_not_restoring(self, what: str, step: int | None = None) -> None:
        """Saves and restores exclude each other: a restore rewrites what a save would copy."""
        with self.lock:
            self._check_not_restoring(what, step)

    def _check_not_restoring(self, what: str, step: int | None) -> None:
        if self._restoring:
            raise PipelineBusyError(f"{what} while restore_latest() runs on this pipeline",
                                    step=step, rank=self.rank, path=self.root,
                                    hint="call it after restore_latest() has returned")

    def begin_restore(self) -> None:
        """Mark a restore, under the admission lock (a save being admitted goes first and is
        then pending, or sees the restore and is refused). Call it from a worker thread."""
        with self.admission, self.lock:
            if self._restoring:
                raise PipelineBusyError("restore_latest() while another restore_latest() "
                                        "runs on this pipeline", rank=self.rank,
                                        path=self.root, hint="restore from one thread at a time")
            self._restoring = True

    def end_restore(self, restored: int | None = None) -> None:
        """The restore is over; ``restored``: the step it loaded (saves continue after it)."""
        with self.lock:
            self._restoring = False
            if restored is not None:
                self._latest_committed = restored
                self._last_step = restored
