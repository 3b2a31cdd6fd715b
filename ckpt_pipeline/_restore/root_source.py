"""The nearest shard source: a rank's shard as files of the root itself, its own
(``rank-S.*``) or a copy another rank's files hold of it in the same root
(``replica-S-on-H.*``, what ``cp.load`` reads when the own files do not verify)."""

from __future__ import annotations

from collections.abc import Collection

import anyio

from .._format.filesets import FileSet
from .._format.scan import StepStatus, scan_files
from .._threads import in_thread
from .._tiers.base import LocatedShard, SourceKind
from ..errors import CheckpointIntegrityError
from ..storage import Storage

__all__ = ("RootFiles",)


class RootFiles:
    """``files`` of ``step`` in ``storage``'s directory ``dir_name`` (a ``ShardSource``).

    ``status``: the scan's look at them when the caller has it already (the restore's), else
    ``open`` scans them (``names``: the directory's listing, when known). Reading them changes
    nothing, so ``close`` has nothing to keep or undo.
    """

    def __init__(self, storage: Storage, files: FileSet, step: int, dir_name: str,
                 limiter: anyio.CapacityLimiter, *, names: Collection[str] | None = None,
                 status: StepStatus | None = None, memory: bool = False) -> None:
        self.storage = storage
        self.files = files
        self.step = step
        self.dir_name = dir_name
        self.limiter = limiter
        self.names = names
        self.status = status
        self.memory = memory
        """The files are the memory tier's (``storage`` is its root)."""

    @property
    def kind(self) -> SourceKind:
        if self.memory:
            return "memory"
        return "own" if self.files.holder is None else "copy"

    @property
    def action(self) -> str:
        if self.memory:
            return "reading its shard in the memory tier"
        if self.files.holder is None:
            return "reading its own files"
        return f"reading the copy held by rank {self.files.holder}"

    async def open(self) -> LocatedShard:
        status = self.status
        if status is None:
            status = await in_thread(self.limiter, scan_files, self.storage, self.files,
                                     self.step, self.dir_name, self.names)
        if not status.valid or status.header is None:  # the reason names a copy's holder
            raise CheckpointIntegrityError(str(status.reason), step=self.step,
                                           rank=self.files.source, path=status.path)
        return LocatedShard(status, self.kind, holder=self.files.holder,
                            storage=self.storage if self.memory else None)

    async def close(self, error: BaseException | None) -> None:
        return None
