"""One shared-memory buffer of the memory tier: a file on a memory file system, given its pages
with ``posix_fallocate`` before it is mapped (a file that cannot grow raises SIGBUS when
touched, never an error), mapped shared, and registered with CUDA where a GPU is present, so
that device-to-host copies land in it at the speed of pinned memory. It outlives the process:
a restart after a crash finds its bytes.

Its pages are mapped in before it is registered (``_hostmem.register``: registration holds
the CUDA driver, and the GPU work of other threads waits behind it).

The file's first ``size`` bytes are mapped (the data region of the shard it holds); the shard
header is written after them through the descriptor, so that the file can be cut to the
shard's exact size without ever truncating a mapped page.
"""

from __future__ import annotations

import errno
import mmap
import os

import torch

from ..._hostmem import register as register_host
from ..._hostmem import unregister
from ..._logging import log
from ...errors import StorageError

__all__ = ("ShmBuffer", "free_bytes", "room_error")



def free_bytes(path: str) -> int:
    """Bytes free to an unprivileged writer on the file system of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def room_error(path: str, need: int, free: int, what: str, *, rank: int | None = None,
               step: int | None = None) -> StorageError:
    """The error of a memory tier that does not fit: names both sizes and the fixes."""
    return StorageError(
        f"the memory tier needs {need} bytes in {path} for {what}; the file system has {free} "
        "free", step=step, rank=rank, path=path,
        hint="give the job more shared memory (Docker's default /dev/shm is 64 MB: "
             "docker run --shm-size=..., or a Kubernetes emptyDir with medium: Memory), "
             "lower MemoryConfig(slots=, keep=), or use memory=None")


class ShmBuffer:
    """A shared-memory file of ``size`` bytes, mapped and (with CUDA) registered.

    Created exclusively at ``path`` (mode 0600); ``close`` unregisters before it unmaps (a
    mapping freed while registered makes later pinned allocations fail) and closes the
    descriptor, leaving the file where it is (its name may have moved: the tier renames it
    into the step it holds).
    """

    def __init__(self, path: str, size: int, *, register: bool) -> None:
        if size <= 0 or size % mmap.PAGESIZE:
            raise ValueError(f"size {size} is not a positive multiple of the page size")
        self.size = size
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            raise StorageError(f"cannot create the shared-memory buffer: {exc.strerror}",
                               path=path, errno=exc.errno) from exc
        try:
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    raise room_error(path, size, free_bytes(os.path.dirname(path)),
                                     "one buffer") from exc
                raise StorageError(f"cannot size the shared-memory buffer: {exc.strerror}",
                                   path=path, errno=exc.errno) from exc
            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            os.unlink(path)
            raise
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self.registered = False
        if register:
            self.registered = register_host(self.tensor.data_ptr(), size, what=path)

    def close(self) -> None:
        """Unregister, unmap, close the descriptor (idempotent; the file stays)."""
        tensor, self.tensor = self.tensor, None
        if tensor is None:
            return
        if self.registered:
            unregister(tensor.data_ptr(), what="shared-memory buffer")
            self.registered = False
        del tensor
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive: the mapping goes with the last one
            log.warning("ckpt.memory.unmap_deferred", bytes=self.size)
        os.close(self.fd)
