"""``ckpt-pipeline show ROOT``: what one step holds, from its header alone (no tensor data is
read): every tensor with its path, dtype, shape and bytes, and the TrainState with ``extra``."""

from __future__ import annotations

import argparse
import math
from typing import Any

from .._format.limits import DTYPES
from .._restore import scan as _recovery
from ..errors import CheckpointIntegrityError
from ..loading import pick_step
from ..storage import Storage
from ._output import _human_bytes, _print_json, _table
from ._status import EXIT_OK

__all__ = ("_cmd_show",)


def _cmd_show(storage: Storage, args: argparse.Namespace) -> int:
    rank: int = args.rank
    step, dir_name = pick_step(_recovery.committed_steps(storage, rank, copies=True),
                               args.step, rank, str(storage.root))
    names = {e.name for e in storage.list_dir(dir_name)}
    looked = [_recovery.scan_files(storage, files, step, dir_name, names)
              for files in _recovery.rank_sets(names, rank)]
    status = next((s for s in looked if s.valid and s.header is not None), looked[0])
    if not status.valid or status.header is None:
        reasons = "; ".join(str(s.reason) for s in looked)
        raise CheckpointIntegrityError(f"step {step} does not verify: {reasons}",
                                       step=step, rank=rank, path=status.path)
    holder = status.files.holder if status.files is not None else None
    _tree, train_state = _recovery.decode_contents(status, rank)
    rows = []
    for record in status.header.tensors:
        item = DTYPES[record.dtype].itemsize
        entry: dict[str, Any] = {"path": record.path, "dtype": record.dtype,
                                 "shape": list(record.shape),
                                 "bytes": math.prod(record.shape) * item}
        if record.dist is not None:
            entry["global_shape"] = list(record.dist.global_shape)
            entry["placements"] = list(record.dist.placements)
        rows.append(entry)
    state: dict[str, Any] = {"step": train_state.step,
                             "consumed_train_samples": train_state.consumed_train_samples,
                             "extra": dict(train_state.extra), "rng": repr(train_state.rng)}
    if args.json:
        _print_json({"root": str(storage.root), "step": step, "rank": rank,
                     "world_size": status.world_size, "save_id": status.save_id,
                     "copy_held_by": holder,
                     "path": status.path, "tensors": rows, "train_state": state,
                     "bytes": sum(r["bytes"] for r in rows)})
        return EXIT_OK
    held = "" if holder is None else f", from the copy rank {holder} holds"
    print(f"step {step} of {status.path} (rank {rank} of {status.world_size}, save "
          f"{status.save_id}{held})")
    table = [[r["path"], r["dtype"], "x".join(map(str, r["shape"])) or "scalar",
              _human_bytes(r["bytes"]),
              ("" if "global_shape" not in r else
               f"shard of {'x'.join(map(str, r['global_shape']))} {','.join(r['placements'])}")]
             for r in rows]
    for line in _table(["TENSOR", "DTYPE", "SHAPE", "SIZE", "DTENSOR"], table, right={3}):
        print(line)
    print(f"{len(rows)} tensors, {_human_bytes(sum(r['bytes'] for r in rows))}")
    print(f"train state: step {state['step']}, consumed samples "
          f"{state['consumed_train_samples']}, rng {state['rng']}")
    for key, value in state["extra"].items():
        print(f"  extra.{key} = {value!r}")
    return EXIT_OK
