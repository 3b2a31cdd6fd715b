"""The durability model of ``PowerLossStorage``: what a power cut would keep, change by change.

The model is a tree of nodes standing for the simulated disk. Each directory has its
*durable* entries (as of its last ``fsync_dir``) and its *current* ones, with the changes
between them pending in order (``DirOp``: a file created, a name linked or unlinked, a
directory made or removed, a rename). Each file (an inode: whatever names it has) has its
durable content (as of its last ``fsync``), its current content and the writes between them.
With atomic renames a rename is one change that both of its directories share: it survives
whole or not at all, and an fsync of either directory makes it durable. ``snapshot`` builds the
model of what is on disk now, all of it durable; ``DiskModel.volatile_changes`` lists what a
crash now could lose. Turning the model into a disk image is ``_image.py``'s part.
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ("Change", "DirNode", "DirOp", "DiskModel", "FileNode", "LinkNode", "Node",
           "VolatileChange", "snapshot")

_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class VolatileChange:
    """A change not (yet) made durable, as offered to ``materialize(keep=...)``."""

    kind: str
    """``create``, ``mkdir``, ``link``, ``unlink``, ``rmdir``, ``rename`` or ``write``."""
    path: str
    """Relative to the simulated disk (the root, unless ``disk`` was given): the entry
    changed, the source of a rename, or the file written (the name it was created with)."""
    target: str = ""
    """The destination of a rename."""
    offset: int = 0
    length: int = 0
    """For a write: where, and how many bytes."""


class Node:
    """A file, directory or symlink of the model, with an identity of its own (an inode)."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = next(_ids)


class FileNode(Node):
    """A regular file: its durable content, its current content, the writes in between."""

    __slots__ = ("current", "durable", "label", "path", "pending")

    def __init__(self, path: str, label: str, content: bytes = b"") -> None:
        super().__init__()
        self.path = path  # relative to the disk, as created
        self.label = label  # the final name it is written for
        self.durable = content
        self.current = bytearray(content)
        self.pending: list[tuple[int, bytes]] = []

    def write(self, offset: int, data: bytes) -> None:
        """A write that returned (or was attempted): current, not durable."""
        end = offset + len(data)
        if len(self.current) < offset:
            self.current.extend(bytes(offset - len(self.current)))
        self.current[offset:end] = data
        self.pending.append((offset, data))

    def resize(self, size: int) -> None:
        """``truncate``: current, not durable. Growing is a write of zeros; shrinking cuts the
        current content (an image keeps any size between the durable and the current one)."""
        if size >= len(self.current):
            self.write(len(self.current), bytes(size - len(self.current)))
        else:
            del self.current[size:]
            self.pending.append((size, b""))

    def sync(self) -> None:
        """``fsync`` of the file: its current content is durable."""
        self.durable = bytes(self.current)
        self.pending.clear()


class LinkNode(Node):
    """A symbolic link (only ever present at ``arm()``: the pipeline makes none)."""

    __slots__ = ("target",)

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target


class DirNode(Node):
    """A directory: its durable entries, its current entries, the changes in between."""

    __slots__ = ("current", "durable", "pending")

    def __init__(self, entries: dict[str, Node] | None = None) -> None:
        super().__init__()
        self.durable: dict[str, Node] = dict(entries or {})
        self.current: dict[str, Node] = dict(entries or {})
        self.pending: list[DirOp] = []


Change = tuple[DirNode, str, "Node | None"]
"""One directory entry set (to a node) or removed (None) by a ``DirOp``."""


@dataclass(eq=False, slots=True)
class DirOp:
    """One change of one or two directories (two for a rename), pending until made durable."""

    seq: int
    kind: str
    changes: list[Change]
    path: str
    target: str = ""

    def change(self) -> VolatileChange:
        return VolatileChange(self.kind, self.path, self.target)


class DiskModel:
    """The modelled disk: the directory tree from ``top``, and the bookkeeping of changes."""

    def __init__(self, top: DirNode | None = None, *, atomic_rename: bool = True) -> None:
        self.top = top if top is not None else DirNode()
        self.atomic_rename = atomic_rename
        self._seq = itertools.count(1)

    def node_at(self, disk_rel: str) -> Node | None:
        """The node a disk-relative path names now, or None."""
        node: Node = self.top
        for part in (p for p in disk_rel.split(os.sep) if p and p != "."):
            if not isinstance(node, DirNode) or part not in node.current:
                return None
            node = node.current[part]
        return node

    def dir_at(self, disk_rel: str) -> DirNode:
        """The directory a disk-relative path names now; a RuntimeError if there is none."""
        node = self.node_at(disk_rel)
        if not isinstance(node, DirNode):
            raise RuntimeError(f"the power-loss model has no directory {disk_rel!r}: was the "
                               "disk changed behind the storage's back?")
        return node

    def record(self, kind: str, changes: list[Change], path: str, target: str = "") -> None:
        """A change made now (current at once, pending in each directory it touches)."""
        op = DirOp(next(self._seq), kind, changes, path, target)
        for d, name, node in changes:
            if node is None:
                d.current.pop(name, None)
            else:
                d.current[name] = node
            if not d.pending or d.pending[-1] is not op:
                d.pending.append(op)

    def sync_dir(self, d: DirNode) -> None:
        """fsync of a directory: every change made in it so far is durable."""
        self._make_durable(d, len(d.pending))

    def _make_durable(self, d: DirNode, count: int) -> None:
        """The first ``count`` pending changes of ``d`` become durable, in order.

        With atomic renames, a rename made durable here is durable in its other directory
        too, and so is everything before it there (a journal commits in order).
        """
        ops = d.pending[:count]
        del d.pending[:count]
        for op in ops:
            for dd, name, node in op.changes:
                if dd is d:
                    if node is None:
                        d.durable.pop(name, None)
                    else:
                        d.durable[name] = node
            if not self.atomic_rename:
                continue
            for dd, _name, _node in op.changes:
                index = next((i for i, p in enumerate(dd.pending) if p is op), None)
                if dd is not d and index is not None:
                    self._make_durable(dd, index + 1)

    def all_dirs(self) -> Iterator[DirNode]:
        """Every directory of the model: current, durable, or named by a pending change."""
        seen: set[int] = set()
        stack: list[DirNode] = [self.top]
        while stack:
            d = stack.pop()
            if d.id in seen:
                continue
            seen.add(d.id)
            yield d
            for entries in (d.current, d.durable):
                stack.extend(n for n in entries.values() if isinstance(n, DirNode))
            for op in d.pending:
                stack.extend(n for _d, _name, n in op.changes if isinstance(n, DirNode))

    def volatile_changes(self, open_files: Iterable[FileNode] = ()) -> list[VolatileChange]:
        """Every change that a crash now could lose: directory changes, then writes (of the
        files with a name, and of ``open_files``)."""
        out: list[VolatileChange] = []
        seen: set[int] = set()
        files: dict[int, FileNode] = {}
        for d in self.all_dirs():
            for op in d.pending:
                if op.seq not in seen:
                    seen.add(op.seq)
                    out.append(op.change())
            for node in d.current.values():
                if isinstance(node, FileNode):
                    files[node.id] = node
        for f in open_files:
            files[f.id] = f
        for f in files.values():
            out.extend(VolatileChange("write", f.path, offset=o, length=len(b))
                       for o, b in f.pending)
        return out


def snapshot(path: str, rel: str = "",
             inodes: dict[tuple[int, int], Node] | None = None) -> DirNode:
    """The model of what is on disk now, all of it durable (hard links share one inode).

    FIFOs, sockets and devices are left out.
    """
    inodes = {} if inodes is None else inodes
    entries: dict[str, Node] = {}
    with os.scandir(path) as it:
        for entry in sorted(it, key=lambda e: e.name):
            st = entry.stat(follow_symlinks=False)
            child_rel = os.path.join(rel, entry.name)
            key = (st.st_dev, st.st_ino)
            if stat.S_ISDIR(st.st_mode):
                entries[entry.name] = snapshot(entry.path, child_rel, inodes)
            elif key in inodes:
                entries[entry.name] = inodes[key]
            elif stat.S_ISREG(st.st_mode):
                with open(entry.path, "rb") as f:
                    inodes[key] = entries[entry.name] = FileNode(child_rel, entry.name, f.read())
            elif stat.S_ISLNK(st.st_mode):
                inodes[key] = entries[entry.name] = LinkNode(os.readlink(entry.path))
    return DirNode(entries)
