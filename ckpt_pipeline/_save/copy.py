"""Stage 1, copy: copy the state's tensors into a reusable host buffer (``buffers.py``).

Only this part runs on the training thread. CPU tensors are copied before ``save()`` returns;
CUDA tensors are copied on a side stream, after an event recorded on the caller's stream, into
pinned memory, and their completion is tracked by CUDA events. Version counters catch a tensor
mutated in place while its copy may still be running. A state larger than the host buffer
is copied later, a piece at a time, by the write_data stage (``copy_streamed.py``).

With device staging, a save may start before its host buffer exists (``take_snapshot`` without
a buffer): the CUDA tensors go to the staging buffer, the CPU ones to a copy held by the
snapshot, and the copy stage binds the buffer once the pool has one (``Snapshot.bind``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .._format.layout import DataLayout, span_source
from .._format.region import align_up
from .._logging import log
from ..errors import SnapshotTornError
from .buffers import DeviceStaging, side_stream

_log = log

__all__ = ("NoStagingError", "Snapshot", "item_sources", "take_snapshot")


class NoStagingError(Exception):
    """A save without a host buffer found no device staging buffer: it needs its host buffer
    now (``take_snapshot`` gave back what it held)."""


@dataclass(slots=True)
class _HostCopies:
    """Copies to the host still to be queued, from a device's staging buffer."""

    device: torch.device
    indices: list[int]
    staged: list[torch.Tensor]  # each tensor's copy in the staging buffer
    buffer: torch.Tensor | None  # None until the save's host buffer is bound
    offsets: Sequence[int]
    staging: DeviceStaging


def _staging_layout(sources: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Aligned offsets of each source in a device's staging buffer, and its length."""
    offsets: list[int] = []
    end = 0
    for t in sources:
        start = align_up(end)
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


def item_sources(tensors: Sequence[torch.Tensor], layout: DataLayout) -> list[torch.Tensor]:
    """What each stored item copies: the tensor itself, or the raw bytes of a shared span.

    A bool tensor is copied as its bytes (a uint8 view): a copy as bool stores 0 or 1 for
    any other byte, and the restore writes back exactly the bytes that were saved."""
    return [_bits(tensors[item.source]) if item.span is None
            else span_source(tensors[item.source], item.span, item.nbytes)
            for item in layout.items]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


@dataclass(slots=True)
class Snapshot:
    """Copies of one save in flight: which are still running, and whether they may be torn."""

    step: int
    rank: int
    events: list[tuple[torch.device, torch.cuda.Event]] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    source_paths: list[str] = field(default_factory=list)
    released: bool = False
    torn: SnapshotTornError | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # A streamed snapshot (state larger than a host buffer) is copied piece by piece by the
    # write_data stage: ``ready`` orders its copies after the caller's work at save() time,
    # ``enqueued`` is set once every copy is launched (and ``events`` is final).
    streaming: bool = False
    ready: dict[int, torch.cuda.Event] = field(default_factory=dict)
    enqueued: threading.Event = field(default_factory=threading.Event)
    # Per stored item, an event after which its copy is in host memory: the write_data stage
    # hashes and writes the first items while the later ones are still being copied.
    copied: dict[int, torch.cuda.Event] = field(default_factory=dict)
    # A streamed snapshot's stored items (sources, file offsets) and the gaps between them.
    items: list[torch.Tensor] = field(default_factory=list)
    item_offsets: list[int] = field(default_factory=list)
    gaps: list[tuple[int, int]] = field(default_factory=list)
    # What the caller's streams wait for before mutating: the copies into the device staging
    # buffer when there is one (else ``events``, the copies into host memory).
    caller_events: list[tuple[torch.device, torch.cuda.Event]] | None = None
    # Copies to the host the pipeline still has to queue (from device staging buffers).
    deferred: list[_HostCopies] = field(default_factory=list)
    # A save started without its host buffer: its CPU items, copied (with their offsets), and
    # the gaps of its data region, all written into the buffer by ``bind``.
    held: list[torch.Tensor] | None = None
    held_offsets: list[int] = field(default_factory=list)

    def bind(self, buffer: torch.Tensor, gaps: Sequence[tuple[int, int]]) -> None:
        """Give a save started without a host buffer its buffer (pipeline side, before
        ``launch_host_copies``): zero the gaps, copy the held CPU items in."""
        for start, end in gaps:
            buffer[start:end].zero_()
        held, self.held = self.held or [], None
        _copy_host(buffer, self.held_offsets, held, list(range(len(held))))
        with self.lock:
            for item in self.deferred:
                item.buffer = buffer

    @property
    def has_device_copies(self) -> bool:
        return bool(self.events) or bool(self.deferred)

    def launch_host_copies(self) -> None:
        """Queue the copies from the staging buffers to the host (pipeline side; idempotent).

        They go on the side stream after the device copies; each device's staging buffer is
        given back once its copies are queued (a later save's device copies queue after them).
        """
        with self.lock:
            deferred, self.deferred = self.deferred, []
        for item in deferred:
            try:
                assert item.buffer is not None, "a deferred save's host buffer is bound first"
                side = side_stream(item.device)
                with torch.cuda.device(item.device), torch.cuda.stream(side):
                    group: list[int] = []
                    group_bytes = 0
                    for i, staged in zip(item.indices, item.staged):
                        _dest(item.buffer, item.offsets[i], staged).copy_(staged,
                                                                          non_blocking=True)
                        group.append(i)
                        group_bytes += staged.numel() * staged.element_size()
                        if group_bytes >= COPY_GROUP_BYTES:
                            _mark_copied(self, group, side)
                            group, group_bytes = [], 0
                    done = torch.cuda.Event()
                    done.record(side)
                self.copied.update(dict.fromkeys(group, done))
                self.events.append((item.device, done))
            finally:
                item.staging.release(item.device)

    def discard_host_copies(self) -> None:
        """Give the staging buffers back without copying (the save failed)."""
        with self.lock:
            deferred, self.deferred = self.deferred, []
        for item in deferred:
            item.staging.release(item.device)

    @property
    def needs_release(self) -> bool:
        """Whether the caller must still call ``wait_snapshot`` before mutating the tensors."""
        return (self.streaming or self.has_device_copies) and not self.released

    def release_by_caller(self, *, block_cpu: bool) -> None:
        """Order the caller's streams after the copies and check that nothing was mutated.

        Called on the training thread (``wait_snapshot``). Any in-place update launched before
        this call is visible in the version counters, so the check is exact here.
        """
        if self.streaming:
            self.enqueued.wait()  # the pieces not yet copied wait for the disk
        with self.lock:
            if self.released:
                return
            waits = self.events if self.caller_events is None else self.caller_events
            for device, event in waits:
                torch.cuda.current_stream(device).wait_event(event)
                if block_cpu:
                    event.synchronize()
            self._check_versions()
            self._finish()

    def release_by_pipeline(self) -> None:
        """Wait for the copies (from a worker thread) and check versions, unless already done.

        Without ``wait_snapshot`` the check here is best effort: an update launched at the very
        moment of the check may be missed. The protocol (``wait_snapshot`` before the update)
        makes it exact.
        """
        if self.streaming:
            self.enqueued.wait()
        self.launch_host_copies()
        for _device, event in self.events:
            event.synchronize()
        with self.lock:
            if self.released:
                return
            self._check_versions()
            self._finish()

    def _check_versions(self) -> None:
        changed = [p for p, t, v in zip(self.source_paths, self.sources, self.versions)
                   if t._version != v]
        if changed:
            shown = ", ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
            self.torn = SnapshotTornError(
                f"{len(changed)} tensor(s) were modified in place while their snapshot copy "
                f"could still be running ({shown}); this save was not written",
                step=self.step, rank=self.rank, path=changed[0],
                hint="call wait_snapshot() before optimizer.step() or any other in-place "
                     "update, or use snapshot_mode='ordered'")

    def _finish(self) -> None:
        self.released = True
        self.sources = []
        self.items = []


def take_snapshot(
    tensors: Sequence[torch.Tensor],
    paths: Sequence[str],
    sources: Sequence[torch.Tensor],
    offsets: Sequence[int],
    gaps: Sequence[tuple[int, int]],
    buffer: torch.Tensor | None,
    *,
    step: int,
    rank: int,
    ordered: bool,
    staging: DeviceStaging | None = None,
) -> Snapshot:
    """Copy every stored item (``sources``, see ``item_sources``) into ``buffer`` at its
    offset, and zero the ``gaps`` between them; CUDA copies run asynchronously.

    ``tensors`` are the state's tensors: the version counters of those on a GPU are recorded,
    to catch an update in place while a copy may still run. With ``staging``, CUDA items are
    only copied into the device's staging buffer here (the caller waits for that alone); the
    pipeline queues the copies to the host later (``Snapshot.launch_host_copies``), off the
    training thread.

    ``buffer=None`` (with ``staging``): the host buffer is bound later (``Snapshot.bind``);
    CPU items are copied now into memory the snapshot holds. NoStagingError when a device's
    staging buffer cannot be had: the caller then needs a host buffer now.
    """
    snap = Snapshot(step, rank)
    if buffer is not None:
        for start, end in gaps:
            buffer[start:end].zero_()
    by_device: dict[int, list[int]] = {}
    host: list[int] = []
    for k, src in enumerate(sources):
        if src.is_cuda:
            by_device.setdefault(src.get_device(), []).append(k)
        else:
            host.append(k)
    if buffer is not None:
        _copy_host(buffer, offsets, sources, host)
    else:
        snap.held = [sources[k].clone() for k in host]
        snap.held_offsets = [offsets[k] for k in host]
    for t, path in zip(tensors, paths):
        if t.is_cuda:
            snap.sources.append(t)
            snap.versions.append(t._version)
            snap.source_paths.append(path)
    waits: list[tuple[torch.device, torch.cuda.Event]] = []
    try:
        for device_index, indices in by_device.items():
            device = torch.device("cuda", device_index)
            caller = torch.cuda.current_stream(device)
            side = side_stream(device)
            ready = torch.cuda.Event()
            ready.record(caller)
            side.wait_event(ready)
            on_device = [sources[k] for k in indices]
            stage = None
            if staging is not None:
                stage_offsets, stage_bytes = _staging_layout(on_device)
                stage = staging.acquire(device, max(stage_bytes, 1))
            if stage is None and buffer is None:
                raise NoStagingError(f"no staging buffer on {device}")
            if stage is not None:
                assert staging is not None
                staged = [_dest(stage, offset, t) for offset, t in zip(stage_offsets, on_device)]
                snap.deferred.append(_HostCopies(device, indices, staged, buffer, offsets,
                                                 staging))
                with torch.cuda.stream(side):
                    _copy_all(staged, on_device)
                    wait = torch.cuda.Event()
                    wait.record(side)
            else:
                assert buffer is not None
                with torch.cuda.stream(side):
                    group: list[int] = []
                    group_bytes = 0
                    for k, t in zip(indices, on_device):
                        group.append(k)
                        group_bytes += t.numel() * t.element_size()
                        if group_bytes >= COPY_GROUP_BYTES:
                            _copy_all([_dest(buffer, offsets[j], sources[j]) for j in group],
                                      [sources[j] for j in group])
                            _mark_copied(snap, group, side)
                            group, group_bytes = [], 0
                    _copy_all([_dest(buffer, offsets[j], sources[j]) for j in group],
                              [sources[j] for j in group])
                    wait = torch.cuda.Event()
                    wait.record(side)
                snap.copied.update(dict.fromkeys(group, wait))
                snap.events.append((device, wait))
            waits.append((device, wait))
            if ordered:
                caller.wait_event(wait)
    except BaseException:
        snap.discard_host_copies()
        raise
    if snap.deferred:
        snap.caller_events = waits
    if ordered or not waits:
        snap.released = True
        snap.sources = []
    return snap


def _copy_host(buffer: torch.Tensor, offsets: Sequence[int], sources: Sequence[torch.Tensor],
               host: list[int]) -> None:
    """Copy CPU items into the buffer: each run of adjacent items of one dtype with one
    ``torch.cat`` (one C++ loop, no per-item view), anything else one by one."""
    run: list[torch.Tensor] = []
    start = end = 0
    dtype: torch.dtype | None = None

    def flush() -> None:
        if run:
            torch.cat(run, out=buffer[start:end].view(run[0].dtype))

    for k in host:
        src = sources[k]  # (cat writes a conjugate or negative view's values, as copy_ does)
        offset = offsets[k]
        if run and (src.dtype != dtype or offset != end):
            flush()
            run = []
        if not run:
            start, dtype = offset, src.dtype
        run.append(src if src.dim() == 1 else src.reshape(-1))
        end = offset + src.numel() * src.element_size()
    flush()


def _copy_all(dests: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Asynchronous copies in one call where torch offers it (one multi-tensor launch between
    devices' memory; one C++ loop to pinned host memory), else one by one."""
    if not dests:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        try:
            foreach(dests, sources, non_blocking=True)
            return
        except (RuntimeError, TypeError):
            pass
    for dest, source in zip(dests, sources):
        dest.copy_(source, non_blocking=True)


COPY_GROUP_BYTES = 256 << 20
"""Bytes of device copies between two progress events (writes start after the first)."""


def _mark_copied(snap: Snapshot, group: list[int], stream: torch.cuda.Stream) -> None:
    event = torch.cuda.Event()
    event.record(stream)
    snap.copied.update(dict.fromkeys(group, event))


def _dest(buffer: torch.Tensor, offset: int, t: torch.Tensor) -> torch.Tensor:
    nbytes = t.numel() * t.element_size()
    return buffer[offset:offset + nbytes].view(t.dtype).view(t.shape)
