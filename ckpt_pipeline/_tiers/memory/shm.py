"""One shared-memory buffer of the memory tier: a file on a memory file system, given its pages
with ``posix_fallocate`` before it is mapped (a file that cannot grow raises SIGBUS when
touched, never an error), mapped shared, and registered with CUDA where a GPU is present, so
that device-to-host copies land in it at the speed of pinned memory. It outlives the process:
a restart after a crash finds its bytes.

Before registering, its pages are mapped in with ``madvise(MADV_POPULATE_WRITE)``: registration
holds the CUDA driver, and other threads' kernels and copies wait behind it, so it should
not also fault the pages in. On an H200, 4.5 GiB registered in 2.06 s unpopulated (the loop
running meanwhile stalled for all of it) and in 0.23 s populated; the populate itself, 1.27 s,
is CPU work that the GPU does not wait for (``benchmarks/gpu_register_stall.py``).

The file's first ``size`` bytes are mapped (the data region of the shard it holds); the shard
header is written after them through the descriptor, so that the file can be cut to the
shard's exact size without ever truncating a mapped page.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import torch

from ..._logging import log
from ...errors import StorageError

__all__ = ("ShmBuffer", "free_bytes", "room_error")

_MADV_POPULATE_WRITE = 23  # Linux 5.14; the mmap module does not name it before Python 3.13


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
            self.registered = _register(self.tensor.data_ptr(), size, path)

    def close(self) -> None:
        """Unregister, unmap, close the descriptor (idempotent; the file stays)."""
        tensor, self.tensor = self.tensor, None
        if tensor is None:
            return
        if self.registered:
            result = int(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()))
            if result != 0:
                log.warning("ckpt.memory.unregister_failed", error=result)
            self.registered = False
        del tensor
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive: the mapping goes with the last one
            log.warning("ckpt.memory.unmap_deferred", bytes=self.size)
        os.close(self.fd)


def _populate(ptr: int, size: int) -> None:
    """Map the pages in now (through ctypes, which lets go of the GIL; the mmap module's
    ``madvise`` holds it); a kernel without ``MADV_POPULATE_WRITE`` leaves it to the
    registration."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(size),
                              ctypes.c_int(_MADV_POPULATE_WRITE)) != 0
    except (OSError, AttributeError):
        return
    if failed:
        log.debug("ckpt.memory.populate_unavailable", error=os.strerror(ctypes.get_errno()))


def _register(ptr: int, size: int, path: str) -> bool:
    """Register the mapping with CUDA (page-locked, a DMA target); False where it cannot."""
    if not torch.cuda.is_available():
        return False
    _populate(ptr, size)
    result = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
    if result != 0:
        log.warning("ckpt.memory.register_failed", path=path, bytes=size, error=result,
                    hint="copies to this buffer run at pageable speed")
        return False
    return True
