"""Power-loss simulation: a storage that knows what survives a power cut, and cuts the power.

``PowerLossStorage`` is the real ``LocalStorage`` (real files, real ``fsync``) plus a model of
what is *durable* at every moment (``_model.py``), kept from the calls that go through it:

- a file (an inode of the model, whatever names it has) is durable with its content as of its
  last ``fsync``; every ``pwrite`` since, through any descriptor of that inode (``create_temp``
  or ``open_direct``: direct I/O is not durable before ``fsync`` either), is volatile, and so
  is a ``truncate`` (a size that grows is a write of zeros; one that shrinks may be lost);
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
before it); reads are not modelled (they see the real, pre-crash files; ``copy_out`` is a read
of the root's file, its target lies outside the disk); FIFOs and sockets
present at ``arm()`` are not modelled (they are absent from the image); a write that fails for
a real reason is recorded as attempted. Calls hold one lock while they touch the disk, so
concurrent writers are serialised: fine for tests with small states.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

from ..storage import LocalStorage
from ._image import CrashImage, materialize
from ._model import DiskModel, VolatileChange, snapshot
from ._recording import RecordingStorage
from ._switch import PowerCut, StorageCall

__all__ = ("PowerCut", "PowerLossStorage", "StorageCall")


class PowerLossStorage(RecordingStorage):
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
        with self._lock:
            if not self.root.exists() and self.disk == self.root:
                LocalStorage.ensure_root(self)  # the root itself is taken as durable
            if not self.disk.is_dir():
                raise ValueError(f"the disk {self.disk} must be an existing directory")
            self._model = DiskModel(snapshot(str(self.disk)), atomic_rename=self.atomic_rename)
            self._fds.clear()
            self._switch.arm(cut_at, cut_if)

    def cut(self) -> None:
        """The power goes off now: every storage call from now on raises ``PowerCut``."""
        with self._lock:
            self._switch.cut()

    @property
    def is_cut(self) -> bool:
        """Whether the power is off."""
        return self._switch.is_cut

    @property
    def cut_call(self) -> StorageCall | None:
        """The call refused first (None when ``cut()`` was called, or before the cut)."""
        return self._switch.cut_call

    def calls(self) -> list[StorageCall]:
        """The calls made since ``arm()`` (not the refused ones), in order."""
        with self._lock:
            return self._switch.calls()

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
        if not self._switch.armed:
            raise RuntimeError("arm() the storage before materializing a crash image")
        rng = rng if rng is not None else random.Random()
        if keep is None:
            r = rng.random()
            keep = 0.0 if r < 0.15 else 1.0 if r < 0.3 else rng.random()
        with self._lock:
            return materialize(self._model, self._root_rel,
                               Path(os.path.abspath(os.fspath(dest))), rng, keep)
