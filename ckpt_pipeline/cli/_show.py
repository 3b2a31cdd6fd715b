"""``ckpt-pipeline show ROOT|URL``: what one step holds, from its header alone (no tensor data
is read): every tensor with its path, dtype, shape and bytes, and the TrainState with
``extra``. A rank whose own files are missing or damaged is shown from a copy another rank
holds; a persistent tier's step from its downloaded header."""

from __future__ import annotations

import argparse
import math
import tempfile
from typing import Any

from .._format.filesets import rank_sets
from .._format.limits import DTYPES
from .._format.names import step_dir_name
from .._format.scan import StepStatus, decode_contents, scan_files
from .._format.steps import committed_steps
from .._tiers.persistent.stream import ShardStream
from .._tiers.persistent.urls import open_remote
from ..errors import CheckpointIntegrityError
from ..loading import newest_candidates, pick_step, tier_step
from ..storage import LocalStorage, Storage
from ._output import human_bytes, print_json, table_lines
from ._remote import parse_options
from ._status import EXIT_OK

__all__ = ("cmd_show", "cmd_show_remote")


def cmd_show(storage: Storage, args: argparse.Namespace) -> int:
    rank: int = args.rank
    steps = (newest_candidates(storage, rank) if args.step is None
             else committed_steps(storage, rank, copies=True))
    step, dir_name = pick_step(steps, args.step, rank, str(storage.root))
    names = {e.name for e in storage.list_dir(dir_name)}
    looked = [scan_files(storage, files, step, dir_name, names)
              for files in rank_sets(names, rank)]
    status = next((s for s in looked if s.valid and s.header is not None), looked[0])
    if not status.valid or status.header is None:
        reasons = "; ".join(str(s.reason) for s in looked)
        raise CheckpointIntegrityError(f"step {step} does not verify: {reasons}",
                                       step=step, rank=rank, path=status.path)
    holder = status.files.holder if status.files is not None else None
    return _show(status, str(storage.root), status.path, rank, holder, args)


def cmd_show_remote(url: str, args: argparse.Namespace) -> int:
    """``show URL``: the header of a complete step of a persistent tier. Its first and last
    parts (preamble and header) are downloaded into a temporary directory, the rest of the
    download is stopped."""
    rank: int = args.rank
    remote = open_remote(url, options=parse_options(args.option), retries=2)
    try:
        record = tier_step(remote, args.step, rank)
        with tempfile.TemporaryDirectory(prefix="ckpt-show-") as tmp:
            stream = ShardStream(remote, LocalStorage(tmp), record, rank)
            try:
                status = stream.status()
            finally:
                stream.discard()
    finally:
        remote.close()
    return _show(status, remote.url, f"{remote.url}/{step_dir_name(record.step)}", rank, None,
                 args)


def _show(status: StepStatus, root: str, where: str, rank: int, holder: int | None,
          args: argparse.Namespace) -> int:
    step = status.step
    assert status.header is not None
    _tree, train_state = decode_contents(status, rank)
    rows = []
    views: dict[tuple[Any, ...], str] = {}
    for record in status.header.tensors:
        item = DTYPES[record.dtype].itemsize
        entry: dict[str, Any] = {"path": record.path, "dtype": record.dtype,
                                 "shape": list(record.shape),
                                 "bytes": math.prod(record.shape) * item}
        view = (record.storage, record.byte_offset, record.shape, record.stride, record.dtype)
        if view in views:  # the same bytes as a tensor before it: a tied weight, stored once
            entry["tied_to"] = views[view]
        else:
            views[view] = record.path
        if record.dist is not None:
            entry["global_shape"] = list(record.dist.global_shape)
            entry["placements"] = list(record.dist.placements)
        rows.append(entry)
    state: dict[str, Any] = {"step": train_state.step,
                             "consumed_train_samples": train_state.consumed_train_samples,
                             "extra": dict(train_state.extra), "rng": repr(train_state.rng)}
    if args.json:
        print_json({"root": root, "step": step, "rank": rank,
                     "world_size": status.world_size, "save_id": status.save_id,
                     "copy_held_by": holder,
                     "path": where, "tensors": rows, "train_state": state,
                     "bytes": _stored(status)})
        return EXIT_OK
    held = "" if holder is None else f", from the copy rank {holder} holds"
    print(f"step {step} of {where} (rank {rank} of {status.world_size}, save "
          f"{status.save_id}{held})")
    table = [[r["path"], r["dtype"], "x".join(map(str, r["shape"])) or "scalar",
              (f"tied to {r['tied_to']}" if "tied_to" in r else human_bytes(r["bytes"])),
              ("" if "global_shape" not in r else
               f"shard of {'x'.join(map(str, r['global_shape']))} {','.join(r['placements'])}")]
             for r in rows]
    for line in table_lines(["TENSOR", "DTYPE", "SHAPE", "SIZE", "DTENSOR"], table, right={3}):
        print(line)
    tied = sum(1 for r in rows if "tied_to" in r)
    print(f"{len(rows)} tensors, {human_bytes(_stored(status))} stored"
          + (f" ({tied} tied to another, stored once)" if tied else ""))
    print(f"train state: step {state['step']}, consumed samples "
          f"{state['consumed_train_samples']}, rng {state['rng']}")
    for key, value in state["extra"].items():
        print(f"  extra.{key} = {value!r}")
    return EXIT_OK


def _stored(status: StepStatus) -> int:
    """The tensor bytes the step stores: each storage once (tied weights and views of one
    storage are not counted twice)."""
    assert status.header is not None
    return sum(storage.nbytes for storage in status.header.storages)
