"""``ckpt-pipeline clean``: remove a job's memory tier files (``memory=``), the one command that
changes what it is pointed at. It refuses a directory that is not a memory root, and a rank
whose pipeline is still open (its lock is held); it says what it removed."""

from __future__ import annotations

import argparse
import os

from .._tiers.memory.steps import is_memory_root, memory_ranks, remove_rank_files, try_lock
from ..storage import Storage
from ._output import human_bytes, print_json
from ._status import EXIT_FAILED, EXIT_OK, UsageError

__all__ = ("cmd_clean",)


def cmd_clean(storage: Storage, args: argparse.Namespace) -> int:
    """Remove every rank's memory files under the root (``--rank R``: that rank's only)."""
    root = str(storage.root)
    if not is_memory_root(storage):
        raise UsageError(f"{root} is not a memory tier's directory (no slots/ and no "
                         "topology records): nothing removed")
    ranks = memory_ranks(storage) if args.rank is None else [args.rank]
    removed: dict[int, int] = {}
    busy: list[int] = []
    for rank in ranks:
        lock = try_lock(storage, rank)
        if lock is None:
            busy.append(rank)
            continue
        try:
            removed[rank] = remove_rank_files(storage, rank)
        finally:
            os.close(lock)
    if args.json:
        print_json({"root": root, "removed_bytes": removed, "in_use": busy})
    else:
        for rank, size in sorted(removed.items()):
            print(f"rank {rank}: removed {human_bytes(size)} of memory steps and buffers")
        for rank in busy:
            print(f"rank {rank}: in use by a running pipeline, left as it is")
    if not busy and not os.listdir(root):
        os.rmdir(root)
    return EXIT_FAILED if busy else EXIT_OK
