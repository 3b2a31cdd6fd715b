"""``cp.load``: a checkpoint read without live objects, for inspection, export and inference.

Reads one rank's committed files of a step (the newest by default) from a local root, verifies
every byte (commit record, manifest, header, every checksummed range of the data) and returns
the saved structure as nested dicts and lists of tensors and plain values: what ``state_dict()``
gave at save time. A rank whose own files are missing or do not verify is read from a copy
another rank holds of them (``replicas=``), when the root has one. Nothing is written into the
root and no RNG state is touched; the RNG states the checkpoint holds are in ``train_state``.

``root`` may also be the URL of a persistent tier (``s3://bucket/run``, ``file://PATH`` of a
shared directory, another fsspec protocol; ``options`` as ``PersistentConfig.options``): only
complete steps (those with a commit object) are loaded. Each rank's files are downloaded into a
temporary directory (under ``TMPDIR``), every part checked against the commit object, while
the load reads them, and removed afterwards; nothing under the URL is written.

With ``consolidate=True`` every rank's shard of the step is read and the DTensor shards are
assembled into full tensors: a reshard to one rank, planned by ``_reshard`` (the mesh taken to
be the ranks in order, laid out row-major, as ``init_device_mesh`` builds it; each sharded
dimension split as DTensor splits it, several mesh dimensions sharding one tensor dimension
included; a replicated shard is copied from one rank).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import os
import tempfile
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import torch

from ._format.documents import TensorRef
from ._format.filesets import rank_sets
from ._format.header import DistLayout
from ._format.names import step_dir_name
from ._format.scan import StepStatus, decode_contents
from ._format.steps import committed_steps
from ._reshard.boxes import Box, saved_box
from ._reshard.plan import ReshardError, SavedBoxes, plan_box
from ._restore.read import read_shard
from ._restore.root_source import RootFiles
from ._threads import in_thread
from ._tiers.base import LocatedShard, ShardSources, SourceFailure
from ._tiers.persistent.layout import StepRecord
from ._tiers.persistent.remote import Remote
from ._tiers.persistent.urls import is_url
from ._tree import materialize
from .errors import CheckpointError, CheckpointIntegrityError, ConfigError
from .storage import LocalStorage, Storage
from .train_state import TrainState

__all__ = ("LoadedCheckpoint", "load", "newest_candidates", "pick_step", "tier_step")

_THREADS = 8
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """One step of a checkpoint, read and verified (see ``load``).

    ``tree``: the saved structure, tensors on ``map_location``; ``train_state``: the TrainState
    saved with it (step, samples, RNG states, ``extra``); ``rank``: whose shard this is (None
    when consolidated); ``world_size``: how many ranks saved the step; ``path``: the step's
    directory; ``bytes``: the data bytes read; ``copies``: the ranks whose shard was read from
    a copy (their own files missing or damaged), each with the rank holding that copy.
    """

    step: int
    rank: int | None
    world_size: int
    save_id: str
    path: str
    tree: dict[str, Any]
    train_state: TrainState
    bytes: int
    copies: Mapping[int, int] = dataclasses.field(default_factory=dict)


def load(root: str | os.PathLike[str], step: int | None = None, *, rank: int = 0,
         map_location: str | torch.device = "cpu", consolidate: bool = False,
         options: Mapping[str, Any] | None = None) -> LoadedCheckpoint:
    """Read ``rank``'s shard of ``step`` (None: the newest step committed by that rank) from
    the local root ``root``, every byte verified, into ``map_location``.

    ``root`` may be a persistent tier's URL (``options``: its store's settings, as
    ``PersistentConfig.options``); its complete steps are downloaded to a temporary directory while
    they are read. ``consolidate=True`` reads every rank's shard and assembles DTensor shards
    into full tensors (``rank`` is then ignored). Raises CheckpointError naming the step and
    path when the step does not exist, is incomplete, or does not verify; the root is never
    changed.
    """
    device = torch.device(map_location)
    if type(rank) is not int or rank < 0:
        raise CheckpointError(f"rank={rank!r}: give a rank number (0, 1, ...)", path=str(root))
    if isinstance(root, str) and is_url(root):
        remote: LoadedCheckpoint = _run(_load_remote(root, options, step, rank, device,
                                                     consolidate))
        return remote
    if options is not None:
        raise ConfigError(f"options= applies to a persistent tier's URL, not to the local "
                          f"root {os.fspath(root)}", path=os.fspath(root),
                          hint="leave options out, or name the tier by URL (file://PATH)")
    storage = LocalStorage(root)
    if not os.path.isdir(storage.root):
        raise CheckpointError(f"{storage.root} is not a checkpoint root (no such directory)",
                              path=str(storage.root), hint="pass the directory given as root")
    loaded: LoadedCheckpoint = _run(_load_local(storage, step, rank, device, consolidate))
    return loaded


def _run(coro: Any) -> Any:
    """Run ``coro`` on an event loop of its own (in a thread when one runs on this one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.run(lambda: coro)
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = anyio.run(lambda: coro)
        except BaseException as exc:  # re-raised in the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=target, name="ckpt-load")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def pick_step(steps: Mapping[int, _T], step: int | None, rank: int | None,
              root: str) -> tuple[int, _T]:
    """``(step, value)`` out of ``steps`` (``committed_steps``, or a tier's complete steps
    when ``rank`` is None): ``step``, or the newest when None; CheckpointError naming the root
    (and what is there) when there is none."""
    whose = "committed step" if rank is None else f"committed step of rank {rank}"
    if not steps:
        raise CheckpointError(f"no {whose} under {root}", rank=rank, path=root,
                              hint="check the root (ckpt-pipeline ls ROOT)")
    if step is None:
        step = max(steps)
    elif step not in steps:
        listed = ", ".join(str(s) for s in sorted(steps, reverse=True)[:20])
        by = "" if rank is None else f" by rank {rank}"
        raise CheckpointError(f"step {step} is not committed{by} under {root} "
                              f"(committed: {listed})", step=step, rank=rank, path=root,
                              hint="pick one of the committed steps (ckpt-pipeline ls ROOT)")
    return step, steps[step]


def newest_candidates(storage: Storage, rank: int, *, copies: bool = True) -> dict[int, str]:
    """``committed_steps`` less the steps a rewind abandoned (recorded in the root, or by
    the lineage of a newer timeline's step there): where "the newest" is picked from.
    Worker thread."""
    from ._lineage import current_steps

    return current_steps(storage, rank, committed_steps(storage, rank, copies=copies))


def tier_step(remote: Remote, step: int | None, rank: int | None) -> StepRecord:
    """The commit object of a persistent tier's complete ``step`` (None: the newest), checked
    to have a rank ``rank`` (None: not checked); CheckpointError naming what is there
    otherwise. Worker thread."""
    from ._tiers.persistent.promote import complete_steps
    from ._tiers.persistent.rewinds import current_records, read_tier_rewinds, tier_marks

    records = complete_steps(remote)
    if step is None:  # the newest of the current timeline, never an abandoned one
        records = current_records(records, tier_marks(records, read_tier_rewinds(remote)))
    step, record = pick_step(records, step, None, remote.url)
    if rank is not None and rank >= record.world_size:
        raise CheckpointError(f"step {step} was saved by {record.world_size} rank(s); there "
                              f"is no rank {rank}", step=step, rank=rank,
                              path=f"{remote.url}/{step_dir_name(step)}")
    return record


_Reader = Callable[[int], Awaitable[tuple["LoadedCheckpoint", "_Parts"]]]


async def _load_local(storage: LocalStorage, step: int | None, rank: int,
                      device: torch.device, consolidate: bool) -> LoadedCheckpoint:
    limiter = anyio.CapacityLimiter(_THREADS)
    steps = await in_thread(limiter, functools.partial(
        newest_candidates if step is None else committed_steps, storage, rank,
        copies=True))
    step, dir_name = pick_step(steps, step, rank, str(storage.root))

    async def read(r: int) -> tuple[LoadedCheckpoint, _Parts]:
        return await _read_rank(storage, step, dir_name, r, device, limiter)

    return await _gather(read, rank, consolidate, step)


async def _load_remote(url: str, options: Mapping[str, Any] | None, step: int | None,
                       rank: int, device: torch.device, consolidate: bool
                       ) -> LoadedCheckpoint:
    """``load`` of a persistent tier's step: each rank's files stream into a temporary
    directory (``ShardStream``) while they are read, and are removed afterwards."""
    from ._tiers.persistent.source import TierDownload
    from ._tiers.persistent.stream import ShardStream
    from ._tiers.persistent.urls import open_remote

    limiter = anyio.CapacityLimiter(_THREADS)
    remote = await in_thread(limiter, functools.partial(
        open_remote, url, options=options, retries=2))
    try:
        record = await in_thread(limiter, tier_step, remote, step,
                                 None if consolidate else rank)
        step = record.step
        where = f"{remote.url}/{step_dir_name(step)}"
        with tempfile.TemporaryDirectory(prefix="ckpt-load-") as tmp:
            storage = LocalStorage(tmp)

            async def read(r: int) -> tuple[LoadedCheckpoint, _Parts]:
                async def read_download(shard: LocatedShard) -> tuple[LoadedCheckpoint, _Parts]:
                    return await _read_status(storage, shard.status, r, device, limiter,
                                              shard.shard_file, shard.arrived)

                download = TierDownload(functools.partial(ShardStream, remote, storage,
                                                          record, r), limiter, keep=False)
                (loaded, parts), _ = await ShardSources((download,)).read(read_download)
                return dataclasses.replace(loaded, path=where), parts

            return await _gather(read, rank, consolidate, step)
    finally:
        await in_thread(limiter, remote.close)


async def _gather(read: _Reader, rank: int, consolidate: bool, step: int
                  ) -> LoadedCheckpoint:
    """``rank``'s shard, or with ``consolidate`` every rank's, assembled."""
    own, parts = await read(rank)
    if not consolidate:
        return own
    if own.world_size == 1:
        return dataclasses.replace(own, rank=None)
    loads = [(own, parts) if r == rank else await read(r) for r in range(own.world_size)]
    if len({loaded.save_id for loaded, _ in loads}) != 1:
        raise CheckpointIntegrityError(f"the ranks' files of step {step} come from different "
                                       "saves", step=step, path=own.path)
    tree = _consolidate([p for _, p in loads], step, own.path)
    copies = {r: h for loaded, _ in loads for r, h in loaded.copies.items()}
    return LoadedCheckpoint(step, None, own.world_size, own.save_id, own.path, tree,
                            own.train_state, sum(loaded.bytes for loaded, _ in loads), copies)


@dataclass(frozen=True, slots=True)
class _Parts:
    """A rank's tree as decoded (tensor references) with its tensors and their layouts."""

    tree: Any
    tensors: list[torch.Tensor]
    layouts: list[DistLayout | None]


async def _read_rank(storage: LocalStorage, step: int, dir_name: str, rank: int,
                     device: torch.device, limiter: anyio.CapacityLimiter
                     ) -> tuple[LoadedCheckpoint, _Parts]:
    """``rank``'s shard of ``step``: its own files, else the first copy that verifies."""
    names = await in_thread(limiter, lambda: {e.name for e in storage.list_dir(dir_name)})
    places = tuple(RootFiles(storage, files, step, dir_name, limiter, names=names)
                   for files in rank_sets(names, rank))

    async def read(shard: LocatedShard) -> tuple[LoadedCheckpoint, _Parts]:
        return await _read_status(storage, shard.status, rank, device, limiter)

    def exhausted(failures: Sequence[SourceFailure]) -> CheckpointError:
        return CheckpointIntegrityError(
            f"step {step} of rank {rank} does not verify: "
            f"{'; '.join(map(_failure_text, failures))}", step=step, rank=rank,
            path=os.path.join(storage.root, dir_name),
            hint="load another step (ckpt-pipeline ls ROOT)")

    (loaded, parts), shard = await ShardSources(places, exhausted=exhausted).read(read)
    if shard.holder is not None:
        loaded = dataclasses.replace(loaded, copies={rank: shard.holder})
    return loaded, parts


def _failure_text(failure: SourceFailure) -> str:
    """One file set's failure in ``_read_rank``'s error: the scan's reason (it names a copy's
    holder itself), or the shard file and holder with the read's error."""
    source, message = failure.source, failure.error.message
    if not failure.read or not isinstance(source, RootFiles):
        return message
    held = "" if source.files.holder is None else f" (copy held by rank {source.files.holder})"
    return f"{source.files.shard}{held}: {message}"


async def _read_status(storage: LocalStorage, status: StepStatus, rank: int,
                       device: torch.device, limiter: anyio.CapacityLimiter,
                       shard_file: str | None = None,
                       arrived: Callable[[int, int], None] | None = None
                       ) -> tuple[LoadedCheckpoint, _Parts]:
    """Read and decode the files ``status`` validated (a download: ``shard_file`` arriving,
    ``arrived`` waiting for its bytes)."""
    header = status.header
    assert header is not None
    shard = await read_shard(storage, status, rank, devices=[device] * len(header.tensors),
                             threads=_THREADS, limiter=limiter, shard_file=shard_file,
                             arrived=arrived)
    tree, train_state = decode_contents(status, rank)
    loaded = LoadedCheckpoint(status.step, rank, status.world_size or 1, status.save_id or "",
                              status.path, materialize(tree, shard.tensors), train_state,
                              status.data_bytes)
    return loaded, _Parts(tree, shard.tensors, [rec.dist for rec in header.tensors])


# ------------------------------------------------------------------------- consolidation


def _consolidate(ranks: list[_Parts], step: int, where: str) -> dict[str, Any]:
    """Every rank's tree, walked together: a DTensor shard becomes the full tensor; anything
    else is rank 0's (plain values and replicated tensors are the same on every rank)."""

    def merge(path: str, nodes: list[Any]) -> Any:
        first = nodes[0]
        if isinstance(first, TensorRef):
            if not all(isinstance(n, TensorRef) for n in nodes):
                raise CheckpointIntegrityError(f"{path}: the ranks saved different structures",
                                               step=step, path=where)
            tensors = [r.tensors[n.index] for r, n in zip(ranks, nodes)]
            layouts = [r.layouts[n.index] for r, n in zip(ranks, nodes)]
            if layouts[0] is None:
                return tensors[0]
            return _assemble(path, tensors, layouts, step, where)
        if isinstance(first, dict):
            if not all(isinstance(n, dict) and n.keys() == first.keys() for n in nodes):
                raise CheckpointIntegrityError(f"{path or 'the state'}: the ranks saved "
                                               "different structures", step=step, path=where)
            return {k: merge(f"{path}.{k}" if path else str(k), [n[k] for n in nodes])
                    for k in first}
        if isinstance(first, (list, tuple)):
            if not all(isinstance(n, (list, tuple)) and len(n) == len(first) for n in nodes):
                raise CheckpointIntegrityError(f"{path}: the ranks saved different structures",
                                               step=step, path=where)
            items = [merge(f"{path}.{i}", [n[i] for n in nodes]) for i in range(len(first))]
            return items if isinstance(first, list) else tuple(items)
        return first

    merged: dict[str, Any] = merge("", [r.tree for r in ranks])
    return merged


def _assemble(path: str, parts: list[torch.Tensor], layouts: list[DistLayout | None],
              step: int, where: str) -> torch.Tensor:
    """The full tensor from every rank's shard: a reshard to one rank (``_reshard``), each
    element copied once, from one rank where the shards replicate it."""
    layout = layouts[0]
    assert layout is not None
    world = len(parts)
    if math.prod(layout.mesh_shape) != world or any(lay != layout for lay in layouts):
        raise CheckpointError(
            f"{path}: a DTensor on a mesh of {list(layout.mesh_shape)} cannot be assembled from "
            f"{world} ranks' shards", step=step, path=where,
            hint="load each rank with rank=R and assemble the shards yourself")
    boxes = [saved_box(layout, rank) for rank in range(world)]
    for rank, (part, box) in enumerate(zip(parts, boxes)):  # before anything is allocated
        whole = part.numel() * part.element_size()
        if whole > part.untyped_storage().nbytes():
            raise CheckpointIntegrityError(
                f"{path}: rank {rank}'s shard is a view of {whole} bytes over "
                f"{part.untyped_storage().nbytes()} stored bytes (stride "
                f"{list(part.stride())}): assembling it would allocate memory the checkpoint "
                "does not hold", step=step, path=where)
        if box.sizes != tuple(part.shape):
            raise CheckpointIntegrityError(
                f"{path}: rank {rank}'s shard has shape {list(part.shape)}, its place in the "
                f"full tensor of {list(layout.global_shape)} {list(box.sizes)}", step=step,
                path=where)
    full_box = Box.full(layout.global_shape)
    try:
        pieces = plan_box(SavedBoxes(path, layout.global_shape, enumerate(boxes)), full_box)
    except ReshardError as exc:
        exc.step = step
        raise
    full = torch.empty(layout.global_shape, dtype=parts[0].dtype, device=parts[0].device)
    for piece in pieces:
        full[piece.region.index()].copy_(parts[piece.source][
            piece.region.relative_to(piece.saved).index()])
    return full
