"""Labelled crash points, for crash tests in child processes (see ``ckpt_pipeline.testing``).

The pipeline calls ``crash_point(label)`` at the moments listed in ``CRASH_POINTS``. The
environment variable ``CKPT_PIPELINE_CRASH_AT`` arms one of them; it accepts two forms:

- ``<label>``: SIGKILL this process the first time ``label`` is reached (same as ``<label>:1``);
- ``<label>:<N>``: SIGKILL it the N-th time ``label`` is reached, N a positive decimal integer
  (``seal.done:3`` kills during the third save's ``seal.done``).

``<label>`` must be one of ``CRASH_POINTS`` (a label of a save stage begins with the stage's
name: ``write_data.``, ``seal.``, ``commit.``, ``retain.``); an old label of ``RENAMED`` is still
accepted, with a DeprecationWarning. Hits are counted per label, in this process, from
the moment the variable names that label (set it in the child's environment to count from the
start of the process), under a lock, so saves in several threads count each hit exactly once.
Any other value (an unknown label, ``N`` missing, zero, negative or not a number) is a mistake
in the test, not a request to never crash: every ``crash_point`` call then raises ValueError
naming the variable and the accepted forms. Unset or empty, nothing happens (a call costs one
environment lookup). The variable is read at every call, so a test may arm it in the middle of
a process.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import warnings

__all__ = ("CRASH_ENV", "CRASH_POINTS", "crash_point")

CRASH_ENV = "CKPT_PIPELINE_CRASH_AT"

CRASH_POINTS = (
    "save.requested",          # save() handed the job to the pipeline
    "write_data.done",         # tensor bytes in the temporary shard, not fsynced
    "seal.shard_fsynced",      # shard fsynced under its temporary name
    "seal.shard_published",    # shard under its final name, no manifest yet
    "seal.done",               # shard and manifest durable, no vote yet
    "commit.voted",            # every rank agreed, no commit record yet
    "commit.record_published", # commit record durable, confirmation not exchanged
    "retain.commit_removed",   # an old step's commit record removed, its data not yet
    "scrub.removed",           # start-up removed one leftover, others may remain
    "restore.rewind_recorded", # a rewind durable in every tier, no step moved aside yet
    "replicate.sending",       # sender: a chunk of a copy sent, the copy incomplete
    "replicate.receiving",     # holder: a chunk of a copy received, the copy incomplete
    "replicate.stored",        # holder: a copy published, not acknowledged or committed
)

RENAMED = {
    "serialize.data_written": "write_data.done",
    "write.shard_fsynced": "seal.shard_fsynced",
    "write.shard_published": "seal.shard_published",
    "write.done": "seal.done",
}
"""Old labels, from before the stages had one name each: {old: new}."""

_FORM = re.compile(r"^(?P<label>[^:]+?)(?::(?P<nth>[0-9]+))?$")

_lock = threading.Lock()
_hits: dict[str, int] = {}
_parsed: tuple[str, tuple[str, int]] | None = None
"""The last value of the variable that was parsed, and what it parsed to."""


def parse_crash_at(value: str) -> tuple[str, int]:
    """``(label, N)`` of a value of ``CKPT_PIPELINE_CRASH_AT``; ValueError if malformed."""
    match = _FORM.match(value.strip())
    label = match.group("label") if match else None
    nth = int(match.group("nth")) if match and match.group("nth") is not None else 1
    if label in RENAMED:
        warnings.warn(f"{CRASH_ENV}: the crash point {label!r} was renamed "
                      f"{RENAMED[label]!r}; the old label will be removed", DeprecationWarning,
                      stacklevel=2)
        label = RENAMED[label]
    if label not in CRASH_POINTS or nth < 1:
        raise ValueError(
            f"{CRASH_ENV}={value!r} is not valid: use '<label>' or '<label>:<N>' (N >= 1, kill "
            f"at the N-th time the label is reached), the label one of {', '.join(CRASH_POINTS)}")
    assert label is not None
    return label, nth


def _armed(value: str) -> tuple[str, int]:
    global _parsed
    cached = _parsed
    if cached is not None and cached[0] == value:
        return cached[1]
    parsed = parse_crash_at(value)
    _parsed = (value, parsed)
    return parsed


def crash_point(label: str) -> None:
    """SIGKILL this process if ``CKPT_PIPELINE_CRASH_AT`` arms ``label`` and this is the hit.

    See the module docstring for the accepted values; a malformed one raises ValueError.
    """
    value = os.environ.get(CRASH_ENV)
    if not value:
        return
    armed_label, nth = _armed(value)
    if armed_label != label:
        return
    with _lock:
        count = _hits.get(label, 0) + 1
        _hits[label] = count
    if count == nth:
        _kill()


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _reset_counts() -> None:
    """Forget every hit counted so far (for tests that run crash points in-process)."""
    with _lock:
        _hits.clear()
