"""The host buffer pool of the memory tier: shared-memory buffers that are the checkpoint.

The same face as ``HostPool`` (admission acquires a slot, the stages release it), with one
difference: a slot given back by its save is not free while it holds a step the memory tier
keeps (``keep``), or one that a write-through to disk is reading (``pin_disk``). A free slot
that is too small is re-made at the size asked for. Each rank's buffers are files under
``slots/rank-R/`` of the memory root while they are free or being filled; a committed one is
renamed into its step's directory and back when the step is dropped (``_tiers/memory/steps``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from dataclasses import dataclass

import torch

from .._format.region import align_up
from .._logging import log
from .._tiers.memory.shm import ShmBuffer, free_bytes, room_error
from .._tiers.memory.steps import slot_dir
from ..errors import PipelineClosedError
from .buffers import Slot

__all__ = ("MemoryPool", "MemorySlot", "slot_dir")


@dataclass(slots=True)
class MemorySlot(Slot):
    """A slot whose buffer is a shared-memory file (``rel``: its name now, in the root)."""

    shm: ShmBuffer | None = None
    rel: str = ""
    home: str = ""
    """Its name while free (under ``slot_dir``): where it goes back when its step is dropped."""


class MemoryPool:
    """Shared-memory slots of one rank (see the module docstring). Thread-safe."""

    def __init__(self, root: str, rank: int, slots: int) -> None:
        self.root = root
        self.rank = rank
        self._slots: list[MemorySlot | None] = [None] * slots
        self._holds: list[set[str]] = [set() for _ in range(slots)]
        self._cond = threading.Condition()
        self._closed = False
        self._prefix = secrets.token_hex(4)
        self._made = 0

    # -- the HostPool face ---------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        with self._cond:
            return sum(s.shm.size for s in self._slots if s is not None and s.shm is not None)

    @property
    def pinned(self) -> bool:
        with self._cond:
            return any(s is not None and s.shm is not None and s.shm.registered
                       for s in self._slots)

    def made_for(self, nbytes: int, *, pinned: bool) -> bool:
        """Whether every slot has a buffer of at least ``nbytes`` (held or not), none of
        them being made."""
        size = align_up(max(nbytes, mmap.PAGESIZE), mmap.PAGESIZE)
        register = pinned and torch.cuda.is_available()
        with self._cond:
            return all(slot is not None and slot.shm is not None and slot.shm.size >= size
                       and (slot.shm.registered or not register) and "making" not in holds
                       for slot, holds in zip(self._slots, self._holds))

    def acquire(self, nbytes: int, *, pinned: bool, block: bool,
                timeout: float | None = None, make: bool = True) -> Slot | None:
        """A slot no save holds and no kept step or write-through holds, of at least
        ``nbytes`` (a free one too small is re-made); None when none is free and ``block`` is
        False. A StorageError when the memory file system has no room for it.

        ``make=False``: only a buffer made already, never a making here (None instead)."""
        size = align_up(max(nbytes, mmap.PAGESIZE), mmap.PAGESIZE)
        register = pinned and torch.cuda.is_available()
        while True:
            with self._cond:
                if self._closed:
                    raise PipelineClosedError("the memory tier's buffers are closed: the "
                                              "pipeline was closed", hint="open a new pipeline")
                free = [i for i, held in enumerate(self._holds) if not held]
                for i in free:
                    slot = self._slots[i]
                    if slot is not None and slot.shm is not None and slot.shm.size >= size \
                            and (slot.shm.registered or not register):
                        self._holds[i].add("save")
                        return slot
                if not make:
                    return None
                if not free:
                    if not block or not self._cond.wait(timeout):
                        return None
                    continue
                index = free[0]  # (re)made outside the lock, marked "making" meanwhile
                self._holds[index].add("making")
            made = self._make_for_save(index, size, register)
            if made is not None:
                return made

    def _make_for_save(self, index: int, size: int, register: bool) -> MemorySlot | None:
        """Make slot ``index`` (marked "making") and hand it to the save that asked, then
        the slots never made yet in the background; None if the pool closed meanwhile."""
        made: MemorySlot | None = None
        try:
            self._make(index, size, register)
        finally:
            with self._cond:
                self._holds[index].discard("making")
                if self._slots[index] is not None and not self._closed:
                    made = self._slots[index]
                    self._holds[index].add("save")
                    self._make_rest_later(size, register)
                self._cond.notify_all()
        return made

    def release(self, slot: Slot) -> None:
        self._drop(slot, "save")

    def close(self) -> None:
        """Unregister and unmap every buffer; the files stay (the tier removes them)."""
        with self._cond:
            self._closed = True
            for slot in self._slots:
                if slot is not None and slot.shm is not None:
                    slot.shm.close()
            self._cond.notify_all()

    # -- the memory tier's holds ---------------------------------------------------------

    def keep(self, slot: Slot) -> None:
        """The slot holds a committed step the tier keeps: not free until ``unkeep``."""
        self._hold(slot, "kept")

    def unkeep(self, slot: Slot) -> None:
        self._drop(slot, "kept")

    def pin_disk(self, slot: Slot) -> None:
        """A write-through to disk reads the slot: not free until ``unpin_disk``."""
        self._hold(slot, "disk")

    def unpin_disk(self, slot: Slot) -> None:
        self._drop(slot, "disk")

    def reserve(self, nbytes: int, *, register: bool) -> None:
        """Make every slot now, at ``nbytes`` each (at open, off the training thread),
        after checking the file system has room for all of them."""
        size = align_up(max(nbytes, mmap.PAGESIZE), mmap.PAGESIZE)
        need = size * len(self._slots)
        free = free_bytes(self.root)
        if need > free:
            raise room_error(self.root, need, free, f"{len(self._slots)} buffers of {size} "
                             "bytes (MemoryConfig(slots=, slot_bytes=))", rank=self.rank)
        register = register and torch.cuda.is_available()
        with self._cond:  # made outside the lock: a save meanwhile waits for its slot only
            todo = [i for i, slot in enumerate(self._slots) if not self._holds[i] and (
                slot is None or slot.shm is None or slot.shm.size < size)]
            for index in todo:
                self._holds[index].add("making")
        for index in todo:
            try:
                self._make(index, size, register)
            finally:
                self._unhold(index, "making")

    def moved(self, slot: Slot, rel: str) -> None:
        """The slot's file was renamed to ``rel`` (into its step, or back home)."""
        assert isinstance(slot, MemorySlot)
        slot.rel = rel

    # -- internals -----------------------------------------------------------------------

    def _make_rest_later(self, size: int, register: bool) -> None:
        """Make the slots never made yet at ``size``, in a background thread (the first save
        made its own on the training thread; the next ones then find theirs ready). Under the
        lock: each is marked "making", so that no save takes it meanwhile."""
        todo = [i for i, slot in enumerate(self._slots)
                if slot is None and not self._holds[i]]
        if not todo:
            return
        for index in todo:
            self._holds[index].add("making")

        def make() -> None:
            for index in todo:
                try:
                    self._make(index, size, register)
                except Exception as exc:  # a later save makes it, or fails with the reason
                    log.warning("ckpt.memory.buffer_failed", rank=self.rank, slot=index,
                                bytes=size, error=f"{type(exc).__name__}: {exc}")
                finally:
                    self._unhold(index, "making")

        threading.Thread(target=make, name="ckpt-memory-buffers", daemon=True).start()

    def _make(self, index: int, size: int, register: bool) -> None:
        """(Re)make slot ``index`` at ``size`` bytes: its old buffer goes, once the file
        system is known to have room for the new one. The caller holds the slot: under the
        lock (a save), or marked "making" (then the buffer is made outside the lock)."""
        with self._cond:
            if self._closed:
                return
            old = self._slots[index]
            grows = size - (0 if old is None or old.shm is None else old.shm.size)
        free = free_bytes(self.root)
        if grows > free:
            raise room_error(self.root, grows, free, f"a buffer of {size} bytes",
                             rank=self.rank)
        with self._cond:
            self._slots[index] = None
            self._made += 1
            home = os.path.join(slot_dir(self.rank), f"{self._prefix}-{index}-{self._made}")
        if old is not None:
            self._discard(old)
        shm = ShmBuffer(os.path.join(self.root, home), size, register=register)
        assert shm.tensor is not None
        slot = MemorySlot(index, shm.tensor, 0 if old is None else old.generation + 1, shm,
                          home, home)
        with self._cond:
            if not self._closed:
                self._slots[index] = slot
                log.info("ckpt.memory.buffer_made", rank=self.rank, slot=index, bytes=size,
                         registered=shm.registered)
                return
        self._discard(slot)  # the pool closed meanwhile

    def _discard(self, slot: MemorySlot) -> None:
        """Unmap a buffer and remove its file."""
        if slot.shm is not None:
            slot.shm.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.root, slot.rel))

    def _hold(self, slot: Slot, why: str) -> None:
        with self._cond:
            self._holds[slot.index].add(why)

    def _drop(self, slot: Slot, why: str) -> None:
        self._unhold(slot.index, why)

    def _unhold(self, index: int, why: str) -> None:
        with self._cond:
            self._holds[index].discard(why)
            self._cond.notify_all()
