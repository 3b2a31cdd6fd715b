"""The recording half of ``PowerLossStorage``: the real ``LocalStorage`` calls, each passed
through the power switch (``_switch.py``) and recorded in the model of what is durable
(``_model.py``). ``_powerloss.py`` says what the model assumes and adds the controls: arming,
cutting the power, crash images.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from ..storage import FileInfo, LocalStorage
from ._model import DirNode, DiskModel, FileNode
from ._switch import PowerCut, PowerSwitch

__all__ = ("RecordingStorage",)


class RecordingStorage(LocalStorage):
    """``LocalStorage`` whose calls go through a power switch and are recorded in a disk
    model (see ``PowerLossStorage``, which arms and reads them). ``disk``: the directory that
    stands for the whole file system (default: the root)."""

    def __init__(self, root: str | os.PathLike[str], *, disk: str | os.PathLike[str] | None = None,
                 atomic_rename: bool = True) -> None:
        super().__init__(root)
        self.disk = Path(os.path.abspath(os.fspath(disk))) if disk is not None else self.root
        if self.disk != self.root and self.disk not in self.root.parents:
            raise ValueError(f"disk {self.disk} must be the root {self.root} or above it")
        self._root_rel = os.path.relpath(self.root, self.disk) if self.disk != self.root else ""
        self._lock = threading.RLock()
        self._switch = PowerSwitch(self._path)
        self._model = DiskModel(atomic_rename=atomic_rename)
        self._fds: dict[int, FileNode] = {}
        self._making: str | None = None
        self._root_syncs: list[str] | None = None  # directories ensure_root fsyncs, while it runs

    # ------------------------------------------------------------------ bookkeeping

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
            self._switch.begin("ensure_root", "")
            if not self._switch.armed or self.disk == self.root:
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
            self._switch.begin("make_dir", rel, os.path.basename(rel))
            if not self._switch.armed:
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
            self._switch.begin("list_dir", rel)
        return super().list_dir(rel)

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        with self._lock:
            self._switch.begin("create_temp", os.path.join(rel_dir, final_name), final_name)
            fd, name = super().create_temp(rel_dir, final_name)
            if self._switch.armed:
                parent, _, disk_rel = self._split(os.path.join(rel_dir, name))
                node = FileNode(disk_rel, final_name)
                self._model.record("create", [(parent, name, node)], disk_rel)
                self._fds[fd] = node
            return fd, name

    def open_direct(self, rel_dir: str, temp_name: str) -> int | None:
        with self._lock:
            rel = os.path.join(rel_dir, temp_name)
            node = self._model.node_at(self._disk_rel(rel)) if self._switch.armed else None
            self._switch.begin("open_direct", rel, node.label if isinstance(node, FileNode) else "")
            fd = super().open_direct(rel_dir, temp_name)
            if fd is not None and isinstance(node, FileNode):
                self._fds[fd] = node  # the same inode as the create_temp descriptor
            return fd

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        with self._lock:
            node = self._fds.get(fd)
            self._switch.begin("pwrite", self._fd_path(node, fd), node.label if node else "")
            try:
                super().pwrite(fd, data, offset)
            finally:
                if node is not None:
                    node.write(offset, data.tobytes())

    def truncate(self, fd: int, size: int) -> None:
        with self._lock:
            node = self._fds.get(fd)
            self._switch.begin("truncate", self._fd_path(node, fd), node.label if node else "")
            try:
                super().truncate(fd, size)
            finally:
                if node is not None:
                    node.resize(size)

    def fsync(self, fd: int) -> None:
        with self._lock:
            node = self._fds.get(fd)
            self._switch.begin("fsync", self._fd_path(node, fd), node.label if node else "")
            super().fsync(fd)
            if node is not None:
                node.sync()

    def close(self, fd: int) -> None:
        with self._lock:
            node = self._fds.pop(fd, None)
            try:
                self._switch.begin("close", self._fd_path(node, fd), node.label if node else "")
            except PowerCut:
                with contextlib.suppress(OSError):
                    os.close(fd)  # the process goes on: its descriptor must not leak
                raise
            super().close(fd)

    def publish(self, rel_dir: str, temp_name: str, final_name: str) -> None:
        with self._lock:
            self._switch.begin("publish", os.path.join(rel_dir, final_name), final_name)
            try:
                super().publish(rel_dir, temp_name, final_name)
            finally:
                dir_rel = self._disk_rel(rel_dir)
                d = self._model.node_at(dir_rel) if self._switch.armed else None
                node = d.current.get(temp_name) if isinstance(d, DirNode) else None
                if isinstance(d, DirNode) and node is not None:
                    if final_name not in d.current and \
                            os.path.lexists(self._path(os.path.join(rel_dir, final_name))):
                        self._model.record("link", [(d, final_name, node)],
                                           os.path.join(dir_rel, final_name))
                    self._note_removed("unlink", os.path.join(rel_dir, temp_name))

    def fsync_dir(self, rel: str) -> None:
        with self._lock:
            if self._making is not None and self._switch.armed:
                self._note_mkdir(self._making)
            self._switch.begin("fsync_dir", rel)
            super().fsync_dir(rel)
            if self._switch.armed:
                self._model.sync_dir(self._model.dir_at(self._disk_rel(rel)))

    def open_read(self, rel: str, expected_size: int | None = None) -> tuple[int, int]:
        with self._lock:
            self._switch.begin("open_read", rel, os.path.basename(rel))
        return super().open_read(rel, expected_size)

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> None:
        with self._lock:
            self._switch.begin("pread_into", f"<fd {fd}>")
        super().pread_into(fd, buf, offset)

    def copy_out(self, fd: int, out: int, start: int, end: int) -> bool:
        with self._lock:
            self._switch.begin("copy_out", f"<fd {fd}>")
        return super().copy_out(fd, out, start, end)

    def unlink(self, rel: str) -> None:
        with self._lock:
            self._switch.begin("unlink", rel, os.path.basename(rel))
            try:
                super().unlink(rel)
            finally:
                if self._switch.armed:
                    self._note_removed("unlink", rel)

    def rmdir(self, rel: str) -> None:
        with self._lock:
            self._switch.begin("rmdir", rel, os.path.basename(rel))
            try:
                super().rmdir(rel)
            finally:
                if self._switch.armed:
                    self._note_removed("rmdir", rel)

    def move(self, rel_src: str, rel_dst: str) -> None:
        with self._lock:
            self._switch.begin("move", rel_src, os.path.basename(rel_dst))
            try:
                super().move(rel_src, rel_dst)
            finally:
                moved = (self._switch.armed and not os.path.lexists(self._path(rel_src))
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
            self._switch.begin("free_bytes", "")
        return super().free_bytes()
