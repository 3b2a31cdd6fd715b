"""Retention markers: a step that retention could not remove, recorded in the root.

A failed prune leaves ``.retain-failed-r<rank, 5 digits>-step-<step, 10 digits>`` in the root,
holding the error (at most 4 KiB), until a later prune removes the step; ``ckpt-pipeline ls``
shows it. The retain stage (``_save/retain.py``) writes and clears them; the command line reads
them.
"""

from __future__ import annotations

import re

from ..errors import CheckpointError
from ..storage import Storage
from .names import step_dir_name
from .publish import publish_file

__all__ = ("clear_marker", "marker_name", "read_markers", "write_marker")

_MARKER = re.compile(r"^\.retain-failed-r([0-9]{5,})-(step-[0-9]{10,})$")
_MARKER_MAX_BYTES = 4096


def marker_name(rank: int, step: int) -> str:
    """The marker of ``rank``'s failed prune of ``step``."""
    return f".retain-failed-r{rank:05d}-{step_dir_name(step)}"


def write_marker(storage: Storage, rank: int, step: int, error: str) -> None:
    """Record a failed prune of ``step`` in the root (a new file; an existing marker stays as
    it is)."""
    name = marker_name(rank, step)
    if any(e.name == name for e in storage.list_dir("")):
        return
    data = error.encode("utf-8", "replace")[:_MARKER_MAX_BYTES]
    publish_file(storage, "", name, data)


def clear_marker(storage: Storage, rank: int, step: int) -> None:
    """Forget a failed prune once the step is gone."""
    name = marker_name(rank, step)
    if any(e.name == name for e in storage.list_dir("")):
        storage.unlink(name)
        storage.fsync_dir("")


def read_markers(storage: Storage, rank: int) -> dict[int, str]:
    """{step: error} of this rank's failed prunes recorded in the root."""
    out: dict[int, str] = {}
    for entry in storage.list_dir(""):
        m = _MARKER.match(entry.name)
        if m is None or int(m.group(1)) != rank or not entry.is_file:
            continue
        step = int(m.group(2)[len("step-"):])
        if marker_name(rank, step) != entry.name:
            continue
        try:
            fd, size = storage.open_read(entry.name)
            try:
                buf = bytearray(min(size, _MARKER_MAX_BYTES))
                storage.pread_into(fd, memoryview(buf), 0)
            finally:
                storage.close(fd)
        except CheckpointError:
            buf = bytearray(b"(the marker could not be read)")
        out[step] = bytes(buf).decode("utf-8", "replace")
    return out
