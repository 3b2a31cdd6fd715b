"""The files one save owns, from the first temporary to the commit record, and their removal.

Every stage that creates, opens or publishes a file of the save records it here (the step
directory, the open temporary shard, the temporaries, the names published under the step).
A save that fails, or is abandoned when the pipeline closes, is undone by ``remove``: the
only place that takes a save's files off the disk. Nothing committed is ever removed here:
a committed save never reaches it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from .._format.scan import tidy_step_dir
from ..errors import StorageError
from ..storage import Storage

__all__ = ("SaveFiles", "close_quietly")


def close_quietly(storage: Storage, fd: int) -> None:
    """Close a descriptor on a path that is failing already: a close error adds nothing."""
    with contextlib.suppress(StorageError):
        storage.close(fd)


@dataclass(slots=True)
class SaveFiles:
    """What one save of one rank has on disk so far (see the module docstring)."""

    dir_name: str = ""
    """The step directory (relative to the root), once ``write_data`` created it."""
    fd: int | None = None
    """The temporary shard, open from ``write_data`` until ``seal`` closes it."""
    temps: list[str] = field(default_factory=list)
    published: list[str] = field(default_factory=list)

    def created(self, temp: str) -> None:
        self.temps.append(temp)

    def published_as(self, temp: str, final: str) -> None:
        """``temp`` was linked to its final name (and unlinked)."""
        self.temps.remove(temp)
        self.published.append(final)

    def remove(self, storage: Storage) -> None:
        """Undo a failed save: its temporaries and this rank's published files of the step.

        Runs in a worker thread. The commit record goes first, and its removal is made durable
        before the data go, so that nothing on disk looks complete while the rest is removed.
        """
        if self.fd is not None:
            close_quietly(storage, self.fd)
            self.fd = None
        if not self.dir_name:
            return
        names = sorted(self.published, key=lambda n: not n.endswith(".commit"))
        for name in [*names, *self.temps]:
            with contextlib.suppress(StorageError):
                storage.unlink(os.path.join(self.dir_name, name))
                if name.endswith(".commit"):
                    storage.fsync_dir(self.dir_name)  # gone for good before the data go
        self.published.clear()
        self.temps.clear()
        with contextlib.suppress(StorageError):
            tidy_step_dir(storage, self.dir_name)
