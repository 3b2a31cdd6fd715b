"""Restoring a step saved by another number of ranks: each rank reads, from every saved rank's
shard, only the boxes its live tensors need (planned by ``_reshard``), in a root that holds
every saved rank's files (one root the ranks share; a saved rank's files count under their own
names or as a copy replication left in the root). Node-local roots: the saved ranks' files a
root lacks are read in ranges, only those this rank needs, from the live ranks whose roots hold
them (``PeerSource``, through replication's copy servers: ``PeerShard``) when the live roots
hold the step whole between them, else from the persistent tier (``TierSource``:
``RemoteShard``); nothing is written to the root either way.

- **Which step.** Every live rank scans the saved ranks' files of each step (headers only) and
  keeps the steps complete for all of them, of one save, that no rewind abandoned, adds the
  steps the live roots hold whole between them (each rank tells which saved ranks' files it
  holds) and the persistent tier's complete steps of that world size that its root does not
  hold whole; the saves after the restore go on in the newest timeline the root names. The
  ranks agree on the newest step all of them found, and fall back together to the next when
  any rank's load fails.
- **Tensors.** Each saved tensor's live counterpart says what this rank needs: a live DTensor
  its own box (its mesh, placements and global shape may differ from the saved ones), a plain
  tensor the whole tensor. An optimizer's moments take the layout of their parameter when the
  live optimizer has no state yet. A saved DTensor comes from the saved shards that overlap the
  box, each element read once (a replicated shard from one holder); a saved plain tensor from
  rank 0's shard (plain tensors of a data-parallel job are the same on every rank). Reads are
  byte ranges of the shard files, every checksum block they touch verified
  (``_reshard.ranges``), planned first, then read by ``io_threads`` threads at once, straight
  into the live tensors' memory (on their device), the ranges in flight holding at most
  ``reshard_bytes_in_flight`` bytes in all.
- **Everything else** is rank 0's: the tree's plain values and the TrainState must be the same
  on every saved rank, or the restore is refused (per-rank values cannot be mapped onto other
  ranks silently), unless ``Reshard.exclude`` leaves their entry as it is or
  ``Reshard.per_rank`` says what each rank restores. The RNG states are per rank: by default
  they are not restored (the live ones stay); ``Reshard(rng="rank0")`` restores rank 0's on
  every rank.
- **A placement change at the same world size** (``LayoutChanged``, on meshes of the saved
  shapes) maps rank to rank: each rank takes its own saved plain values, plain tensors and RNG
  states, and reshards the DTensors. A mesh of another shape on as many ranks may move a rank
  in the data-parallel dimension: its per-rank values are handled as on another world size
  (``_same_roles``).
- **Refused before anything is applied.** A layout that cannot be resharded (a gap, a global
  shape that differs) is a ``ReshardError`` on the rank that finds it, and every rank raises;
  the live state is checked (``validate_state``) before the apply, as in every restore.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import anyio
import torch

from .._format.documents import TensorRef
from .._format.header import TensorRecord
from .._format.limits import CHECKSUM_BLOCK_BYTES, DTYPES
from .._format.scan import StepStatus, decode_contents, scan_any_copy
from .._lineage import current_steps, local_timeline
from .._logging import log
from .._parallel import run_groups
from .._reshard.boxes import Box, saved_box
from .._reshard.plan import ReshardError, SavedBoxes, plan_box
from .._reshard.ranges import ShardRanges, Span, group_spans, read_group, spans_of
from .._threads import in_thread
from .._tiers.persistent.layout import StepRecord
from .._tiers.persistent.ranged import RemoteShard
from .._tiers.persistent.remote import Remote
from .._tiers.replica.ranged import PeerShard
from .._tree import (
    MeshNames,
    is_dtensor,
    is_stateful,
    join_path,
    live_meshes,
    mesh_shapes,
    state_dict_of,
    unmatched_meshes,
)
from ..coordination import Coordinator
from ..coordination._agree import agree_outcome, gather_shared
from ..errors import (
    CheckpointError,
    CheckpointIntegrityError,
    ConfigError,
    RestoreError,
    StateError,
)
from ..handle import Reshard
from ..storage import RangeSource, Storage
from ..train_state import TrainState
from .backups import BackupCopies, restored_local
from .inplace import Prewrites, inplace_targets
from .sourcing import Loaded, prefetch_backup
from .validate import validate_state

__all__ = ("OpenSaved", "PeerSource", "TierSource", "reshard_latest")

_log = log


async def reshard_latest(storage: Storage, coordinator: Coordinator, state: Mapping[str, Any],
                         limiter: anyio.CapacityLimiter, *, saved_world: int,
                         step: int | None, started: float, keep_missing: bool,
                         in_flight: int, threads: int, choices: Reshard, rng: bool,
                         tier: TierSource | None = None,
                         peers: PeerSource | None = None) -> Loaded:
    """The newest step saved by ``saved_world`` ranks that every rank can reshard, read for
    this rank and checked against ``state`` (see the module docstring). RestoreError when
    there is none; the ReshardError or StateError of a step that cannot be resharded.
    ``tier``: the persistent tier's complete steps, read where the root lacks a saved rank's
    files. ``peers``: reads a saved rank's shard in ranges from the live rank whose root holds it
    (replication's copy servers), for a step that no root holds whole but all of them
    together do."""
    rank, world = coordinator.rank, coordinator.world_size
    unknown = [name for name in choices.exclude if name not in state]
    if unknown:
        raise ConfigError(f"Reshard(exclude=...) names {unknown}, which the state does not "
                          f"have (its entries: {sorted(map(str, state))})", rank=rank,
                          hint="exclude top-level entries of the state passed to the restore")
    held = await in_thread(limiter, _held_steps, storage, saved_world)
    found = _complete(held, saved_world)
    in_tier = {} if tier is None else tier.steps(saved_world, exclude=found)
    mine = sorted({(s, statuses[0].save_id or "") for s, statuses in found.items()
                   if step is None or s == step}
                  | {(s, record.save_id) for s, record in in_tier.items()
                     if step is None or s == step}, reverse=True)
    holding = [[s, i, sorted(ranks)] for (s, i), ranks in held.items()
               if step is None or s == step]
    answers = await gather_shared(coordinator, {
        "whole": [list(c) for c in mine], "held": holding, "fetch": peers is not None,
        "serves": peers is not None and peers.serves}, what="reshard candidates")
    common = set(mine)
    for answer in answers:
        common &= {(int(s), str(i)) for s, i in (answer or {}).get("whole", [])}
    coverable, fetched = _spread(answers, saved_world, rank)
    common |= coverable
    if not common:
        raise RestoreError(
            f"no step saved by {saved_world} rank(s) is complete in {storage.root} for every "
            f"rank of this job ({world})" + ("" if tier is None else " nor in the persistent "
                                             f"tier {tier.url}")
            + ": resharding reads every saved rank's files"
            + ("" if step is None else f" (asked for step {step})")
            + ("" if peers is None else ", and the live ranks' roots do not hold every saved "
               "rank's files of one step between them"), step=step, rank=rank,
            path=str(storage.root),
            hint=f"restore with {saved_world} ranks, or gather every rank's files of the step "
                 "into one root that every rank reads, or configure the persistent tier that "
                 "the step was promoted to")
    failures: dict[int, str] = {}
    for at, save_id in sorted(common, reverse=True):
        loaded: Loaded | None = None
        error: CheckpointError | None = None
        reading = _Reading(rank, world, started, keep_missing, in_flight, threads, choices,
                           rng)
        try:
            if at in found and (found[at][0].save_id or "") == save_id:
                loaded = await _load([(storage, s) for s in found[at]], state, limiter,
                                     reading, storage)
            elif (at, save_id) in fetched:
                assert peers is not None
                loaded = await _load_from_peers(peers.open, at, save_id,
                                                fetched[at, save_id],
                                                held.get((at, save_id), {}), storage,
                                                saved_world, state, limiter, reading)
            else:
                assert tier is not None
                loaded = await _load_from_tier(tier, in_tier[at], held.get((at, save_id), {}),
                                               storage, state, limiter, reading)
        except CheckpointError as exc:
            error = exc
        fatal = isinstance(error, (ReshardError, StateError))
        try:
            failures, any_fatal = await agree_outcome(
                coordinator, at, save_id, None if error is None else error.message,
                what="reshard load", fatal=fatal)
        except BaseException as exc:
            _put_back(loaded, rank, exc)
            raise
        if not failures and loaded is not None:
            _log.info("ckpt.recovery.resharded", step=at, rank=rank, saved_world=saved_world,
                      world=world, bytes_read=loaded.bytes, restore_rng=loaded.restore_rng,
                      excluded=list(loaded.excluded),
                      read_in_place=0 if loaded.prewrites is None
                      else loaded.prewrites.written_bytes)
            return loaded
        _put_back(loaded, rank)  # another rank failed: the live tensors read into, as they were
        if any_fatal:
            if error is not None:
                raise error
            raise RestoreError(f"step {at} cannot be resharded onto this job: "
                               f"{_listing(failures)}", step=at, rank=rank,
                               hint="see the error on the rank(s) named")
        _log.warning("ckpt.recovery.reshard_failed", step=at, rank=rank,
                     failures={str(r): e for r, e in failures.items()},
                     hint="trying the next older step")
    raise RestoreError(f"no step saved by {saved_world} rank(s) could be resharded: "
                       f"{_listing(failures)}", rank=rank, path=str(storage.root),
                       hint="the saved shards are damaged; check them with ckpt-pipeline "
                            "verify")


def _put_back(loaded: Loaded | None, rank: int, why: BaseException | None = None) -> None:
    """Undo the reads straight into live tensors of a load that is not applied."""
    if loaded is not None and loaded.prewrites is not None:
        prewrites, loaded.prewrites = loaded.prewrites, None
        _undo(prewrites, loaded.step, rank, why)


def _undo(prewrites: Prewrites, step: int, rank: int, why: BaseException | None) -> None:
    """Put back the live tensors read straight into, and say so when there were any."""
    written = prewrites.written_bytes
    prewrites.undo(step=step, rank=rank)
    if written:
        _log.info("ckpt.recovery.reshard_put_back", step=step, rank=rank, bytes=written,
                  why="another rank's load failed" if why is None
                  else f"{type(why).__name__}: {why}",
                  hint="the live tensors read into are as they were before the restore")


def _listing(failures: Mapping[int, str]) -> str:
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))


def _held_steps(storage: Storage, saved_world: int
                ) -> dict[tuple[int, str], dict[int, StepStatus]]:
    """{(step, save id): {saved rank: its valid files}} of the steps of ``saved_world``
    ranks that no rewind abandoned (as the newest step of a restore at the same world size is
    picked), whole or not. A saved rank's files are its own, else a copy of them that
    replication left in the root (node-local roots: a node holds the copies of another
    node's ranks). Worker thread."""
    out: dict[tuple[int, str], dict[int, StepStatus]] = {}
    for r in range(saved_world):
        valid = {s.step: s for s in scan_any_copy(storage, r)
                 if s.valid and s.world_size == saved_world}
        for at in current_steps(storage, r, {at: s.dir_name for at, s in valid.items()}):
            out.setdefault((at, valid[at].save_id or ""), {})[r] = valid[at]
    return out


def _complete(held: Mapping[tuple[int, str], Mapping[int, StepStatus]], saved_world: int
              ) -> dict[int, list[StepStatus]]:
    """{step: every saved rank's files, in rank order} of the steps ``held`` whole, of one
    save."""
    return {at: [ranks[r] for r in range(saved_world)]
            for (at, _), ranks in sorted(held.items())
            if len(ranks) == saved_world}


def _spread(answers: Sequence[Any], saved_world: int, rank: int
             ) -> tuple[set[tuple[int, str]], dict[tuple[int, str], dict[int, tuple[int, ...]]]]:
    """The (step, save id) that the live ranks' roots hold whole between them, when every
    rank can fetch (the candidates' ``answers``; the same on every rank); and for each, what
    this rank lacks: {saved rank: live ranks to fetch it from, the first to try first}. The
    live ranks holding a saved rank take the fetches in turn (by the fetching rank), so that
    no one of them serves every rank; a rank that runs no copy server holds only for
    itself."""
    holders: dict[tuple[int, str], dict[int, list[int]]] = {}
    for live, answer in enumerate(answers):
        answer = answer or {}
        if not answer.get("fetch"):
            return set(), {}  # a rank that cannot fetch: no step is had this way
        if live != rank and not answer.get("serves"):
            continue  # its root cannot be fetched from
        for s, i, ranks in answer.get("held", []):
            for r in ranks:
                holders.setdefault((int(s), str(i)), {}).setdefault(int(r), []).append(live)
    own = {(int(s), str(i)): {int(r) for r in ranks}
           for s, i, ranks in (answers[rank] or {}).get("held", [])}
    coverable: set[tuple[int, str]] = set()
    out: dict[tuple[int, str], dict[int, tuple[int, ...]]] = {}
    for key, by_saved in holders.items():
        if len(by_saved) != saved_world:
            continue  # not whole even between all the roots
        coverable.add(key)
        lacking = {}
        for r, lives in by_saved.items():
            if r in own.get(key, set()):
                continue
            others = sorted(live for live in lives if live != rank)
            start = rank % len(others)
            lacking[r] = tuple(others[start:] + others[:start])
        if lacking:
            out[key] = lacking
    return coverable, out


@dataclass(frozen=True, slots=True)
class _Reading:
    """How this rank reads a step for a reshard: who it is, and the caller's choices."""

    rank: int
    world: int
    started: float
    keep_missing: bool
    in_flight: int
    threads: int
    choices: Reshard
    rng: bool
    """The restore's ``restore_rng``."""


@dataclass(slots=True)
class _Plan:
    """What one step's reshard reads on this rank, and what it becomes."""

    step: int
    tree: Any
    train_state: TrainState
    restore_rng: bool
    excluded: tuple[str, ...]
    shards: list[ShardRanges]
    tensors: list[torch.Tensor]
    spans: list[Span]


async def _load(sources: Sequence[tuple[RangeSource, StepStatus]], state: Mapping[str, Any],
                limiter: anyio.CapacityLimiter, reading: _Reading, root: Storage,
                timeline: int = 0) -> Loaded:
    """This rank's tensors of one step, resharded (planned, then read by ``threads`` threads
    at once), and checked against the live state. ``sources``: each saved rank's files (the
    storage that holds them, their status); ``root``: this rank's root."""
    statuses = [status for _, status in sources]
    shards: list[ShardRanges] = []
    copies = BackupCopies()  # the rollback backup, copied while the shards are read
    prefetch: threading.Thread | None = None
    prewrites = Prewrites()  # live tensors read straight into (``inplace.py``)
    try:
        try:
            plan = await in_thread(limiter, _plan, sources, state, reading, shards, prewrites)
            prefetch = threading.Thread(target=prefetch_backup,
                                        args=(copies, state, reading.rank, {}),
                                        name="ckpt-restore-backup", daemon=True)
            prefetch.start()
            await run_groups(functools.partial(read_group, shards),
                             group_spans(shards, plan.spans, reading.threads), limiter)
        finally:
            if prefetch is not None:
                await in_thread(None, prefetch.join, abandon_on_cancel=True)
            await in_thread(limiter, _close, shards)
        live = {k: v for k, v in state.items() if k not in plan.excluded}
        left_out, kept = await in_thread(limiter, functools.partial(
            validate_state, live, plan.tree, plan.tensors, step=plan.step, rank=reading.rank,
            keep_missing=reading.keep_missing))
    except BaseException as exc:
        _undo(prewrites, statuses[0].step, reading.rank, exc)
        raise
    return Loaded(step=plan.step, save_id=statuses[0].save_id or "", path=statuses[0].path,
                  tree=plan.tree, tensors=plan.tensors, train_state=plan.train_state,
                  bytes=sum(r.bytes_read for r in shards), started=reading.started,
                  rejected=(), valid_by_rank={}, restore_rng=plan.restore_rng, copies=copies,
                  not_restored=left_out, not_in_checkpoint=kept, excluded=plan.excluded,
                  resharded_from=len(statuses), prewrites=prewrites if len(prewrites) else None,
                  timeline=max(timeline, *(local_timeline(root, r)
                                           for r in range(len(statuses)))))


@dataclass(frozen=True, slots=True)
class TierSource:
    """The persistent tier as the source of a reshard: the complete steps this rank listed
    there (``Agreement.persisted``) and the store to download saved ranks' files from."""

    url: str
    remote: Remote
    records: Mapping[int, StepRecord]

    def steps(self, saved_world: int, *, exclude: Mapping[int, Any]) -> dict[int, StepRecord]:
        """The tier's steps of ``saved_world`` ranks, but those in ``exclude``."""
        return {at: r for at, r in self.records.items()
                if r.world_size == saved_world and at not in exclude}


async def _load_from_tier(tier: TierSource, record: StepRecord,
                          local: Mapping[int, StepStatus], root: Storage,
                          state: Mapping[str, Any], limiter: anyio.CapacityLimiter,
                          reading: _Reading) -> Loaded:
    """A step that the root does not hold whole: each saved rank's files that the root lacks
    (``local``: those it holds of this save) are read from the persistent tier in ranges
    (``RemoteShard``): the header, then only the ranges this rank needs, each verified by its
    checksum blocks. Nothing is downloaded into the root: the step stays only in the tier."""
    sources: list[tuple[RangeSource, StepStatus]] = []
    remote: dict[int, RemoteShard] = {}
    for r in range(record.world_size):
        if r in local:
            sources.append((root, local[r]))
            continue
        shard = remote[r] = await in_thread(limiter, RemoteShard, tier.remote, record, r)
        sources.append((shard, await in_thread(limiter, shard.status)))
    _log.info("ckpt.recovery.reshard_from_tier", step=record.step, rank=reading.rank,
              url=tier.url, saved_ranks=sorted(remote),
              hint="the root lacks these saved ranks' files: the ranges needed are read from "
                   "the persistent tier")
    loaded = await _load(sources, state, limiter, reading, root,
                         timeline=record.lineage.timeline if record.lineage else 0)
    _log.info("ckpt.recovery.reshard_tier_read", step=record.step, rank=reading.rank,
              url=tier.url, bytes={str(r): shard.bytes for r, shard in sorted(remote.items())},
              sizes={str(r): shard.size for r, shard in sorted(remote.items())})
    return loaded


OpenSaved = Callable[[int, int, str, int, int], PeerShard]
"""``open(holder, step, save_id, source, saved_world) -> PeerShard``:
``Replication.open_saved`` (worker thread)."""


@dataclass(frozen=True, slots=True)
class PeerSource:
    """The live ranks' roots as the source of a reshard, through replication's copy
    servers: ``open`` a saved rank's shard in a live rank's root for range reads;
    ``serves``: whether this rank runs a copy server (only then do the others read from
    it)."""

    open: OpenSaved
    serves: bool


async def _load_from_peers(open_saved: OpenSaved, step: int, save_id: str,
                           lacking: Mapping[int, tuple[int, ...]],
                           local: Mapping[int, StepStatus], root: Storage, saved_world: int,
                           state: Mapping[str, Any], limiter: anyio.CapacityLimiter,
                           reading: _Reading) -> Loaded:
    """A step that this rank's root does not hold whole, but the live ranks' roots do between
    them: each saved rank's shard the root lacks (``lacking``: {saved rank: live ranks that
    hold it}) is read from a live rank's copy server in ranges, only those this rank needs
    (``PeerShard``: its header checked against its manifest, each range by its checksum
    blocks), the holders tried in turn until one serves it. Nothing is written to the root."""
    _log.info("ckpt.recovery.reshard_from_peers", step=step, rank=reading.rank,
              saved_ranks=sorted(lacking), holders={str(r): list(h)
                                                    for r, h in sorted(lacking.items())},
              hint="this root lacks these saved ranks' files: the ranges needed are read from "
                   "the live ranks whose roots hold them")
    opened: dict[int, tuple[PeerShard, StepStatus]] = {}
    errors: dict[int, str] = {}

    async def one(source: int, holders: tuple[int, ...]) -> None:
        for holder in holders:
            shard: PeerShard | None = None
            try:
                shard = await in_thread(limiter, open_saved, holder, step, save_id, source,
                                        saved_world)
                status = await in_thread(limiter, shard.status)
            except CheckpointError as exc:
                if shard is not None:
                    shard.close(0)
                errors[source] = f"from rank {holder}: {exc.message}"
                continue
            opened[source] = (shard, status)
            errors.pop(source, None)
            return

    try:
        async with anyio.create_task_group() as group:
            for source, holders in sorted(lacking.items()):
                group.start_soon(one, source, holders)
        if errors:
            raise CheckpointIntegrityError(
                "saved rank(s) " + "; ".join(f"{r} ({e})" for r, e in sorted(errors.items()))
                + " could not be read for the reshard", step=step, rank=reading.rank,
                path=str(root.root))
        sources: list[tuple[RangeSource, StepStatus]] = [
            (root, local[r]) if r in local else opened[r] for r in range(saved_world)]
        timeline = max((s.lineage.timeline for _, s in sources if s.lineage), default=0)
        loaded = await _load(sources, state, limiter, reading, root, timeline=timeline)
    finally:
        for shard, _ in opened.values():
            shard.close(0)
    _log.info("ckpt.recovery.reshard_peer_read", step=step, rank=reading.rank,
              bytes={str(r): shard.bytes for r, (shard, _) in sorted(opened.items())},
              sizes={str(r): shard.size for r, (shard, _) in sorted(opened.items())},
              peers={str(r): shard.peer.rank for r, (shard, _) in sorted(opened.items())})
    return loaded


def _close(shards: Sequence[ShardRanges]) -> None:
    for shard in shards:
        shard.close()


def _plan(sources: Sequence[tuple[RangeSource, StepStatus]], state: Mapping[str, Any],
          reading: _Reading, shards: list[ShardRanges],
          prewrites: Prewrites) -> _Plan:
    """Decode every saved rank's tree, choose the values this rank restores, open the shards
    (into ``shards``, which the caller closes) and plan the spans to read, straight into the
    live tensors where ``inplace_targets`` allows it (into ``prewrites``). Worker thread."""
    rank, choices = reading.rank, reading.choices
    statuses = [status for _, status in sources]
    contents = [decode_contents(s, r) for r, s in enumerate(statuses)]
    step = statuses[0].step
    excluded = tuple(choices.exclude)  # every one a key of the live state (reshard_latest)
    live = {k: v for k, v in state.items() if k not in choices.exclude}
    own = rank if _same_roles(statuses, live, reading.world) else None
    trees = [{k: v for k, v in tree.items() if k not in choices.exclude}
             for tree, _ in contents]
    if own is None:
        tree, train_state = _per_rank_values(trees, [ts for _, ts in contents], choices,
                                             step, rank)
        restore_rng = reading.rng and choices.rng == "rank0"
    else:
        tree, train_state = trees[own], contents[own][1]
        restore_rng = reading.rng
    wanted = _refs(tree)
    targets = live_targets(state, tree)
    inplace = inplace_targets(live, tree)
    for r, (holder, status) in enumerate(sources):
        shards.append(ShardRanges(holder, status, r))
    coarse = max(shard.block for shard in shards)
    if coarse > CHECKSUM_BLOCK_BYTES:
        _log.info("ckpt.recovery.reshard_coarse_checksums", step=step, rank=rank,
                  block_bytes=coarse,
                  hint=f"these shards were checksummed in blocks of {coarse} bytes (an older "
                       "writer, or format 1): each range read reads and verifies whole "
                       "blocks, up to that much beyond each end of the range")
    plain_from = 0 if own is None else own
    bound = max(coarse, reading.in_flight // max(1, reading.threads))
    planned: list[Span] = []
    tensors = [_tensor(index, record, targets.get(index), shards, rank, step, plain_from,
                       bound, planned, inplace.get(index), prewrites)
               if index in wanted else torch.empty(0)
               for index, record in enumerate(shards[plain_from].header.tensors)]
    return _Plan(step, tree, train_state, restore_rng, excluded, shards, tensors, planned)


def _refs(node: Any) -> set[int]:
    """The tensor indices a decoded tree refers to."""
    if isinstance(node, TensorRef):
        return {node.index}
    if isinstance(node, dict):
        return set().union(*map(_refs, node.values())) if node else set()
    if isinstance(node, (list, tuple)):
        return set().union(*map(_refs, node)) if node else set()
    return set()


def _same_roles(statuses: Sequence[StepStatus], live: Mapping[str, Any], world: int) -> bool:
    """Whether each live rank plays the part of the saved rank of its number, so that it may
    restore that rank's per-rank values and RNG states: the same number of ranks, and the
    live DTensors on the meshes the saved ones were on: the same shapes, and the same
    dimension names where both sides name them (the headers record them; older ones only
    the shapes, and then the shapes decide). A mesh of another shape at the same world size
    (FSDP over 4 ranks to FSDP 2 x TP 2), or with its dimensions named otherwise (("dp",
    "tp") to ("tp", "dp")), changes the data-parallel degree or a rank's place in it, and a
    loader position saved by rank 1 would then feed another slice of the data: those values
    are handled as on another world size. No DTensor at all (DDP, plain tensors) counts as
    a 1-D mesh of the world: every rank a data-parallel rank."""
    if len(statuses) != world:
        return False
    headers = [status.header for status in statuses if status.header is not None]
    if headers and all(header.meshes is not None for header in headers):
        saved_meshes = {m for header in headers for m in header.meshes or ()}
        live_set = live_meshes(live)
        whole: set[MeshNames] = {((world,), None)}
        return not (unmatched_meshes(saved_meshes or whole, live_set or whole)
                    or unmatched_meshes(live_set or whole, saved_meshes or whole))
    saved = {record.dist.mesh_shape for header in headers
             for record in header.tensors if record.dist is not None}
    return (saved or {(world,)}) == (mesh_shapes(live) or {(world,)})


def _per_rank_values(trees: Sequence[Any], train_states: Sequence[TrainState],
                     choices: Reshard, step: int, rank: int) -> tuple[Any, TrainState]:
    """Saved rank 0's tree and TrainState, with each plain value that differs between the
    saved ranks replaced by what ``choices.per_rank`` makes of them; without it, a difference
    is a ReshardError. The RNG states are rank 0's (restored only with ``rng="rank0"``)."""

    def refuse(path: str, values: Sequence[Any], why: str) -> NoReturn:
        shown = ", ".join(f"rank {r}: {v!r:.60}" for r, v in enumerate(values[:4]))
        raise ReshardError(
            f"{path or 'the state'}: the saved ranks hold different values ({shown}"
            f"{', ...' if len(values) > 4 else ''}); {why}", step=step, rank=rank, path=path,
            hint="restore with the world size that saved; or pass reshard=cp.Reshard("
                 "exclude=(<top-level entry>,)) to keep the live values, or "
                 "per_rank=<function(path, values)> to say what each rank restores")

    def merge(nodes: Sequence[Any], path: str) -> Any:
        first = nodes[0]
        if all(_skeleton(n) == _skeleton(first) for n in nodes[1:]):
            return first
        if all(isinstance(n, dict) for n in nodes) and all(n.keys() == first.keys()
                                                             for n in nodes):
            return {k: merge([n[k] for n in nodes], join_path(path, k)) for k in first}
        if all(type(n) is type(first) and isinstance(n, (list, tuple)) for n in nodes)                 and len({len(n) for n in nodes}) == 1:
            return type(first)(merge([n[i] for n in nodes], join_path(path, i))
                               for i in range(len(first)))
        if any(_refs(n) for n in nodes):
            refuse(path, nodes, "the values hold tensors, which cannot be mapped onto another "
                                "number of ranks but by their DTensor layout")
        if choices.per_rank is None:
            refuse(path, nodes, "a per-rank value cannot be mapped onto another number of "
                                "ranks")
        try:
            return choices.per_rank(path, tuple(nodes))
        except Exception as exc:
            raise ReshardError(f"{path}: Reshard.per_rank raised {type(exc).__name__}: {exc}",
                               step=step, rank=rank, path=path) from exc

    tree = merge(trees, "")
    ts0 = train_states[0]
    changes: dict[str, Any] = {}
    for name in ("consumed_train_samples", "skipped_train_samples",
                 "floating_point_operations_so_far", "extra"):
        values = [getattr(ts, name) for ts in train_states]
        if any(v != values[0] for v in values[1:]):
            changes[name] = merge(values, f"train_state.{name}")
    if "extra" in changes and not isinstance(changes["extra"], dict):
        raise ReshardError("Reshard.per_rank returned a TrainState.extra that is not a map",
                           step=step, rank=rank, path="train_state.extra")
    return tree, dataclasses.replace(ts0, **changes) if changes else ts0


def _skeleton(node: Any) -> Any:
    if isinstance(node, TensorRef):
        return TensorRef(0)
    if isinstance(node, dict):
        return {k: _skeleton(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_skeleton(v) for v in node)
    return node


def live_targets(live: Mapping[str, Any], tree: Any) -> dict[int, torch.Tensor]:
    """{tensor index of ``tree``: the live tensor it is restored into, or whose layout it
    takes}: walked as the apply walks (modules and other stateful objects through
    ``state_dict()``); an optimizer's saved moments without live state take their
    parameter's."""
    out: dict[int, torch.Tensor] = {}

    def walk(obj: Any, node: Any, depth: int) -> None:
        if depth > 256:
            return
        if isinstance(node, TensorRef):
            if isinstance(obj, torch.Tensor):
                out[node.index] = obj
            return
        if isinstance(obj, torch.optim.Optimizer):
            walk(obj.state_dict(), node, depth + 1)
            _moments(obj, node)
        elif is_stateful(obj):
            walk(state_dict_of(obj), node, depth + 1)
        elif isinstance(obj, Mapping) and isinstance(node, dict):
            for key, sub in node.items():
                if key in obj:
                    walk(obj[key], sub, depth + 1)
        elif isinstance(obj, (list, tuple)) and isinstance(node, (list, tuple)):
            for value, sub in zip(obj, node):
                walk(value, sub, depth + 1)

    def _moments(opt: torch.optim.Optimizer, node: Any) -> None:
        if not isinstance(node, dict) or not isinstance(node.get("state"), dict) \
                or not isinstance(node.get("param_groups"), list):
            return
        ids = [i for g in node["param_groups"] if isinstance(g, dict)
               for i in g.get("params", [])]
        params = [p for g in opt.param_groups for p in g["params"]]
        by_id = dict(zip(ids, params))
        for key, entry in node["state"].items():
            param = by_id.get(key)
            if param is None or not isinstance(entry, dict):
                continue
            for ref in entry.values():
                if isinstance(ref, TensorRef) and ref.index not in out:
                    out[ref.index] = param

    walk(live, tree, 0)
    return out


def _tensor(index: int, record: TensorRecord, template: torch.Tensor | None,
            shards: Sequence[ShardRanges], rank: int, step: int, plain_from: int, bound: int,
            planned: list[Span], inplace: tuple[torch.Tensor, str] | None = None,
            prewrites: Prewrites | None = None) -> torch.Tensor:
    """Tensor ``index`` of saved rank ``plain_from``'s tree, as this rank needs it (module
    docstring; a plain tensor is that rank's): allocated, or the live local shard ``inplace``
    itself where it has the planned shape and the saved dtype (registered in ``prewrites``);
    its spans added to ``planned`` (read later, into it)."""
    path = record.path
    if record.dist is not None:
        records = [shard.records.get(path) for shard in shards]
        boxes: list[tuple[int, Box]] = []
        for r, rec in enumerate(records):
            if rec is None or rec.dist is None or rec.dist.global_shape != \
                    record.dist.global_shape:
                raise ReshardError(f"{path}: saved rank {r} holds no shard of the DTensor of "
                                   f"shape {list(record.dist.global_shape)}", step=step,
                                   rank=rank, path=path)
            box = saved_box(rec.dist, r)
            if box.sizes != rec.shape:
                raise ReshardError(f"{path}: saved rank {r}'s shard has shape "
                                   f"{list(rec.shape)}, its place in the full tensor "
                                   f"{box} (mesh {list(rec.dist.mesh_shape)}, placements "
                                   f"{list(rec.dist.placements)})", step=step, rank=rank,
                                   path=path)
            boxes.append((r, box))
        shape = record.dist.global_shape
        chosen = {r: rec for r, rec in enumerate(records) if rec is not None}
    else:
        shape = record.shape
        boxes = [(plain_from, Box.full(shape))]
        chosen = {plain_from: record}
    need, live = _need(template, shape, path, step, rank)
    pieces = plan_box(SavedBoxes(path, shape, boxes), need, reader=rank)
    device = torch.device("cpu") if live is None else \
        live.to_local().device  # type: ignore[attr-defined]
    before = None
    if live is not None and inplace is not None and prewrites is not None \
            and _reads_into(inplace[0], live, need, DTYPES[record.dtype]):
        local = inplace[0]
        before = prewrites.add(index, local, inplace[1])
    else:
        local = torch.empty(need.sizes, dtype=DTYPES[record.dtype], device=device)
    for piece in pieces:
        planned.extend(spans_of(shards[piece.source], piece.source, chosen[piece.source],
                                piece.region.relative_to(piece.saved),
                                local[piece.region.relative_to(need).index()], bound, before))
    if live is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, live.device_mesh,  # type: ignore[attr-defined]
                              live.placements, run_check=False,  # type: ignore[attr-defined]
                              shape=live.shape, stride=live.stride())


def _reads_into(target: torch.Tensor, live: torch.Tensor, need: Box, dtype: torch.dtype
                ) -> bool:
    """Whether the reshard may read straight into the live local shard ``target``: it is
    ``live``'s own memory, of the saved dtype and of the box this rank needs."""
    own = restored_local(live)
    return (target.dtype == dtype and tuple(target.shape) == tuple(need.sizes)
            and own.data_ptr() == target.data_ptr() and own.device == target.device)


def _need(template: torch.Tensor | None, shape: tuple[int, ...], path: str, step: int,
          rank: int) -> tuple[Box, torch.Tensor | None]:
    """The box of the full tensor this rank needs, and the live DTensor to rebuild (None: a
    plain tensor, the whole of it)."""
    if template is None or not is_dtensor(template):
        return Box.full(shape), None
    if tuple(template.shape) != tuple(shape):
        if template.dim() != len(shape):  # a parameter's layout for a value that is not one
            return Box.full(shape), None
        raise ReshardError(f"{path}: saved tensor of shape {list(shape)}, the live DTensor "
                           f"{list(template.shape)}", step=step, rank=rank, path=path,
                           hint="restore into a model of the shapes that were saved")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        template.shape, template.device_mesh, template.placements)  # type: ignore[attr-defined]
    if not offset or 0 in local_shape:
        return Box((0,) * len(shape), tuple(local_shape)), template
    return Box(tuple(offset), tuple(local_shape)), template

