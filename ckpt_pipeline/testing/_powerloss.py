"""Power-loss simulation: a storage that knows what survives a power cut, and cuts the power.

``PowerLossStorage`` is the real ``LocalStorage`` (real files, real ``fsync``) plus a model of
what is *durable* at every moment, kept from the calls that go through it:

- a file (an inode of the model, whatever names it has) is durable with its content as of its
  last ``fsync``; every ``pwrite`` since, through any descriptor of that inode (``create_temp``
  or ``open_direct``: direct I/O is not durable before ``fsync`` either), is volatile;
- a directory's entries are durable as of its last ``fsync_dir``; every change since (a file
  created, a name linked or unlinked, a directory made or removed, a rename) is volatile. An
  ``fsync`` of a file does not make its name durable, and a new directory survives only once
  its parent is fsynced (``make_dir`` and ``ensure_root`` do that themselves, and the model
  sees it). With ``atomic_rename`` (the default, as on ext4, xfs and btrfs) a rename is one
  change: it survives whole or not at all, and an fsync of either directory makes it durable;
  without it each side is a change of its own directory;
- everything that exists when ``arm()`` is called is durable.

``cut()`` (or the call chosen at ``arm()``) turns the power off: that call and every later one
raise ``PowerCut``, so the running program can no longer touch the disk. ``materialize(dest,
rng)`` then writes one possible disk image after the crash: each directory holds its durable
entries plus a random subset of the volatile changes made since (each change independently
kept or lost: no ordering between them is assumed, the adversarial case), and each file in it
its durable content plus, for each write since its last fsync, the whole write, none of it, or
some of its 4 KiB pages; its size anywhere between the durable and the current size, the rest
reading as zeros or as stale garbage. A never-fsynced file may be empty.

Assumptions and limits: durability is per call (an fsync covers the writes that returned
before it); reads are not modelled (they see the real, pre-crash files); FIFOs and sockets
present at ``arm()`` are not modelled (they are absent from the image); a write that fails for
a real reason is recorded as attempted. Calls hold one lock while they touch the disk, so
concurrent writers are serialised: fine for tests with small states.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import itertools
import os
import random
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .. import storage as _storage_mod
from ..errors import StorageError
from ..storage import FileInfo, LocalStorage

__all__ = ("CrashImage", "PowerCut", "PowerLossStorage", "StorageCall", "VolatileChange")

_PAGE = 4096
_PATCH_LOCK = threading.Lock()


class PowerCut(StorageError):
    """The simulated power is off: every storage call fails from the cut on (errno EIO)."""


@dataclass(frozen=True, slots=True)
class StorageCall:
    """One storage call seen after ``arm()``."""

    index: int
    """1-based, counted from ``arm()``; every call counts, reads included."""
    kind: str
    """The ``Storage`` method (``make_dir``'s own ``fsync_dir`` is a call of its own)."""
    path: str
    """Relative to the root: the file or directory the call is about. For calls on a
    descriptor, the path the file had when it was created or opened."""
    name: str
    """For calls on a file being written and for ``publish``: the final name it is for."""
    thread: int
    """``threading.get_ident()`` of the calling thread."""


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


_ids = itertools.count(1)


class _Node:
    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = next(_ids)


class _File(_Node):
    __slots__ = ("current", "durable", "label", "path", "pending")

    def __init__(self, path: str, label: str, content: bytes = b"") -> None:
        super().__init__()
        self.path = path  # relative to the disk, as created
        self.label = label  # the final name it is written for
        self.durable = content
        self.current = bytearray(content)
        self.pending: list[tuple[int, bytes]] = []


class _Symlink(_Node):
    __slots__ = ("target",)

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target


class _Dir(_Node):
    __slots__ = ("current", "durable", "pending")

    def __init__(self, entries: dict[str, _Node] | None = None) -> None:
        super().__init__()
        self.durable: dict[str, _Node] = dict(entries or {})
        self.current: dict[str, _Node] = dict(entries or {})
        self.pending: list[_DirOp] = []


@dataclass(eq=False, slots=True)
class _DirOp:
    seq: int
    kind: str
    changes: list[tuple[_Dir, str, _Node | None]]
    path: str
    target: str = ""


class PowerLossStorage(LocalStorage):
    """``LocalStorage`` with a model of what is durable, a power switch, and crash images.

    ``arm(cut_at=k)`` snapshots the disk (all durable) and cuts the power at the k-th storage
    call from then on (that call fails); ``arm(cut_if=f)`` cuts at the first call for which
    ``f(call)`` is true (``f`` runs under the storage's lock, on every call, in order); ``cut()``
    cuts at once, from any thread (for instance from a ``threading.Timer``). After the cut,
    ``materialize(dest, rng)`` writes one possible post-crash image; call it as often as you
    like, each with its own ``rng``: the same seed gives the same image.

    ``disk`` is the directory that stands for the whole file system (default: the root). Give
    a directory above the root to model the root's own creation by ``ensure_root``.
    """

    def __init__(self, root: str | os.PathLike[str], *, disk: str | os.PathLike[str] | None = None,
                 atomic_rename: bool = True) -> None:
        super().__init__(root)
        self.disk = Path(os.path.abspath(os.fspath(disk))) if disk is not None else self.root
        if self.disk != self.root and self.disk not in self.root.parents:
            raise ValueError(f"disk {self.disk} must be the root {self.root} or above it")
        self._root_rel = os.path.relpath(self.root, self.disk) if self.disk != self.root else ""
        self.atomic_rename = atomic_rename
        self._lock = threading.RLock()
        self._armed = False
        self._cut = False
        self._cut_at: int | None = None
        self._cut_if: Callable[[StorageCall], bool] | None = None
        self._index = 0
        self._log: list[StorageCall] = []
        self._seq = itertools.count(1)
        self._top = _Dir()
        self._fds: dict[int, _File] = {}
        self._making: str | None = None
        self.cut_call: StorageCall | None = None
        """The call refused first (None when ``cut()`` was called, or before the cut)."""

    # ------------------------------------------------------------------ control

    def arm(self, *, cut_at: int | None = None,
            cut_if: Callable[[StorageCall], bool] | None = None) -> None:
        """Take everything on the disk now as durable; count calls from zero; set the trigger.

        Arm while no file is open for writing through this storage (before opening the
        pipeline): writes to descriptors opened before are not modelled.
        """
        if cut_at is not None and cut_at < 1:
            raise ValueError("cut_at counts calls from 1")
        with self._lock:
            if not self.root.exists() and self.disk == self.root:
                LocalStorage.ensure_root(self)  # the root itself is taken as durable
            if not self.disk.is_dir():
                raise ValueError(f"the disk {self.disk} must be an existing directory")
            self._top = _snapshot(str(self.disk), "", {})
            self._fds.clear()
            self._index = 0
            self._log = []
            self._cut = False
            self.cut_call = None
            self._cut_at = cut_at
            self._cut_if = cut_if
            self._armed = True

    def cut(self) -> None:
        """The power goes off now: every storage call from now on raises ``PowerCut``."""
        with self._lock:
            self._cut = True

    @property
    def is_cut(self) -> bool:
        return self._cut

    def calls(self) -> list[StorageCall]:
        """The calls made since ``arm()`` (not the refused ones), in order."""
        with self._lock:
            return list(self._log)

    def volatile_changes(self) -> list[VolatileChange]:
        """Every change that a crash now could lose: directory changes, then writes."""
        with self._lock:
            out: list[VolatileChange] = []
            seen: set[int] = set()
            files: dict[int, _File] = {}
            for d in self._all_dirs():
                for op in d.pending:
                    if op.seq not in seen:
                        seen.add(op.seq)
                        out.append(_change(op))
                for node in d.current.values():
                    if isinstance(node, _File):
                        files[node.id] = node
            for f in self._fds.values():
                files[f.id] = f
            for f in files.values():
                out.extend(VolatileChange("write", f.path, offset=o, length=len(b))
                           for o, b in f.pending)
            return out

    # ------------------------------------------------------------------ the crash image

    def materialize(self, dest: str | os.PathLike[str], rng: random.Random | None = None, *,
                    keep: float | Callable[[VolatileChange], bool] | None = None) -> CrashImage:
        """Write one possible post-crash image of the disk into ``dest`` (a new directory).

        ``keep``: the probability that each volatile change survives (1.0: nothing lost;
        0.0: only what was fsynced), or a function that decides each change (writes are then
        kept whole or dropped, and a file's size follows what is kept). Default: a
        probability drawn from ``rng`` (sometimes exactly 0 or 1).
        """
        if not self._armed:
            raise RuntimeError("arm() the storage before materializing a crash image")
        rng = rng if rng is not None else random.Random()
        if keep is None:
            r = rng.random()
            keep = 0.0 if r < 0.15 else 1.0 if r < 0.3 else rng.random()
        with self._lock:
            return _Materializer(self, Path(os.path.abspath(os.fspath(dest))), rng,
                                 keep).run()

    # ------------------------------------------------------------------ bookkeeping

    def _begin(self, kind: str, path: str, name: str = "") -> None:
        """Count a call (lock held); raise PowerCut if the power is or goes off now."""
        if not self._armed:
            return
        if self._cut:
            raise self._power_off(kind, path)
        self._index += 1
        call = StorageCall(self._index, kind, path, name, threading.get_ident())
        if (self._cut_at is not None and self._index >= self._cut_at) or (
            self._cut_if is not None and self._cut_if(call)
        ):
            self._cut = True
            self.cut_call = call
            raise self._power_off(kind, path)
        self._log.append(call)

    def _power_off(self, kind: str, path: str) -> PowerCut:
        err = PowerCut(f"{kind} failed: the power is off (simulated power cut)",
                       path=path if path.startswith("<") else self._path(path),
                       errno=errno_mod.EIO)
        return err

    def _disk_rel(self, rel: str) -> str:
        return os.path.normpath(os.path.join(self._root_rel, rel)) if (self._root_rel or rel) \
            else ""

    def _node_at(self, disk_rel: str) -> _Node | None:
        node: _Node = self._top
        for part in (p for p in disk_rel.split(os.sep) if p and p != "."):
            if not isinstance(node, _Dir) or part not in node.current:
                return None
            node = node.current[part]
        return node

    def _dir_at(self, disk_rel: str) -> _Dir:
        node = self._node_at(disk_rel)
        if not isinstance(node, _Dir):
            raise RuntimeError(f"the power-loss model has no directory {disk_rel!r}: was the "
                               "disk changed behind the storage's back?")
        return node

    def _split(self, rel: str) -> tuple[_Dir, str, str]:
        """(model directory, name, disk-relative path) of a root-relative path."""
        disk_rel = self._disk_rel(rel)
        return self._dir_at(os.path.dirname(disk_rel)), os.path.basename(disk_rel), disk_rel

    def _record(self, kind: str, changes: list[tuple[_Dir, str, _Node | None]], path: str,
                target: str = "") -> None:
        op = _DirOp(next(self._seq), kind, changes, path, target)
        for d, name, node in changes:
            if node is None:
                d.current.pop(name, None)
            else:
                d.current[name] = node
            if not d.pending or d.pending[-1] is not op:
                d.pending.append(op)

    def _sync_dir(self, d: _Dir) -> None:
        """fsync of a directory: every change made in it so far is durable."""
        self._make_durable(d, len(d.pending))

    def _make_durable(self, d: _Dir, count: int) -> None:
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

    def _all_dirs(self) -> Iterator[_Dir]:
        seen: set[int] = set()
        stack: list[_Dir] = [self._top]
        while stack:
            d = stack.pop()
            if d.id in seen:
                continue
            seen.add(d.id)
            yield d
            for entries in (d.current, d.durable):
                stack.extend(n for n in entries.values() if isinstance(n, _Dir))
            for op in d.pending:
                stack.extend(n for _d, _name, n in op.changes if isinstance(n, _Dir))

    def _note_mkdir(self, rel: str) -> None:
        parent, name, disk_rel = self._split(rel)
        if name not in parent.current and os.path.isdir(self._path(rel)) \
                and not os.path.islink(self._path(rel)):
            self._record("mkdir", [(parent, name, _Dir())], disk_rel)

    def _note_removed(self, kind: str, rel: str) -> None:
        disk_rel = self._disk_rel(rel)
        parent = self._node_at(os.path.dirname(disk_rel))
        name = os.path.basename(disk_rel)
        if isinstance(parent, _Dir) and name in parent.current \
                and not os.path.lexists(self._path(rel)):
            self._record(kind, [(parent, name, None)], disk_rel)

    # ------------------------------------------------------------------ the Storage calls

    def ensure_root(self) -> None:
        with self._lock:
            self._begin("ensure_root", "")
            if not self._armed or self.disk == self.root:
                super().ensure_root()
                return
            chain = [self.root, *self.root.parents]
            missing = [p for p in reversed(chain[:chain.index(self.disk)])
                       if not os.path.lexists(p)]
            synced: list[str] = []
            try:
                with _observe_dir_syncs(synced):
                    super().ensure_root()
            finally:
                for made in missing:  # parents first
                    if os.path.isdir(made):
                        rel = os.path.relpath(made, self.disk)
                        parent = self._dir_at(os.path.dirname(rel))
                        if os.path.basename(rel) not in parent.current:
                            self._record("mkdir", [(parent, os.path.basename(rel), _Dir())],
                                         rel)
                for path in synced:
                    node = (self._node_at(os.path.relpath(path, self.disk))
                            if Path(path) == self.disk or self.disk in Path(path).parents
                            else None)
                    if isinstance(node, _Dir):
                        self._sync_dir(node)

    def make_dir(self, rel: str) -> None:
        with self._lock:
            self._begin("make_dir", rel, os.path.basename(rel))
            if not self._armed:
                super().make_dir(rel)
                return
            self._making = rel  # LocalStorage.make_dir calls self.fsync_dir(parent) itself
            try:
                super().make_dir(rel)
            finally:
                self._making = None
                self._note_mkdir(rel)

    def list_dir(self, rel: str) -> list[FileInfo]:
        with self._lock:
            self._begin("list_dir", rel)
        return super().list_dir(rel)

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        with self._lock:
            self._begin("create_temp", os.path.join(rel_dir, final_name), final_name)
            fd, name = super().create_temp(rel_dir, final_name)
            if self._armed:
                parent, _, disk_rel = self._split(os.path.join(rel_dir, name))
                node = _File(disk_rel, final_name)
                self._record("create", [(parent, name, node)], disk_rel)
                self._fds[fd] = node
            return fd, name

    def open_direct(self, rel_dir: str, temp_name: str) -> int | None:
        with self._lock:
            rel = os.path.join(rel_dir, temp_name)
            node = self._node_at(self._disk_rel(rel)) if self._armed else None
            self._begin("open_direct", rel, node.label if isinstance(node, _File) else "")
            fd = super().open_direct(rel_dir, temp_name)
            if fd is not None and isinstance(node, _File):
                self._fds[fd] = node  # the same inode as the create_temp descriptor
            return fd

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        with self._lock:
            node = self._fds.get(fd)
            self._begin("pwrite", _call_path(self, node, fd), node.label if node else "")
            try:
                super().pwrite(fd, data, offset)
            finally:
                if node is not None:
                    raw = data.tobytes()
                    end = offset + len(raw)
                    if len(node.current) < offset:
                        node.current.extend(bytes(offset - len(node.current)))
                    node.current[offset:end] = raw
                    node.pending.append((offset, raw))

    def fsync(self, fd: int) -> None:
        with self._lock:
            node = self._fds.get(fd)
            self._begin("fsync", _call_path(self, node, fd), node.label if node else "")
            super().fsync(fd)
            if node is not None:
                node.durable = bytes(node.current)
                node.pending.clear()

    def close(self, fd: int) -> None:
        with self._lock:
            node = self._fds.pop(fd, None)
            try:
                self._begin("close", _call_path(self, node, fd), node.label if node else "")
            except PowerCut:
                with contextlib.suppress(OSError):
                    os.close(fd)  # the process goes on: its descriptor must not leak
                raise
            super().close(fd)

    def publish(self, rel_dir: str, temp_name: str, final_name: str) -> None:
        with self._lock:
            self._begin("publish", os.path.join(rel_dir, final_name), final_name)
            try:
                super().publish(rel_dir, temp_name, final_name)
            finally:
                dir_rel = self._disk_rel(rel_dir)
                d = self._node_at(dir_rel) if self._armed else None
                node = d.current.get(temp_name) if isinstance(d, _Dir) else None
                if isinstance(d, _Dir) and node is not None:
                    if final_name not in d.current and \
                            os.path.lexists(self._path(os.path.join(rel_dir, final_name))):
                        self._record("link", [(d, final_name, node)],
                                     os.path.join(dir_rel, final_name))
                    self._note_removed("unlink", os.path.join(rel_dir, temp_name))

    def fsync_dir(self, rel: str) -> None:
        with self._lock:
            if self._making is not None and self._armed:
                self._note_mkdir(self._making)
            self._begin("fsync_dir", rel)
            super().fsync_dir(rel)
            if self._armed:
                self._sync_dir(self._dir_at(self._disk_rel(rel)))

    def open_read(self, rel: str, expected_size: int | None = None) -> tuple[int, int]:
        with self._lock:
            self._begin("open_read", rel, os.path.basename(rel))
        return super().open_read(rel, expected_size)

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> None:
        with self._lock:
            self._begin("pread_into", f"<fd {fd}>")
        super().pread_into(fd, buf, offset)

    def unlink(self, rel: str) -> None:
        with self._lock:
            self._begin("unlink", rel, os.path.basename(rel))
            try:
                super().unlink(rel)
            finally:
                if self._armed:
                    self._note_removed("unlink", rel)

    def rmdir(self, rel: str) -> None:
        with self._lock:
            self._begin("rmdir", rel, os.path.basename(rel))
            try:
                super().rmdir(rel)
            finally:
                if self._armed:
                    self._note_removed("rmdir", rel)

    def move(self, rel_src: str, rel_dst: str) -> None:
        with self._lock:
            self._begin("move", rel_src, os.path.basename(rel_dst))
            try:
                super().move(rel_src, rel_dst)
            finally:
                moved = (self._armed and not os.path.lexists(self._path(rel_src))
                         and os.path.lexists(self._path(rel_dst)))
                if moved:
                    src_dir, src_name, src_rel = self._split(rel_src)
                    dst_dir, dst_name, dst_rel = self._split(rel_dst)
                    node = src_dir.current.get(src_name)
                    if node is not None:
                        self._record("rename", [(src_dir, src_name, None),
                                                (dst_dir, dst_name, node)], src_rel, dst_rel)

    def free_bytes(self) -> int:
        with self._lock:
            self._begin("free_bytes", "")
        return super().free_bytes()


def _call_path(storage: PowerLossStorage, node: _File | None, fd: int) -> str:
    if node is None:
        return f"<fd {fd}>"
    if storage._root_rel:
        return os.path.relpath(node.path, storage._root_rel)
    return node.path


def _change(op: _DirOp) -> VolatileChange:
    return VolatileChange(op.kind, op.path, op.target)


def _snapshot(path: str, rel: str, inodes: dict[tuple[int, int], _Node]) -> _Dir:
    """The model of what is on disk now, all of it durable (hard links share one inode)."""
    entries: dict[str, _Node] = {}
    with os.scandir(path) as it:
        for entry in sorted(it, key=lambda e: e.name):
            st = entry.stat(follow_symlinks=False)
            child_rel = os.path.join(rel, entry.name)
            key = (st.st_dev, st.st_ino)
            if stat.S_ISDIR(st.st_mode):
                entries[entry.name] = _snapshot(entry.path, child_rel, inodes)
            elif key in inodes:
                entries[entry.name] = inodes[key]
            elif stat.S_ISREG(st.st_mode):
                with open(entry.path, "rb") as f:
                    inodes[key] = entries[entry.name] = _File(child_rel, entry.name, f.read())
            elif stat.S_ISLNK(st.st_mode):
                inodes[key] = entries[entry.name] = _Symlink(os.readlink(entry.path))
    return _Dir(entries)


@contextlib.contextmanager
def _observe_dir_syncs(out: list[str]) -> Iterator[None]:
    """Record the directories that LocalStorage fsyncs directly (``ensure_root``)."""
    me = threading.get_ident()
    with _PATCH_LOCK:
        original = _storage_mod._fsync_dir_path

        def observed(path: str) -> None:
            original(path)
            if threading.get_ident() == me:
                out.append(os.path.abspath(path))

        _storage_mod._fsync_dir_path = observed
        try:
            yield
        finally:
            _storage_mod._fsync_dir_path = original


class _Materializer:
    """One walk of the model, writing one possible post-crash image."""

    def __init__(self, storage: PowerLossStorage, dest: Path, rng: random.Random,
                 keep: float | Callable[[VolatileChange], bool]) -> None:
        self.storage = storage
        self.dest = dest
        self.rng = rng
        self.keep = keep
        self.decisions: dict[object, bool] = {}
        self.written: dict[int, str] = {}
        self.dirs_done: set[int] = set()
        self.counts = dict.fromkeys(("dir", "dir_kept", "writes", "kept", "torn", "dropped",
                                     "resized", "files"), 0)

    def run(self) -> CrashImage:
        if self.dest.exists() and any(self.dest.iterdir()):
            raise ValueError(f"{self.dest} must be a new or empty directory")
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self._dir(self.storage._top, str(self.dest), "")
        c = self.counts
        return CrashImage(
            disk=self.dest, root=self.dest / self.storage._root_rel if self.storage._root_rel
            else self.dest, keep=self.keep if isinstance(self.keep, float) else None,
            volatile_dir_changes=c["dir"], kept_dir_changes=c["dir_kept"],
            volatile_writes=c["writes"], kept_writes=c["kept"], torn_writes=c["torn"],
            dropped_writes=c["dropped"], resized_files=c["resized"], files=c["files"])

    def _decide(self, key: object, change: VolatileChange) -> bool:
        if key not in self.decisions:
            self.decisions[key] = (self.keep(change) if callable(self.keep)
                                   else self.rng.random() < self.keep)
        return self.decisions[key]

    def _entries(self, d: _Dir) -> dict[str, _Node]:
        entries = dict(d.durable)
        for op in d.pending:
            key: object = op.seq if self.storage.atomic_rename else (op.seq, d.id)
            fresh = key not in self.decisions
            kept = self._decide(key, _change(op))
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

    def _dir(self, d: _Dir, path: str, rel: str) -> None:
        self.dirs_done.add(d.id)
        os.makedirs(path, mode=0o700, exist_ok=True)
        for name, node in sorted(self._entries(d).items()):
            target = os.path.join(path, name)
            if isinstance(node, _Dir):
                if node.id not in self.dirs_done:  # reachable twice only without atomic renames
                    self._dir(node, target, os.path.join(rel, name))
            elif isinstance(node, _Symlink):
                os.symlink(node.target, target)
            elif isinstance(node, _File):
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

    def _content(self, f: _File) -> bytes:
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
                                 *range((offset // _PAGE + 1) * _PAGE, offset + len(data),
                                        _PAGE)})
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
            lo, hi = len(f.durable), len(f.current)
            r = rng.random()
            size = lo if r < 1 / 3 else hi if r < 2 / 3 else rng.randint(lo, hi)
        if len(img) < size:
            img.extend(rng.randbytes(size - len(img)) if junk else bytes(size - len(img)))
        del img[size:]
        self.counts["resized"] += len(img) != len(f.current)
        return bytes(img)
