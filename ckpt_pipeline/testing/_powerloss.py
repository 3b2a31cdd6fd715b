"""Power-loss simulation: a storage that knows what survives a power cut, and cuts the power.

``PowerLossStorage`` is the real ``LocalStorage`` (real files, real ``fsync``) plus a model of
what is *durable* at every moment (``_model.py``), kept from the calls that go through it:

- a file (an inode of the model, whatever names it has) is durable with its content as of its
  last ``fsync``; every ``pwrite`` since, through any descriptor of that inode (``create_temp``
  or ``open_direct``: direct I/O is not durable before ``fsync`` either), is volatile;
- a directory's entries are durable as of its last ``fsync_dir``; every change since (a file
  created, a name linked or unlinked, a directory made or removed, a rename) is volatile. An
  ``fsync`` of a file does not make its name durable, and a new directory survives only once
  its parent is fsynced (``make_dir`` and ``ensure_root`` do that themselves, and the model
  sees it: ``ensure_root``'s directory syncs go through ``LocalStorage._fsync_directory``,
  which this storage overrides). With ``atomic_rename`` (the default, as on ext4, xfs and
  btrfs) a rename is one change: it survives whole or not at all, and an fsync of either
  directory makes it durable; without it each side is a change of its own directory;
- everything that exists when ``arm()`` is called is durable.

``cut()`` (or the call chosen at ``arm()``) turns the power off: that call and every later one
raise ``PowerCut``, so the running program can no longer touch the disk. ``materialize(dest,
rng)`` then writes one possible disk image after the crash (``_image.py``).

Assumptions and limits: durability is per call (an fsync covers the writes that returned
before it); reads are not modelled (they see the real, pre-crash files); FIFOs and sockets
present at ``arm()`` are not modelled (they are absent from the image); a write that fails for
a real reason is recorded as attempted. Calls hold one lock while they touch the disk, so
concurrent writers are serialised: fine for tests with small states.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import StorageError
from ..storage import FileInfo, LocalStorage
from ._image import CrashImage, materialize
from ._model import DirNode, DiskModel, FileNode, VolatileChange, snapshot

__all__ = ("PowerCut", "PowerLossStorage", "StorageCall")


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
        self._lock = threading.RLock()
        self._armed = False
        self._cut = False
        self._cut_at: int | None = None
        self._cut_if: Callable[[StorageCall], bool] | None = None
        self._index = 0
        self._log: list[StorageCall] = []
        self._model = DiskModel(atomic_rename=atomic_rename)
        self._fds: dict[int, FileNode] = {}
        self._making: str | None = None
        self._root_syncs: list[str] | None = None  # directories ensure_root fsyncs, while it runs
        self.cut_call: StorageCall | None = None
        """The call refused first (None when ``cut()`` was called, or before the cut)."""

    @property
    def atomic_rename(self) -> bool:
        """Whether a rename is one change of both its directories (see the module)."""
        return self._model.atomic_rename

    @atomic_rename.setter
    def atomic_rename(self, value: bool) -> None:
        self._model.atomic_rename = value

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
            self._model = DiskModel(snapshot(str(self.disk)), atomic_rename=self.atomic_rename)
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
        """Whether the power is off."""
        return self._cut

    def calls(self) -> list[StorageCall]:
        """The calls made since ``arm()`` (not the refused ones), in order."""
        with self._lock:
            return list(self._log)

    def volatile_changes(self) -> list[VolatileChange]:
        """Every change that a crash now could lose: directory changes, then writes."""
        with self._lock:
            return self._model.volatile_changes(self._fds.values())

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
            return materialize(self._model, self._root_rel,
                               Path(os.path.abspath(os.fspath(dest))), rng, keep)

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
        return PowerCut(f"{kind} failed: the power is off (simulated power cut)",
                        path=path if path.startswith("<") else self._path(path),
                        errno=errno_mod.EIO)

    def _disk_rel(self, rel: str) -> str:
        return os.path.normpath(os.path.join(self._root_rel, rel)) if (self._root_rel or rel) \
            else ""

    def _split(self, rel: str) -> tuple[DirNode, str, str]:
        """(model directory, name, disk-relative path) of a root-relative path."""
        disk_rel = self._disk_rel(rel)
        return (self._model.dir_at(os.path.dirname(disk_rel)), os.path.basename(disk_rel),
                disk_rel)

    def _fd_path(self, node: FileNode | None, fd: int) -> str:
        """The root-relative path a call on a descriptor is about (as the file was created)."""
        if node is None:
            return f"<fd {fd}>"
        return os.path.relpath(node.path, self._root_rel) if self._root_rel else node.path

    def _note_mkdir(self, rel: str) -> None:
        parent, name, disk_rel = self._split(rel)
        if name not in parent.current and os.path.isdir(self._path(rel)) \
                and not os.path.islink(self._path(rel)):
            self._model.record("mkdir", [(parent, name, DirNode())], disk_rel)

    def _note_removed(self, kind: str, rel: str) -> None:
        disk_rel = self._disk_rel(rel)
        parent = self._model.node_at(os.path.dirname(disk_rel))
        name = os.path.basename(disk_rel)
        if isinstance(parent, DirNode) and name in parent.current \
                and not os.path.lexists(self._path(rel)):
            self._model.record(kind, [(parent, name, None)], disk_rel)

    def _fsync_directory(self, path: str) -> None:
        super()._fsync_directory(path)
        if self._root_syncs is not None:  # ensure_root's: modelled once it is done
            self._root_syncs.append(os.path.abspath(path))

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
            self._root_syncs = synced
            try:
                super().ensure_root()
            finally:
                self._root_syncs = None
                for made in missing:  # parents first
                    if os.path.isdir(made):
                        rel = os.path.relpath(made, self.disk)
                        parent = self._model.dir_at(os.path.dirname(rel))
                        if os.path.basename(rel) not in parent.current:
                            self._model.record("mkdir", [(parent, os.path.basename(rel),
                                                          DirNode())], rel)
                for path in synced:
                    node = (self._model.node_at(os.path.relpath(path, self.disk))
                            if Path(path) == self.disk or self.disk in Path(path).parents
                            else None)
                    if isinstance(node, DirNode):
                        self._model.sync_dir(node)

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
                node = FileNode(disk_rel, final_name)
                self._model.record("create", [(parent, name, node)], disk_rel)
                self._fds[fd] = node
            return fd, name

    def open_direct(self, rel_dir: str, temp_name: str) -> int | None:
        with self._lock:
            rel = os.path.join(rel_dir, temp_name)
            node = self._model.node_at(self._disk_rel(rel)) if self._armed else None
            self._begin("open_direct", rel, node.label if isinstance(node, FileNode) else "")
            fd = super().open_direct(rel_dir, temp_name)
            if fd is not None and isinstance(node, FileNode):
                self._fds[fd] = node  # the same inode as the create_temp descriptor
            return fd

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        with self._lock:
            node = self._fds.get(fd)
            self._begin("pwrite", self._fd_path(node, fd), node.label if node else "")
            try:
                super().pwrite(fd, data, offset)
            finally:
                if node is not None:
                    node.write(offset, data.tobytes())

    def fsync(self, fd: int) -> None:
        with self._lock:
            node = self._fds.get(fd)
            self._begin("fsync", self._fd_path(node, fd), node.label if node else "")
            super().fsync(fd)
            if node is not None:
                node.sync()

    def close(self, fd: int) -> None:
        with self._lock:
            node = self._fds.pop(fd, None)
            try:
                self._begin("close", self._fd_path(node, fd), node.label if node else "")
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
                d = self._model.node_at(dir_rel) if self._armed else None
                node = d.current.get(temp_name) if isinstance(d, DirNode) else None
                if isinstance(d, DirNode) and node is not None:
                    if final_name not in d.current and \
                            os.path.lexists(self._path(os.path.join(rel_dir, final_name))):
                        self._model.record("link", [(d, final_name, node)],
                                           os.path.join(dir_rel, final_name))
                    self._note_removed("unlink", os.path.join(rel_dir, temp_name))

    def fsync_dir(self, rel: str) -> None:
        with self._lock:
            if self._making is not None and self._armed:
                self._note_mkdir(self._making)
            self._begin("fsync_dir", rel)
            super().fsync_dir(rel)
            if self._armed:
                self._model.sync_dir(self._model.dir_at(self._disk_rel(rel)))

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
                        self._model.record("rename", [(src_dir, src_name, None),
                                                      (dst_dir, dst_name, node)],
                                           src_rel, dst_rel)

    def free_bytes(self) -> int:
        with self._lock:
            self._begin("free_bytes", "")
        return super().free_bytes()
