"""The persistent tier's commit objects read back: one step's, and every complete step's."""

from __future__ import annotations

from ..._format.names import parse_step_dir, step_dir_name
from ..._logging import log
from ...errors import CheckpointError, CheckpointIntegrityError
from .layout import MAX_COMMIT_BYTES, STEP_COMMIT, StepRecord, decode_step_record
from .remote import Remote

__all__ = ("complete_steps", "read_step_record")


def complete_steps(remote: Remote, *, rank: int | None = None,
                   into: list[StepRecord] | None = None) -> dict[int, StepRecord]:
    """The steps complete in the persistent tier: a commit object that decodes and names its
    step. A step whose commit object is unreadable is logged and left out. The commit
    objects are read newest first, each appended to ``into`` as it is read (for a caller that
    stops waiting)."""
    out: dict[int, StepRecord] = {}
    steps = (parse_step_dir(name) for name in remote.list_steps())
    for step in sorted((s for s in steps if s is not None), reverse=True):
        try:
            record = read_step_record(remote, step)
        except CheckpointError as exc:
            log.warning("ckpt.recovery.persisted_invalid", step=step, rank=rank,
                        url=remote.url, reason=exc.message)
            continue
        if record is not None:
            out[step] = record
            if into is not None:
                into.append(record)
    return dict(sorted(out.items()))


def read_step_record(remote: Remote, step: int) -> StepRecord | None:
    """The commit object of ``step`` (None: there is none); CheckpointIntegrityError when it
    does not decode or is for another step."""
    key = f"{step_dir_name(step)}/{STEP_COMMIT}"
    where = f"{remote.url}/{key}"
    raw = remote.get_small(key, MAX_COMMIT_BYTES)
    if raw is None:
        return None
    record = decode_step_record(raw, where)
    if record.step != step:
        raise CheckpointIntegrityError(f"the commit object {where} is for step {record.step}",
                                       step=step, path=where)
    return record
