"""Storage wrappers that inject faults a real disk cannot produce on demand."""

from __future__ import annotations

import errno
import threading

from ckpt_pipeline import LocalStorage, StorageError


class FailingStorage(LocalStorage):
    """Raises ``errno_`` from the given call kind once ``armed`` is set."""

    def __init__(self, root: object, call: str, errno_: int = errno.EIO) -> None:
        super().__init__(root)  # type: ignore[arg-type]
        self.call = call
        self.errno_ = errno_
        self.armed = False

    def _maybe_fail(self, call: str) -> None:
        if self.armed and call == self.call:
            raise StorageError(f"{call} failed: injected {errno.errorcode[self.errno_]}",
                               errno=self.errno_)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        self._maybe_fail("pwrite")
        super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        self._maybe_fail("fsync")
        super().fsync(fd)

    def publish(self, rel_dir: str, temp_name: str, final_name: str) -> None:
        if final_name.endswith(".commit"):
            self._maybe_fail("publish_commit")
        self._maybe_fail("publish")
        super().publish(rel_dir, temp_name, final_name)

    def free_bytes(self) -> int:
        if self.armed and self.call == "free_bytes":
            return 1024
        return super().free_bytes()


class GatedStorage(LocalStorage):
    """Holds every shard write until ``gate`` is set, so a save stays in flight."""

    def __init__(self, root: object) -> None:
        super().__init__(root)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.entered = threading.Event()

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        if final_name.endswith(".shard"):
            self.entered.set()
            self.gate.wait(60)
        return super().create_temp(rel_dir, final_name)
