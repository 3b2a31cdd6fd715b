"""Restoring a step saved by another number of ranks: each rank reads, from every saved rank's
shard, only the boxes its live tensors need (planned by ``_reshard``), in a root that holds
every saved rank's files (one root the ranks share).

- **Which step.** Every live rank scans the saved ranks' files of each step (headers only) and
  keeps the steps complete for all of them, of one save, that no rewind abandoned; the saves
  after the restore go on in the newest timeline the root names. The ranks agree on the newest step
  all of them found, and fall back together to the next when any rank's load fails.
- **Tensors.** Each saved tensor's live counterpart says what this rank needs: a live DTensor
  its own box (its mesh, placements and global shape may differ from the saved ones), a plain
  tensor the whole tensor. An optimizer's moments take the layout of their parameter when the
  live optimizer has no state yet. A saved DTensor comes from the saved shards that overlap the
  box, each element read once (a replicated shard from one holder); a saved plain tensor from
  rank 0's shard (plain tensors of a data-parallel job are the same on every rank). Reads are
  byte ranges of the shard files, every checksum chunk they touch verified
  (``_reshard.ranges``).
- **Everything else** is rank 0's: the tree's plain values and the TrainState must be the same
  on every saved rank, or the restore is refused (per-rank values cannot be mapped onto other
  ranks silently). The RNG states are per rank: they are not restored, the live ones stay.
- **Refused before anything is applied.** A layout that cannot be resharded (a gap, a global
  shape that differs) is a ``ReshardError`` on the rank that finds it, and every rank raises;
  the live state is checked (``validate_state``) before the apply, as in every restore.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import torch

from .._format.documents import TensorRef
from .._format.header import TensorRecord
from .._format.limits import CHECKSUM_BLOCK_BYTES, DTYPES
from .._format.scan import StepStatus, decode_contents, scan
from .._lineage import current_steps, local_timeline
from .._logging import log
from .._reshard.boxes import Box, saved_box
from .._reshard.plan import ReshardError, SavedBoxes, plan_box
from .._reshard.ranges import ShardRanges
from .._threads import in_thread
from .._tree import is_dtensor, is_stateful, join_path
from ..coordination import Coordinator
from ..coordination._agree import agree_outcome, gather_shared
from ..errors import CheckpointError, RestoreError, StateError
from ..storage import Storage
from .sourcing import Loaded
from .validate import validate_state

__all__ = ("reshard_latest",)

_log = log


async def reshard_latest(storage: Storage, coordinator: Coordinator, state: Mapping[str, Any],
                         limiter: anyio.CapacityLimiter, *, saved_world: int,
                         step: int | None, started: float, keep_missing: bool,
                         in_flight: int) -> Loaded:
    """The newest step saved by ``saved_world`` ranks that every rank can reshard, read for
    this rank and checked against ``state`` (see the module docstring). RestoreError when
    there is none; the ReshardError or StateError of a step that cannot be resharded."""
    rank, world = coordinator.rank, coordinator.world_size
    found = await in_thread(limiter, _complete_steps, storage, saved_world)
    mine = sorted(((s, statuses[0].save_id or "") for s, statuses in found.items()
                   if step is None or s == step), reverse=True)
    answers = await gather_shared(coordinator, [list(c) for c in mine],
                                  what="reshard candidates")
    common = set(mine)
    for answer in answers:
        common &= {(int(s), str(i)) for s, i in (answer or [])}
    if not common:
        raise RestoreError(
            f"no step saved by {saved_world} rank(s) is complete in {storage.root} for every "
            f"rank of this job ({world}): resharding reads every saved rank's files"
            + ("" if step is None else f" (asked for step {step})"), step=step, rank=rank,
            path=str(storage.root),
            hint=f"restore with {saved_world} ranks, or gather every rank's files of the step "
                 "into one root that every rank reads")
    failures: dict[int, str] = {}
    for at, save_id in sorted(common, reverse=True):
        loaded: Loaded | None = None
        error: CheckpointError | None = None
        try:
            loaded = await in_thread(limiter, functools.partial(
                _load, storage, found[at], state, rank, started, keep_missing, in_flight))
        except CheckpointError as exc:
            error = exc
        fatal = isinstance(error, (ReshardError, StateError))
        failures, any_fatal = await agree_outcome(
            coordinator, at, save_id, None if error is None else error.message,
            what="reshard load", fatal=fatal)
        if not failures and loaded is not None:
            _log.info("ckpt.recovery.resharded", step=at, rank=rank, saved_world=saved_world,
                      world=world, bytes_read=loaded.bytes)
            return loaded
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


def _listing(failures: Mapping[int, str]) -> str:
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))


def _complete_steps(storage: Storage, saved_world: int) -> dict[int, list[StepStatus]]:
    """{step: every saved rank's valid files of it} for the steps of ``saved_world`` ranks
    whose files are all in ``storage``, of one save, and that no rewind abandoned (as the
    newest step of a restore at the same world size is picked). Worker thread."""
    by_rank: list[dict[int, StepStatus]] = []
    for r in range(saved_world):
        valid = {s.step: s for s in scan(storage, r) if s.valid and s.world_size == saved_world}
        current = current_steps(storage, r, {at: s.dir_name for at, s in valid.items()})
        by_rank.append({at: valid[at] for at in current})
    out: dict[int, list[StepStatus]] = {}
    for at in set.intersection(*(set(d) for d in by_rank)):
        statuses = [d[at] for d in by_rank]
        if len({s.save_id for s in statuses}) == 1:
            out[at] = statuses
    return out


def _load(storage: Storage, statuses: Sequence[StepStatus], state: Mapping[str, Any],
          rank: int, started: float, keep_missing: bool, in_flight: int) -> Loaded:
    """This rank's tensors of one step, resharded, and checked against the live state.
    Worker thread."""
    contents = [decode_contents(s, r) for r, s in enumerate(statuses)]
    tree, train_state = contents[0]
    step = statuses[0].step
    _same_on_every_rank(contents, step, rank)
    targets = live_targets(state, tree)
    readers: list[ShardRanges] = []
    try:
        for r, status in enumerate(statuses):
            readers.append(ShardRanges(storage, status, r, bound=in_flight))
        coarse = max(reader.block for reader in readers)
        if coarse > CHECKSUM_BLOCK_BYTES:
            _log.info("ckpt.recovery.reshard_coarse_checksums", step=step, rank=rank,
                      block_bytes=coarse,
                      hint=f"these shards were checksummed in blocks of {coarse} bytes (an "
                           "older writer, or format 1): each range read reads and verifies "
                           "whole blocks, up to that much beyond each end of the range")
        header = readers[0].header
        tensors = [_tensor(index, record, targets.get(index), readers, rank, step)
                   for index, record in enumerate(header.tensors)]
    finally:
        for reader in readers:
            reader.close()
    left_out, kept = validate_state(state, tree, tensors, step=step, rank=rank,
                                    keep_missing=keep_missing)
    return Loaded(step=step, save_id=statuses[0].save_id or "", path=statuses[0].path,
                  tree=tree, tensors=tensors, train_state=train_state,
                  bytes=sum(r.bytes_read for r in readers), started=started, rejected=(),
                  valid_by_rank={}, restore_rng=False, not_restored=left_out,
                  not_in_checkpoint=kept, resharded_from=len(statuses),
                  timeline=max(local_timeline(storage, r) for r in range(len(statuses))))


def _same_on_every_rank(contents: Sequence[tuple[Any, Any]], step: int, rank: int) -> None:
    """Refuse per-rank values: the plain parts of every saved rank's tree and TrainState
    (less its RNG states) must be rank 0's."""
    tree0, ts0 = contents[0]
    skeleton0 = _skeleton(tree0)
    for r, (tree, ts) in enumerate(contents[1:], start=1):
        where = _first_difference(skeleton0, _skeleton(tree), "")
        if where is not None:
            path, mine, theirs = where
            raise ReshardError(
                f"{path or 'the state'}: saved rank {r} holds {theirs!r}, rank 0 {mine!r}; "
                "a per-rank value cannot be mapped onto another number of ranks", step=step,
                rank=rank, path=path, hint="restore with the world size that saved, or save per-rank "
                                "values (a data loader's position) the same on every rank")
        for name in ("consumed_train_samples", "skipped_train_samples", "extra"):
            if getattr(ts, name) != getattr(ts0, name):
                raise ReshardError(
                    f"TrainState.{name} differs between saved ranks 0 and {r} "
                    f"({getattr(ts0, name)!r} and {getattr(ts, name)!r}): a per-rank value "
                    "cannot be mapped onto another number of ranks", step=step, rank=rank,
                    hint="restore with the world size that saved, or keep per-rank values "
                         "out of the TrainState")


def _skeleton(node: Any) -> Any:
    if isinstance(node, TensorRef):
        return TensorRef(0)
    if isinstance(node, dict):
        return {k: _skeleton(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_skeleton(v) for v in node)
    return node


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for key in a:
            found = _first_difference(a[key], b[key], join_path(path, key))
            if found is not None:
                return found
        return None
    if (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b)
            and len(a) == len(b)):
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, join_path(path, i))
            if found is not None:
                return found
        return None
    return None if a == b else (path, a, b)


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
            walk(obj.state_dict(), node, depth + 1)
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
            readers: Sequence[ShardRanges], rank: int, step: int) -> torch.Tensor:
    """Tensor ``index`` of saved rank 0's tree, as this rank needs it (module docstring)."""
    path = record.path
    if record.dist is not None:
        records = [reader.records.get(path) for reader in readers]
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
        chosen: list[TensorRecord] = [rec for rec in records if rec is not None]
    else:
        shape = record.shape
        boxes = [(0, Box.full(shape))]
        chosen = [record]
    need, live = _need(template, shape, path, step, rank)
    pieces = plan_box(SavedBoxes(path, shape, boxes), need, reader=rank)
    local = torch.empty(need.sizes, dtype=DTYPES[record.dtype])
    for piece in pieces:
        readers[piece.source].read_box(chosen[piece.source], piece.region.relative_to(
            piece.saved), local[piece.region.relative_to(need).index()])
    if live is None:
        return local
    from torch.distributed.tensor import DTensor

    device = live.to_local().device  # type: ignore[attr-defined]
    return DTensor.from_local(local.to(device), live.device_mesh,  # type: ignore[attr-defined]
                              live.placements, run_check=False,  # type: ignore[attr-defined]
                              shape=live.shape, stride=live.stride())


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

