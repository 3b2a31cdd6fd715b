"""Host memory: byte views of host tensors without copies (and without requiring NumPy), and
page-locked memory made without holding up the GPU (``populate``, ``register``,
``PinnedMapping``)."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import torch

from ._logging import log

__all__ = ("PinnedMapping", "byte_view", "populate", "register", "unregister")


def byte_view(t: torch.Tensor, start: int = 0, stop: int | None = None) -> memoryview:
    """A writable memoryview of bytes [start, stop) of a contiguous CPU tensor.

    The caller keeps ``t`` alive while the view is in use.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    total = t.numel() * t.element_size()
    stop = total if stop is None else stop
    if not 0 <= start <= stop <= total:
        raise ValueError(f"range [{start}, {stop}) is outside {total} bytes")
    length = stop - start
    if length == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * length).from_address(t.data_ptr() + start)
    return memoryview(array).cast("B")


# -- page-locked memory made without holding up the GPU ------------------------------------
#
# cudaHostRegister holds the CUDA driver while it runs, and kernels and copies that other
# threads queue meanwhile wait behind it; faulting the pages in is most of its time. So the
# pages are mapped in first (CPU work the GPU does not wait for), then registered. On an
# H200 (benchmarks/gpu_register_stall.py), 4.5 GiB: registration 2.06 s unpopulated and
# 0.23 s populated, the training loop meanwhile stalled for as long; torch's pinned
# allocation of the same size stalled it 4.1 s (it also rounds the size up to a power of 2).

_MADV_POPULATE_WRITE = 23  # Linux 5.14; the mmap module does not name it before Python 3.13
_POPULATE_CALL = 4 << 20  # bytes per madvise call: see populate
_POPULATE_PIECE = 256 << 20  # at least this much per thread


def populate(address: int, size: int, *, threads: int = 4) -> bool:
    """Map the pages of [address, address + size) in now, on up to ``threads`` threads
    (ctypes lets go of the GIL; the mmap module's ``madvise`` holds it). False where the
    kernel cannot (before 5.14): the pages then fault in when first touched.

    One ``madvise`` call covers 4 MiB: a call holds the process's memory-map lock, and a
    thread that maps or unmaps memory meanwhile (the training thread allocating, the CUDA
    driver) waits for it. Populating 4.5 GiB in calls of a quarter each stalled a training
    loop beside it for up to 0.88 s on the H200."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    pieces = max(1, min(threads, size // _POPULATE_PIECE))
    step = -(-size // pieces // mmap.PAGESIZE) * mmap.PAGESIZE
    failed: list[int] = []

    def run(start: int) -> None:
        end = min(start + step, size)
        for at in range(start, end, _POPULATE_CALL):
            if failed:
                return
            if madvise(address + at, min(_POPULATE_CALL, end - at), _MADV_POPULATE_WRITE):
                failed.append(ctypes.get_errno())
                return

    workers = [threading.Thread(target=run, args=(start,), name="ckpt-populate", daemon=True)
               for start in range(step, size, step)]
    for worker in workers:
        worker.start()
    run(0)
    for worker in workers:
        worker.join()
    if failed:
        log.debug("ckpt.hostmem.populate_unavailable", error=os.strerror(failed[0]))
    return not failed


def register(address: int, size: int, *, what: str, flags: int = 0) -> bool:
    """Page-lock [address, address + size) with CUDA (a DMA target at pinned speed), its
    pages mapped in first; False, logged, where it cannot (no CUDA, or refused)."""
    if not torch.cuda.is_available():
        return False
    populate(address, size)
    result = int(torch.cuda.cudart().cudaHostRegister(address, size, flags))
    if result != 0:
        log.warning("ckpt.hostmem.register_failed", what=what, bytes=size, error=result,
                    hint="copies to this buffer run at pageable speed")
        return False
    return True


def unregister(address: int, *, what: str) -> None:
    """Undo ``register`` (before the memory is unmapped: a mapping freed while registered
    makes later pinned allocations fail with "resource already mapped")."""
    result = int(torch.cuda.cudart().cudaHostUnregister(address))
    if result != 0:
        log.warning("ckpt.hostmem.unregister_failed", what=what, error=result)


class PinnedMapping:
    """``size`` bytes of page-locked host memory: an anonymous private mapping, populated,
    registered with CUDA (portable: every device's context may copy into it), and left out
    of forked children (``MADV_DONTFORK``: a child neither inherits nor copies it).

    ``tensor`` is its bytes (page-aligned); ``close`` unregisters, then unmaps (or leaves the
    unmapping to the last view still alive). Raises ``OSError`` where no memory can be
    mapped, and ``RuntimeError`` where CUDA refuses to register it (then nothing is held).
    """

    def __init__(self, size: int) -> None:
        if size <= 0 or size % mmap.PAGESIZE:
            raise ValueError(f"size {size} is not a positive multiple of the page size")
        self.size = size
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        dontfork = getattr(mmap, "MADV_DONTFORK", None)
        if dontfork is not None:
            self._map.madvise(dontfork)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        if not register(self.tensor.data_ptr(), size, what="host buffer", flags=1):
            self.tensor = None
            self._map.close()
            raise RuntimeError("CUDA refused to page-lock the host buffer")

    def close(self) -> None:
        """Unregister, then unmap (idempotent)."""
        tensor, self.tensor = self.tensor, None
        if tensor is None:
            return
        unregister(tensor.data_ptr(), what="host buffer")
        del tensor
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive: the mapping goes with the last one
            log.warning("ckpt.hostmem.unmap_deferred", bytes=self.size)
