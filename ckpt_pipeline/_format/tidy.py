"""Taking a rank's files off the disk, or aside: the scrub at open, the tidy of a step
directory, and quarantine.

Only this rank's files are ever touched (its own and the copies it holds, ``filesets.py``, and
its temporaries), so ranks sharing a root never remove each other's; a committed set is never
scrubbed. What is set aside goes into a directory of this rank's own (``names.py``), kept for
inspection and invisible to scans.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterable

from .._crash import crash_point
from ..errors import StorageError
from ..storage import Storage
from .filesets import FileSet, owned_sets
from .names import foreign_dir_name, rejected_dir_name, rewound_dir_name, temp_owner
from .steps import step_dirs

__all__ = ("quarantine", "scrub", "set_aside_files", "tidy_step_dir")




def scrub(storage: Storage, rank: int) -> list[tuple[str, int]]:
    """Remove this rank's temporaries and uncommitted files; return (path, bytes) removed.

    This rank's files are its own and the copies it holds for other ranks; a copy without its
    commit record is uncommitted too. A committed step is never touched. Runs in a worker thread, before any save starts.
    """
    removed: list[tuple[str, int]] = []
    for _step, dir_name in sorted(step_dirs(storage).items()):
        entries = storage.list_dir(dir_name)
        names = {e.name for e in entries}
        uncommitted = {name for files in owned_sets(names, rank) if files.commit not in names
                       for name in files.names()}
        for entry in entries:
            own_temp = temp_owner(entry.name) == rank
            if (own_temp or entry.name in uncommitted) and not entry.is_dir:
                storage.unlink(os.path.join(dir_name, entry.name))
                removed.append((os.path.join(storage.root, dir_name, entry.name), entry.size))
                crash_point("scrub.removed")
        here = os.path.join(storage.root, dir_name)
        tidy_step_dir(storage, dir_name,
                      changed=any(os.path.dirname(p) == here for p, _ in removed))
    return removed


def tidy_step_dir(storage: Storage, dir_name: str, *, changed: bool = True) -> None:
    """After this rank removed files from a step directory: fsync it, remove it if empty.

    Ranks sharing a root do this at the same time: the directory may vanish (another rank
    removed it) or gain files (another rank is saving) between two calls; both are fine.
    """
    try:
        if changed:
            storage.fsync_dir(dir_name)
        if storage.list_dir(dir_name):
            return
        storage.rmdir(dir_name)
    except StorageError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            return
        raise
    storage.fsync_dir("")


def quarantine(storage: Storage, step: int, dir_name: str, rank: int, *,
               own_only: bool = False, rewound_to: int | None = None) -> str | None:
    """Move this rank's files of a step aside (kept for inspection, invisible to scans).

    Only this rank's files move (its own, and the copies it holds), into a directory of this
    rank's own, so ranks sharing a root never touch each other's files. ``own_only``: only
    its own shard's files (a corrupt shard about to be replaced by a fetched copy).
    ``rewound_to``: the step is abandoned by a rewind to that step (the directory is named
    so; retention removes it, see ``retain.py``). Returns the new directory, or None if
    nothing was there. Runs in a worker thread.
    """
    names = [e.name for e in storage.list_dir(dir_name)]
    held = {name for files in owned_sets(names, rank)
            if not (own_only and files.holder is not None) for name in files.names()}
    own = [name for name in names if name in held or temp_owner(name) == rank]
    if not own:
        return None
    token = secrets.token_hex(4)
    target = (rejected_dir_name(step, rank, token) if rewound_to is None
              else rewound_dir_name(step, rewound_to, rank, token))
    storage.make_dir(target)
    for name in own:
        storage.move(os.path.join(dir_name, name), os.path.join(target, name))
    storage.fsync_dir(target)
    tidy_step_dir(storage, dir_name)
    return os.path.join(storage.root, target)


def set_aside_files(storage: Storage, step: int, dir_name: str, rank: int,
                    sets: Iterable[FileSet], *, foreign: bool
                    ) -> tuple[str, tuple[str, ...]] | None:
    """Move the file sets ``sets`` of this rank (its own, copies it holds) of a step aside,
    into a directory of its own: labelled as another save's files (``foreign``:
    ``foreign_dir_name``) or as rejected by recovery. Kept for inspection, invisible to
    scans, never loaded. Returns the new directory and the names moved, or None if none of the
    files was there. Runs in a worker thread."""
    names = {e.name for e in storage.list_dir(dir_name)}
    moving = [name for files in sets for name in files.names() if name in names]
    if not moving:
        return None
    token = secrets.token_hex(4)
    target = (foreign_dir_name if foreign else rejected_dir_name)(step, rank, token)
    storage.make_dir(target)
    for name in moving:
        storage.move(os.path.join(dir_name, name), os.path.join(target, name))
    storage.fsync_dir(target)
    tidy_step_dir(storage, dir_name)
    return os.path.join(storage.root, target), tuple(moving)
