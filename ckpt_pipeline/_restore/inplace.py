"""A reshard's reads straight into the live tensors, each backed up just before it is written.

A reshard reads byte ranges of the saved shards; where the bytes are bound for a live DTensor
whose local shard the apply would overwrite in place anyway (a tensor of the state or a
module's parameter, walked as ``apply.py`` walks them), on the host, contiguous, of the saved
dtype and of the local shape the reshard plans, and whose memory no other live tensor shares,
the ranges are copied into that local shard itself instead of into fresh memory that the apply
would then exchange bits with. Before each range lands in such a tensor, the bits it
overwrites are copied aside (``Prewrites``, into host memory of the tensor's size, by the
thread that reads the range): the rollback backup the exchange would have made, without the
exchange, taken by the reading threads in parallel. Optimizers (whose ``load_state_dict``
replaces their state rather than writing into it), other stateful objects and CUDA tensors
keep the read-then-apply path.

Until the apply takes them over (``apply_state(prewrites=...)``: a ``PrewrittenBackup``
journal entry each, undone like any other), ``Prewrites.undo()`` puts every written tensor
back: the reshard calls it whenever a step's load fails on any rank, so that a restore that
falls back to an older step, or fails, leaves the live state as it was.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence
from typing import Any

import torch

from .._format.documents import TensorRef
from .._tree import is_dtensor, is_stateful, join_path, state_dict_of
from ..errors import RestoreError
from .aliasing import exact, memory_range
from .backups import ADOPT_MIN_BYTES, Backup, OptimizerBackup, restored_local, view_key
from .live import walks_tuple

__all__ = ("INPLACE_MIN_BYTES", "Prewrites", "PrewrittenBackup", "inplace_targets",
           "overlapping")

INPLACE_MIN_BYTES = ADOPT_MIN_BYTES
"""Live local shards at least this large are read straight into (smaller ones are read into
fresh memory and exchanged or copied by the apply, as in a restore at the same layout)."""


class _Entry:
    """One live local shard read straight into: ``old`` holds the bits of every region of it
    listed in ``regions`` (element offset, sizes, strides) from before they were written."""

    __slots__ = ("live", "lock", "old", "path", "regions")

    def __init__(self, live: torch.Tensor, path: str) -> None:
        self.live = live
        self.path = path
        self.lock = threading.Lock()
        self.old = torch.empty_like(live, memory_format=torch.contiguous_format)
        self.regions: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def before(self, into: torch.Tensor) -> None:
        """Copy aside the bits of ``into`` (a view of ``live``) that a range is about to
        overwrite."""
        offset = int(into.storage_offset()) - int(self.live.storage_offset())
        region = (offset, tuple(into.shape), tuple(into.stride()))
        with torch.no_grad():
            exact(self._view(self.old, region, 0)).copy_(exact(into))
        with self.lock:
            self.regions.append(region)

    def restore(self) -> None:
        """Put back every region copied aside."""
        with torch.no_grad():
            for region in self.regions:
                exact(self._view(self.live, region, int(self.live.storage_offset()))).copy_(
                    exact(self._view(self.old, region, 0)))

    @staticmethod
    def _view(t: torch.Tensor, region: tuple[int, tuple[int, ...], tuple[int, ...]],
              base: int) -> torch.Tensor:
        offset, sizes, strides = region
        return t.as_strided(sizes, strides, base + offset)


class Prewrites:
    """The live local shards a reshard reads straight into (by the saved tensor's index), and
    the copies of their bits from before (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def add(self, index: int, live: torch.Tensor, path: str
            ) -> Callable[[torch.Tensor], None]:
        """Read saved tensor ``index`` into ``live`` (a contiguous local shard); returns what
        must run on each view of it before a range is copied into that view."""
        entry = self._entries[index] = _Entry(live, path)
        return entry.before

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def written_bytes(self) -> int:
        """Bytes of the live tensors written so far (each copied aside first)."""
        return sum(int(math.prod(sizes)) * entry.live.element_size()
                   for entry in self._entries.values() for _, sizes, _ in entry.regions)

    def backup_of(self, index: int, target: torch.Tensor) -> torch.Tensor | None:
        """The bits ``target`` had before the reshard wrote into it, where saved tensor
        ``index`` was read straight into ``target``'s memory; else None."""
        entry = self._entries.get(index)
        if entry is None or not entry.regions or view_key(entry.live) != view_key(target):
            return None
        return entry.old

    def journal(self) -> Iterator[PrewrittenBackup]:
        """A journal entry for each tensor written, which undoes it."""
        for entry in self._entries.values():
            if entry.regions:
                yield PrewrittenBackup(entry)

    def undo(self, *, step: int, rank: int | None) -> None:
        """Put every tensor written back as it was; RestoreError naming those that could not
        be (the others are put back still)."""
        failed: list[str] = []
        first: BaseException | None = None
        first_path: str | None = None
        for entry in self._entries.values():
            try:
                entry.restore()
            except Exception as exc:
                failed.append(f"{entry.path}: {type(exc).__name__}: {exc}")
                if first is None:
                    first, first_path = exc, entry.path
        self._entries.clear()
        if failed:
            raise RestoreError(
                f"putting back the live tensors a reshard of step {step} read into failed "
                f"for {'; '.join(failed)}: the live state is partly loaded", step=step,
                rank=rank, path=first_path,
                hint="do not train on this state: rebuild it, or restart the job") from first


class PrewrittenBackup(Backup):
    """A live tensor the reshard read straight into, with its bits from before."""

    def __init__(self, entry: _Entry) -> None:
        self.entry = entry
        self.path = entry.path
        self.nbytes = entry.old.numel() * entry.old.element_size()

    def undo(self) -> None:
        self.entry.restore()


def inplace_targets(live: Mapping[str, Any], tree: Any) -> dict[int, tuple[torch.Tensor, str]]:
    """{saved tensor index: (the live local shard the apply would overwrite in place, its
    path)} for the live DTensors that a reshard may read straight into (module docstring):
    reached as the apply reaches them, on the host, contiguous, at least ``INPLACE_MIN_BYTES``,
    each index and each memory once, overlapping no other live tensor."""
    found: dict[int, tuple[torch.Tensor, str]] = {}
    seen: set[int] = set()
    ranges: list[tuple[int, int]] = []

    def note(t: torch.Tensor) -> None:
        local = restored_local(t) if is_dtensor(t) else t
        if local.device.type == "cpu" and local.numel() > 0:
            ranges.append(memory_range(local))

    def offer(t: torch.Tensor, node: Any, path: str) -> None:
        note(t)
        if not isinstance(node, TensorRef) or not is_dtensor(t):
            return
        local = restored_local(t).detach()
        if (node.index in seen or local.device.type != "cpu" or local.layout != torch.strided
                or not local.is_contiguous() or local.is_conj() or local.is_neg()
                or local.numel() * local.element_size() < INPLACE_MIN_BYTES):
            seen.add(node.index)
            found.pop(node.index, None)
            return
        seen.add(node.index)
        found[node.index] = (local, path)

    def walk(obj: Any, node: Any, path: str, depth: int) -> None:
        if depth > 256:
            return
        if isinstance(obj, torch.Tensor):
            offer(obj, node, path)
        elif isinstance(obj, torch.nn.Module) and isinstance(node, dict):
            for key, value in obj.state_dict(keep_vars=True).items():
                if isinstance(value, torch.Tensor):
                    offer(value, node.get(key), join_path(path, key))
        elif is_stateful(obj):
            _note_all(obj, note)  # written by its own load_state_dict: never straight into
        elif isinstance(obj, MutableMapping) and isinstance(node, dict):
            for key, value in obj.items():
                if key in node:
                    walk(value, node[key], join_path(path, key), depth + 1)
                else:
                    _note_all(value, note)
        elif (isinstance(obj, MutableSequence) or walks_tuple(obj)) \
                and isinstance(node, (list, tuple)):
            for i, value in enumerate(obj):
                if i < len(node):
                    walk(value, node[i], join_path(path, i), depth + 1)
                else:
                    _note_all(value, note)
        else:
            _note_all(obj, note)

    for name, value in live.items():
        if isinstance(tree, dict) and name in tree:
            walk(value, tree[name], str(name), 0)
        else:
            _note_all(value, note)
    shared = overlapping(ranges)
    return {index: (local, path) for index, (local, path) in found.items()
            if memory_range(local) not in shared}


def overlapping(ranges: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """The byte ranges [start, end) of ``ranges`` that overlap another one of them (a range
    listed twice overlaps itself): one sweep in start order, O(n log n)."""
    out: set[tuple[int, int]] = set()
    reach, holder = -1, (0, 0)  # the furthest end so far, and the range that has it
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if a < reach:
            out.add((a, b))
            out.add(holder)
        if b > reach:
            reach, holder = b, (a, b)
    return out


def _note_all(obj: Any, note: Callable[[torch.Tensor], None], depth: int = 0) -> None:
    """Every tensor ``obj`` holds (its state dict's, for a stateful object; an optimizer's
    state)."""
    if depth > 256:
        return
    if isinstance(obj, torch.Tensor):
        note(obj)
    elif is_stateful(obj) or OptimizerBackup.applies_to(obj):
        try:
            state = state_dict_of(obj)
        except Exception:
            return
        _note_all(state, note, depth + 1)
    elif isinstance(obj, Mapping):
        for value in list(obj.values()):
            _note_all(value, note, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in list(obj):
            _note_all(value, note, depth + 1)
