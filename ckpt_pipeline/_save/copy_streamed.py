"""Stage 1, copy, of a state larger than the host buffer: its copies, a piece at a time.

At ``save()`` only the tensors' versions and an event on the caller's stream are recorded
(``begin_streamed_snapshot``); the write_data stage then copies each byte range of the data
region into a free segment of the host buffer (``copy_piece``) while the pieces already copied
are hashed and written. The ``Snapshot`` (``copy.py``) tracks those copies and their torn check
like any other.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import torch

from .buffers import side_stream
from .copy import Snapshot

__all__ = ("begin_streamed_snapshot", "copy_piece")


def begin_streamed_snapshot(tensors: Sequence[torch.Tensor], paths: Sequence[str],
                            sources: Sequence[torch.Tensor], offsets: Sequence[int],
                            gaps: Sequence[tuple[int, int]], *, step: int,
                            rank: int) -> Snapshot:
    """A snapshot whose copies the write_data stage makes later, a host buffer at a time.

    Runs on the training thread: records the tensors' versions and, per CUDA device, an event
    on the caller's stream after which the copies run. ``sources``/``offsets``: the stored
    items (``item_sources``) and where they go in the file.
    """
    snap = Snapshot(step, rank, streaming=True)
    snap.items = list(sources)
    snap.item_offsets = list(offsets)
    snap.gaps = list(gaps)
    for t, path in zip(tensors, paths):
        snap.sources.append(t)
        snap.versions.append(t._version)
        snap.source_paths.append(path)
    for t in sources:
        if t.device.type == "cuda":
            index = t.device.index if t.device.index is not None else 0
            if index not in snap.ready:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(t.device))
                snap.ready[index] = event
    return snap


def copy_piece(snap: Snapshot, start: int, end: int, buffer: torch.Tensor,
               base: int) -> dict[int, torch.cuda.Event]:
    """Copy the file range [start, end) of the data region into ``buffer`` (file offset
    ``base`` at its start): the parts of every item in it, and zeros in the gaps.

    CPU parts are copied now; CUDA parts are launched on the side stream, after the snapshot's
    ready event. Returns the event that completes this piece's copies, per CUDA device.
    """
    for g0, g1 in snap.gaps:
        lo, hi = max(g0, start), min(g1, end)
        if lo < hi:
            buffer[lo - base:hi - base].zero_()
    offsets = snap.item_offsets
    sides: dict[int, torch.cuda.Stream] = {}
    k = max(0, bisect_right(offsets, start) - 1)
    while k < len(offsets) and offsets[k] < end:
        t = snap.items[k]
        flat = _flat_bytes(t)
        lo, hi = max(start, offsets[k]), min(end, offsets[k] + flat.numel())
        k += 1
        if lo >= hi:
            continue
        dest = buffer[lo - base:hi - base]
        part = flat[lo - offsets[k - 1]:hi - offsets[k - 1]]
        if t.device.type != "cuda":
            dest.copy_(part)
            continue
        index = t.device.index if t.device.index is not None else 0
        side = sides.get(index)
        if side is None:
            side = sides[index] = side_stream(t.device)
            ready = snap.ready.pop(index, None)  # the first piece on this device waits for it
            if ready is not None:
                side.wait_event(ready)
        with torch.cuda.stream(side):
            dest.copy_(part, non_blocking=True)
    done: dict[int, torch.cuda.Event] = {}
    for index, side in sides.items():
        event = torch.cuda.Event()
        event.record(side)
        done[index] = event
    return done


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
