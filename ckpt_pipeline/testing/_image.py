"""Post-crash disk images: one possible state of the disk after the power went off.

``materialize`` walks the durability model (``_model.py``) and writes a real directory tree:
each directory holds its durable entries plus a random subset of the volatile changes made
since (each change independently kept or lost: no ordering between them is assumed, the
adversarial case), and each file in it its durable content plus, for each write since its last
fsync, the whole write, none of it, or some of its 4 KiB pages; its size anywhere between the
durable and the current size, the rest reading as zeros or as stale garbage. A never-fsynced
file may be empty. Hard links of one inode stay hard links; symlinks are recreated as they were.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ._model import DirNode, DiskModel, FileNode, LinkNode, Node, VolatileChange

__all__ = ("PAGE", "CrashImage", "materialize")

PAGE = 4096
"""A torn write reaches the disk in pieces of this size (the last one maybe in part)."""


@dataclass(frozen=True, slots=True)
class CrashImage:
    """What ``materialize`` wrote, and how much of the volatile state it kept."""

    disk: Path
    root: Path
    """The checkpoint root inside the image (``disk`` itself unless ``disk`` was given)."""
    keep: float | None
    """The probability of keeping a volatile change (None: decided by a callable)."""
    volatile_dir_changes: int
    kept_dir_changes: int
    volatile_writes: int
    kept_writes: int
    torn_writes: int
    dropped_writes: int
    resized_files: int
    """Files whose size in the image differs from their size before the cut."""
    files: int


def materialize(model: DiskModel, root_rel: str, dest: Path, rng: random.Random,
                keep: float | Callable[[VolatileChange], bool]) -> CrashImage:
    """Write one possible post-crash image of ``model`` into ``dest`` (a new or empty
    directory); ``root_rel`` is where the checkpoint root lies in the disk ("" for the disk).

    ``keep``: the probability that each volatile change survives (1.0: nothing lost; 0.0:
    only what was fsynced), or a function that decides each change (writes are then kept whole
    or dropped, and a file's size follows what is kept). The same ``rng`` state gives the same
    image.
    """
    return _Materializer(model, dest, rng, keep).run(root_rel)


class _Materializer:
    """One walk of the model, writing one possible post-crash image."""

    def __init__(self, model: DiskModel, dest: Path, rng: random.Random,
                 keep: float | Callable[[VolatileChange], bool]) -> None:
        self.model = model
        self.dest = dest
        self.rng = rng
        self.keep = keep
        self.decisions: dict[object, bool] = {}
        self.written: dict[int, str] = {}
        self.dirs_done: set[int] = set()
        self.counts = dict.fromkeys(("dir", "dir_kept", "writes", "kept", "torn", "dropped",
                                     "resized", "files"), 0)

    def run(self, root_rel: str) -> CrashImage:
        if self.dest.exists() and any(self.dest.iterdir()):
            raise ValueError(f"{self.dest} must be a new or empty directory")
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self._dir(self.model.top, str(self.dest), "")
        c = self.counts
        return CrashImage(
            disk=self.dest, root=self.dest / root_rel if root_rel else self.dest,
            keep=self.keep if isinstance(self.keep, float) else None,
            volatile_dir_changes=c["dir"], kept_dir_changes=c["dir_kept"],
            volatile_writes=c["writes"], kept_writes=c["kept"], torn_writes=c["torn"],
            dropped_writes=c["dropped"], resized_files=c["resized"], files=c["files"])

    def _decide(self, key: object, change: VolatileChange) -> bool:
        if key not in self.decisions:
            self.decisions[key] = (self.keep(change) if callable(self.keep)
                                   else self.rng.random() < self.keep)
        return self.decisions[key]

    def _entries(self, d: DirNode) -> dict[str, Node]:
        entries = dict(d.durable)
        for op in d.pending:
            key: object = op.seq if self.model.atomic_rename else (op.seq, d.id)
            fresh = key not in self.decisions
            kept = self._decide(key, op.change())
            if fresh:
                self.counts["dir"] += 1
                self.counts["dir_kept"] += kept
            if kept:
                for dd, name, node in op.changes:
                    if dd is d:
                        if node is None:
                            entries.pop(name, None)
                        else:
                            entries[name] = node
        return entries

    def _dir(self, d: DirNode, path: str, rel: str) -> None:
        self.dirs_done.add(d.id)
        os.makedirs(path, mode=0o700, exist_ok=True)
        for name, node in sorted(self._entries(d).items()):
            target = os.path.join(path, name)
            if isinstance(node, DirNode):
                if node.id not in self.dirs_done:  # reachable twice only without atomic renames
                    self._dir(node, target, os.path.join(rel, name))
            elif isinstance(node, LinkNode):
                os.symlink(node.target, target)
            elif isinstance(node, FileNode):
                if node.id in self.written:
                    os.link(self.written[node.id], target)
                    continue
                data = self._content(node)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                self.written[node.id] = target
                self.counts["files"] += 1

    def _content(self, f: FileNode) -> bytes:
        if not f.pending:
            return f.durable
        self.counts["writes"] += len(f.pending)
        keep, rng = self.keep, self.rng
        if not callable(keep) and keep >= 1.0:
            self.counts["kept"] += len(f.pending)
            return bytes(f.current)
        if not callable(keep) and keep <= 0.0:
            self.counts["dropped"] += len(f.pending)
            self.counts["resized"] += len(f.durable) != len(f.current)
            return f.durable
        junk = not callable(keep) and rng.random() < 0.25  # stale blocks instead of zeros
        img = bytearray(f.durable)
        end = len(img)

        def put(offset: int, data: bytes) -> None:
            nonlocal end
            if len(img) < offset:
                img.extend(rng.randbytes(offset - len(img)) if junk else bytes(offset - len(img)))
            img[offset:offset + len(data)] = data
            end = max(end, offset + len(data))

        for offset, data in f.pending:
            if callable(keep):
                if keep(VolatileChange("write", f.path, offset=offset, length=len(data))):
                    put(offset, data)
                    self.counts["kept"] += 1
                else:
                    self.counts["dropped"] += 1
                continue
            r = rng.random()
            if r < keep:
                put(offset, data)
                self.counts["kept"] += 1
            elif rng.random() < 0.5:
                self.counts["dropped"] += 1
            else:  # torn: some of its pages reach the disk, the last one maybe in part
                self.counts["torn"] += 1
                bounds = sorted({offset, offset + len(data),
                                 *range((offset // PAGE + 1) * PAGE, offset + len(data), PAGE)})
                pieces = list(itertools.pairwise(bounds))
                if len(pieces) == 1:
                    cut = rng.randrange(len(data)) if len(data) > 1 else 0
                    pieces = [(offset, offset + cut)] if cut else []
                for lo, hi in pieces:
                    if len(pieces) == 1 or rng.random() < 0.5:
                        put(lo, data[lo - offset:hi - offset])
        if callable(keep):
            size = max(len(f.durable), end)
        else:  # the size is metadata of its own: anything from durable to current
            lo, hi = sorted((len(f.durable), len(f.current)))  # a truncate may shrink it
            r = rng.random()
            size = lo if r < 1 / 3 else hi if r < 2 / 3 else rng.randint(lo, hi)
        if len(img) < size:
            img.extend(rng.randbytes(size - len(img)) if junk else bytes(size - len(img)))
        del img[size:]
        self.counts["resized"] += len(img) != len(f.current)
        return bytes(img)
