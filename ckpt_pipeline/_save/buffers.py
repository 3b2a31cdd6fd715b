"""The memory a save copies into: host buffers allocated once, and per-GPU staging buffers.

``HostPool``: pinned (or plain) host buffers, sized to the state, reused for every save; the
number of slots bounds host memory. ``DeviceStaging``: a buffer per GPU that CUDA tensors are
copied into first (device to device), so that the caller's next update waits only for that.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .._format.limits import ALIGN
from .._format.region import align_up
from .._hostmem import PinnedMapping
from .._logging import log
from ..errors import PipelineClosedError

_log = log

__all__ = ("DeviceStaging", "HostPool", "Slot", "side_stream")


@dataclass(slots=True)
class Slot:
    """One host buffer of the pool, lent to one save at a time."""

    index: int
    buffer: torch.Tensor
    generation: int


class HostPool:
    """Host buffers allocated once, sized to the state, and reused for every save.

    The pool grows (all slots re-allocated) only when a save needs more bytes than a slot holds,
    and only once every slot is free again; the number of slots bounds host memory. Pinned
    slots are ``PinnedMapping``s (populated, then registered, so that making them holds up
    the GPU for a fraction of what torch's pinned allocation does, at the exact size rather
    than the next power of 2); torch's pinned memory where CUDA refuses to register one.
    """

    def __init__(self, slots: int) -> None:
        self._slot_count = slots
        self._buffers: list[torch.Tensor] = []
        self._free: list[int] = []
        self._slot_bytes = 0
        self._pinned = False
        self._generation = 0
        self._cond = threading.Condition()
        self._closed = False
        self._making = False  # reserve() allocates outside the lock
        self._mappings: list[PinnedMapping] = []  # what the pinned slots are made of

    @property
    def allocated_bytes(self) -> int:
        return self._slot_bytes * len(self._buffers)

    @property
    def pinned(self) -> bool:
        return self._pinned

    def acquire(self, nbytes: int, *, pinned: bool, block: bool,
                timeout: float | None = None, make: bool = True) -> Slot | None:
        """A free slot of at least ``nbytes``; None when ``block`` is False and none is free.

        The buffers are (re)made here when none fits and every slot is free, outside the
        lock: another caller meanwhile finds no slot (and waits, or goes on without one).
        ``make=False``: only a slot that exists already, never an allocation here (None
        instead: the caller takes one later, off the training thread)."""
        while True:
            with self._cond:
                if self._closed:
                    raise PipelineClosedError("the host buffer pool is closed: the pipeline "
                                              "was closed", hint="open a new pipeline")
                fits = nbytes <= self._slot_bytes and (self._pinned or not pinned)
                if fits and self._free:
                    index = self._free.pop()
                    return Slot(index, self._buffers[index], self._generation)
                if not make:
                    return None
                grow = not fits and self._start_making(nbytes)
                if not grow:
                    if not block or not self._cond.wait(timeout):
                        return None
                    continue
            self._build(nbytes, pinned or self._pinned)

    def made_for(self, nbytes: int, *, pinned: bool) -> bool:
        """Whether every slot has a buffer of at least ``nbytes`` (free or held), none of
        them being (re)made."""
        with self._cond:
            return (not self._making and nbytes <= self._slot_bytes
                    and (self._pinned or not pinned))

    def reserve(self, nbytes: int, *, register: bool) -> None:
        """Make every slot at ``nbytes`` now (at open, in a background thread, when the size
        is known: a restart saves the state of the step it restored), unless they are as
        large already or a save holds one. A save that asks meanwhile waits for it (or, with
        device staging, copies to the GPU and goes on)."""
        with self._cond:
            if self._closed or self._slot_bytes >= nbytes or not self._start_making(nbytes):
                return
        self._build(nbytes, register)

    def _start_making(self, nbytes: int) -> bool:
        """Under the lock: claim the (re)making of every slot, if no save holds one and no
        one is making them; the old buffers go first."""
        if self._making or len(self._free) != len(self._buffers):
            return False
        self._making = True
        self._buffers, self._free, self._slot_bytes = [], [], 0
        self._generation += 1
        return True

    def _build(self, nbytes: int, pinned: bool) -> None:
        """Outside the lock, after ``_start_making``: free the old slots, allocate and
        install the new ones."""
        size, pin = align_up(max(nbytes, ALIGN)), pinned and torch.cuda.is_available()
        with self._cond:
            old, self._mappings = self._mappings, []
        _close_mappings(old)
        buffers: list[torch.Tensor] | None = None
        mappings: list[PinnedMapping] = []
        try:
            buffers = [_host_buffer(size, pin, mappings) for _ in range(self._slot_count)]
        finally:
            with self._cond:
                self._making = False
                if buffers is not None and not self._closed:
                    self._buffers, self._free = buffers, list(range(len(buffers)))
                    self._slot_bytes, self._pinned = size, pin
                    self._mappings = mappings
                    self._generation += 1
                    mappings = []
                self._cond.notify_all()
            _close_mappings(mappings)  # made for a pool closed meanwhile, or half made

    def release(self, slot: Slot) -> None:
        with self._cond:
            if slot.generation == self._generation and slot.index not in self._free:
                self._free.append(slot.index)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._buffers = []
            self._free = []
            self._slot_bytes = 0
            old, self._mappings = self._mappings, []
            self._cond.notify_all()
        _close_mappings(old)


def _host_buffer(size: int, pinned: bool, mappings: list[PinnedMapping]) -> torch.Tensor:
    """One slot's buffer: a ``PinnedMapping`` (appended to ``mappings``) where pinned, torch's
    pinned memory where CUDA refuses to register one, pageable memory otherwise."""
    if pinned:
        try:
            mapping = PinnedMapping(size)
        except (OSError, RuntimeError) as exc:
            _log.warning("ckpt.snapshot.pinned_mapping_refused", bytes=size, error=str(exc),
                         hint="using torch's pinned memory instead")
        else:
            mappings.append(mapping)
            assert mapping.tensor is not None
            return mapping.tensor
    return _aligned_zeros(size, pinned)


def _close_mappings(mappings: list[PinnedMapping]) -> None:
    """Unregister and unmap slots that no save holds, once the GPU's copies into them are
    done (the side streams synchronised: a copy may still land after its slot's release on
    a failed or cancelled save)."""
    if not mappings:
        return
    for stream in list(_side_streams.values()):
        stream.synchronize()
    for mapping in mappings:
        mapping.close()


def _aligned_zeros(size: int, pinned: bool) -> torch.Tensor:
    """``size`` zero bytes starting at an ``ALIGN``-aligned address (for direct I/O)."""
    raw = torch.zeros(size + ALIGN, dtype=torch.uint8, pin_memory=pinned)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + size]  # a view: it keeps the whole allocation alive


class DeviceStaging:
    """One staging buffer per GPU, allocated once (grown when a state needs more), reused.

    A save copies its CUDA tensors into it (device to device, far faster than to the host),
    the caller's next update waits only for that, and the pipeline then queues the copies to
    the host from it. One save holds a device's buffer from its device copy until its host
    copies are queued. If the buffer cannot be allocated, or is still held after ``wait_s``,
    the save copies straight to the host (logged).

    ``transient``: a bridge for saves that find no host buffer made yet (the default
    ``device_staging=None``). Such a buffer is allocated only where the GPU keeps at least
    ``ROOM_LEFT`` of its memory free beside it, is never waited for (held: the save takes its
    host buffer instead), and is freed at ``release``: to PyTorch's caching allocator, marked
    in use by the side stream, so that no allocation reuses it before the host copies queued
    from it are done.
    """

    def __init__(self, wait_s: float = 60.0, *, transient: bool = False) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._held: set[int] = set()
        self._refused: dict[int, int] = {}  # device -> size that failed to allocate
        self._cond = threading.Condition()
        self._wait_s = 0.0 if transient else wait_s
        self._transient = transient

    @property
    def allocated_bytes(self) -> int:
        with self._cond:
            return sum(b.numel() for b in self._buffers.values())

    def acquire(self, device: torch.device, nbytes: int) -> torch.Tensor | None:
        """Hold the device's buffer (at least ``nbytes``), or None: copy straight to the host."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._cond:
            if not self._cond.wait_for(lambda: index not in self._held, self._wait_s):
                if not self._transient:
                    _log.warning("ckpt.snapshot.staging_busy", device=str(device),
                                 waited_s=self._wait_s, hint="copying straight to host memory")
                return None
            buffer = self._buffers.get(index)
            if buffer is None or buffer.numel() < nbytes:
                if self._refused.get(index) == nbytes or not self._has_room(index, nbytes):
                    return None
                buffer = self._allocate(device, index, nbytes)
                if buffer is None:
                    return None
            self._held.add(index)
            return buffer

    def release(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._cond:
            self._held.discard(index)
            if self._transient and index in self._buffers:
                buffer = self._buffers.pop(index)
                buffer.record_stream(side_stream(device))  # freed once the copies from it ran
                _log.info("ckpt.snapshot.staging_freed", device=str(device),
                          bytes=buffer.numel())
                del buffer
            self._cond.notify_all()

    def _has_room(self, index: int, nbytes: int) -> bool:
        """Whether a transient buffer of ``nbytes`` leaves ``ROOM_LEFT`` of the GPU free
        (an explicit ``device_staging=True`` only needs the allocation to succeed)."""
        if not self._transient:
            return True
        free, total = torch.cuda.mem_get_info(index)
        if free - nbytes >= ROOM_LEFT * total:
            return True
        self._refused[index] = nbytes
        _log.info("ckpt.snapshot.staging_no_room", device=f"cuda:{index}", bytes=nbytes,
                  free_bytes=free, total_bytes=total,
                  hint="this save waits for its host buffer to be made")
        return False

    def _allocate(self, device: torch.device, index: int, nbytes: int) -> torch.Tensor | None:
        if index in self._buffers:  # host copies from the old buffer may still be running
            side_stream(device).synchronize()
            del self._buffers[index]
        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError as exc:
            self._refused[index] = nbytes
            _log.warning("ckpt.snapshot.staging_refused", device=str(device), bytes=nbytes,
                         error=str(exc).splitlines()[0],
                         hint="copying straight to host memory instead")
            return None
        self._buffers[index] = buffer
        _log.info("ckpt.snapshot.staging_allocated", device=str(device), bytes=nbytes,
                  transient=self._transient)
        return buffer

    def close(self) -> None:
        with self._cond:
            for index in self._buffers:
                side_stream(torch.device("cuda", index)).synchronize()
            self._buffers.clear()
            self._held.clear()
            self._cond.notify_all()


ROOM_LEFT = 0.10
"""The share of a GPU's memory a transient staging buffer leaves free beside it."""

_side_streams: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = torch.cuda.Stream(device=index)
        _side_streams[index] = stream
    return stream
