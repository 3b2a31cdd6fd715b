"""Where each tensor's bytes go in the shard: storages written once, packed, views of them.

Tensors that share memory (tied weights, views) are found by their storage: overlapping (or
touching) byte ranges of one storage are stored once, as one span, and each tensor as a view of
it (byte offset, shape, stride), so that restore can give them back aliased. Any other tensor is
stored alone and contiguously. Small storages are packed from the start of the data region,
largest element size first, so that each is aligned to its element size without padding; a
storage of ``LARGE_STORAGE`` bytes or more starts at an aligned offset (``ALIGN``), where direct
I/O and a future zero-copy read need it. The host buffer mirrors the file from offset 0, so that
an aligned piece of the buffer is an aligned piece of the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .header import StorageRecord
from .limits import ALIGN
from .shard import PREAMBLE_SIZE

__all__ = ("EMPTY_LAYOUT", "LARGE_STORAGE", "DataLayout", "StoredItem", "padded_to", "plan_layout",
           "span_source")

LARGE_STORAGE = 1 << 20
"""Storages at least this large start at an ``ALIGN``-aligned offset (at most 0.4% padding)."""


class StoredItem(NamedTuple):
    """One storage to copy into the buffer: a tensor (copied contiguously) or a raw span.

    (A named tuple: a save of a million tensors makes a million of them on the training
    thread.)"""

    offset: int
    nbytes: int
    device: str
    source: int
    """The tensor whose memory is copied."""
    span: int | None
    """For a shared storage: the byte offset of the span in the source's untyped storage."""


@dataclass(frozen=True, slots=True)
class DataLayout:
    """The data region of one save: items in file order, and each tensor's view of one."""

    items: tuple[StoredItem, ...]
    tensor_item: tuple[int, ...]
    tensor_offset: tuple[int, ...]
    """Byte offset of each tensor in its item."""
    tensor_stride: tuple[tuple[int, ...] | None, ...]
    """Each tensor's stride in its item; None: contiguous (the item is the tensor alone)."""
    data_end: int
    """Absolute file offset where the data region ends (and the header starts)."""
    gaps: tuple[tuple[int, int], ...]
    """Padding between items, zeroed in the buffer so that a shard's bytes are deterministic."""

    @property
    def data_length(self) -> int:
        return self.data_end - PREAMBLE_SIZE

    @property
    def buffer_bytes(self) -> int:
        """The host buffer a save needs: the file up to the end of the data region."""
        return self.data_end

    stored_bytes: int = 0
    """Bytes of the items: the state's unique tensor bytes."""

    def storage_records(self) -> tuple[StorageRecord, ...]:
        return tuple(StorageRecord(i.offset, i.nbytes, i.device) for i in self.items)


EMPTY_LAYOUT = DataLayout((), (), (), (), PREAMBLE_SIZE, ())
"""The layout of a save without tensors (and of a save that failed before it had one)."""


def padded_to(layout: DataLayout, end: int) -> DataLayout:
    """``layout`` with its data region extended to ``end`` by a zeroed gap (the memory tier:
    a shard whose region fills its buffer, so that its header lies beyond the mapping)."""
    if end < layout.data_end:
        raise ValueError(f"cannot pad a data region of {layout.data_end} bytes to {end}")
    if end == layout.data_end:
        return layout
    return replace(layout, data_end=end, gaps=(*layout.gaps, (layout.data_end, end)))


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) of a non-empty tensor's elements in its untyped storage."""
    size = t.element_size()
    start = int(t.storage_offset()) * size
    last = sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * size


def _device_name(index: int) -> str:
    return "cpu" if index < 0 else f"cuda:{index}"


Pending = tuple[int, int, int, int, "int | None", "list[tuple[int, int, tuple[int, ...] | None]]"]
"""An item before placement: (nbytes, alignment, device index (-1: CPU), source tensor,
span start, [(tensor, byte offset in the item, stride or None for contiguous)])."""


def plan_layout(tensors: Sequence[torch.Tensor]) -> DataLayout:
    """Group tensors by the memory they share, and lay the groups out in the data region.

    Runs on the training thread, so per tensor it touches only what it must.
    """
    n = len(tensors)
    sizes = [0] * n
    aligns = [0] * n
    devices = [0] * n
    first: dict[tuple[int, int], int] = {}
    shared: set[tuple[int, int]] = set()
    for i, t in enumerate(tensors):
        esize = t.element_size()
        nbytes = t.numel() * esize
        sizes[i] = nbytes
        aligns[i] = esize
        index = devices[i] = t.get_device()
        if nbytes and not t._is_zerotensor():  # (a zero tensor has no storage)
            key = (index, t.untyped_storage().data_ptr())
            if first.setdefault(key, i) != i:
                shared.add(key)
    pending: list[Pending] = []
    grouped: set[int] = set()
    if shared:
        groups: dict[tuple[int, int], list[int]] = {key: [] for key in shared}
        for i, t in enumerate(tensors):
            # Only memory that holds the values as they are is shared (no lazy conj/neg bit,
            # no zero tensor without memory): those are stored alone, as their values.
            if sizes[i] and not (t.is_conj() or t.is_neg() or t._is_zerotensor()):
                members = groups.get((devices[i], t.untyped_storage().data_ptr()))
                if members is not None:
                    members.append(i)
        for members in groups.values():
            extents = sorted((_extent(tensors[i]), i) for i in members)
            component: list[int] = []
            reach = -1
            for (start, end), i in extents:
                if component and start > reach:
                    _add_span(pending, tensors, component, grouped)
                    component = []
                component.append(i)
                reach = max(reach, end)
            _add_span(pending, tensors, component, grouped)
    for i in range(n):
        if i not in grouped:
            pending.append((sizes[i], aligns[i], devices[i], i, None, [(i, 0, None)]))
    return _place(pending, n)


def _add_span(pending: list[Pending], tensors: Sequence[torch.Tensor], component: list[int],
              grouped: set[int]) -> None:
    """Store a component of a shared storage as one span, or its only tensor alone."""
    if len(component) < 2:
        return
    align = max(tensors[i].element_size() for i in component)
    start = min(_extent(tensors[i])[0] for i in component) // align * align
    end = max(_extent(tensors[i])[1] for i in component)
    views: list[tuple[int, int, tuple[int, ...] | None]] = [
        (i, _extent(tensors[i])[0] - start, tuple(tensors[i].stride())) for i in component]
    pending.append((end - start, align, tensors[component[0]].get_device(), component[0],
                    start, views))
    grouped.update(component)


def _place(pending: list[Pending], count: int) -> DataLayout:
    small = sorted((p for p in pending if p[0] < LARGE_STORAGE),
                   key=lambda p: (p[2], -p[1], p[3]))
    large = sorted((p for p in pending if p[0] >= LARGE_STORAGE), key=lambda p: p[3])
    items: list[StoredItem] = []
    gaps: list[tuple[int, int]] = []
    tensor_item = [0] * count
    tensor_offset = [0] * count
    tensor_stride: list[tuple[int, ...] | None] = [None] * count
    pos = PREAMBLE_SIZE
    names: dict[int, str] = {}
    for nbytes, align, device, source, span, views in (*small, *large):
        step = ALIGN if nbytes >= LARGE_STORAGE else align
        start = (pos + step - 1) // step * step
        if start > pos:
            gaps.append((pos, start))
        for i, offset, stride in views:
            tensor_item[i] = len(items)
            tensor_offset[i] = offset
            tensor_stride[i] = stride
        name = names.get(device)
        if name is None:
            name = names[device] = _device_name(device)
        items.append(StoredItem(start, nbytes, name, source, span))
        pos = start + nbytes
    return DataLayout(tuple(items), tuple(tensor_item), tuple(tensor_offset),
                      tuple(tensor_stride), pos, tuple(gaps), sum(p[0] for p in pending))


def span_source(t: torch.Tensor, span: int, nbytes: int) -> torch.Tensor:
    """The raw bytes [span, span + nbytes) of ``t``'s untyped storage, as a uint8 tensor."""
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    return out.set_(t.untyped_storage(), span, (nbytes,), (1,))

