"""One rank of the reshard property test's pool (tests/reshard/test_reshard_property.py): four
long-lived gloo processes that save and restore DTensors, one example after another.

At start every rank creates, in the same order, the gloo groups that any mesh of 1 to 4 ranks
needs (one per mesh row and column, as ``DeviceMesh.from_group`` takes them) and one control-plane
group per world size (ranks ``0..n-1``), then prints ``{"ready": rank}``. Then it answers one JSON
line of stdin at a time, with one JSON line on stdout carrying the request's ``id``:

- ``{"op": "save", "root", "mesh", "tensors", "chunk_bytes"}``: on the ranks of ``mesh`` (a
  sub-job of ``prod(mesh)`` ranks), the full tensors described by ``tensors`` (``name``,
  ``shape``, ``dtype``, ``base``, ``saved`` placements) are distributed on the mesh and saved at
  step ``STEP`` into ``root`` through a coordinator over that sub-job. Replies ``{}``.
- ``{"op": "restore", "root", "mesh", "tensors", "reshard_bytes_in_flight"}``: live DTensors
  filled with ``FILL``, placed as ``live`` says, are restored with ``restore_latest``; replies
  the restore's step and ``resharded_from``, and ``differ``: for each tensor whose local shard
  is not what ``distribute_tensor`` of the full tensor gives this rank, its first difference.

An exception becomes ``{"error": traceback, "clean": bool}``; ``clean`` unless it is a
``CoordinationError`` (an exchange failed or timed out: the group may hold half of one). The
end of stdin ends the process. Everything else the process prints goes to stderr: stdout is
the protocol's.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckpt_pipeline as cp
from tests._support.children import exit_without_teardown

STEP = 3
FILL = -7  # what a live element holds until the restore writes it: no saved value is negative
TIMEOUT_S = 20.0
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
          "int64": torch.int64}
MESH_SHAPES = ((1,), (2,), (3,), (4,), (1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (2, 2),
               (4, 1))


def full_tensor(spec: dict[str, Any]) -> torch.Tensor:
    """The full tensor of ``spec``: every element its own value, ``base`` + its flat index."""
    shape: list[int] = spec["shape"]
    values = torch.arange(math.prod(shape), dtype=torch.int64) + int(spec["base"])
    return values.to(DTYPES[spec["dtype"]]).reshape(shape)


def mesh_groups(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The ranks of every group a mesh of ``shape`` (the ranks in order, row-major) uses."""
    mesh = torch.arange(math.prod(shape)).reshape(shape)
    if len(shape) == 1:
        return [tuple(mesh.tolist())]
    columns = [tuple(mesh[:, j].tolist()) for j in range(shape[1])]
    rows = [tuple(mesh[i, :].tolist()) for i in range(shape[0])]
    return columns + rows


class Rank:
    """This rank's groups, made once, and the examples it takes part in."""

    def __init__(self) -> None:
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        dist.init_process_group("gloo", timeout=timeout)
        self.rank = dist.get_rank()
        self.groups: dict[tuple[int, ...], Any] = {}
        for shape in MESH_SHAPES:  # the same order on every rank: new_group is collective
            for ranks in mesh_groups(shape):
                if ranks not in self.groups:
                    self.groups[ranks] = dist.new_group(list(ranks), backend="gloo",
                                                        timeout=timeout)
        self.control = {n: dist.new_group(list(range(n)), backend="gloo", timeout=timeout)
                        for n in range(1, dist.get_world_size() + 1)}

    def mesh(self, shape: tuple[int, ...]) -> DeviceMesh:
        ranks = torch.arange(math.prod(shape)).reshape(shape)
        if len(shape) == 1:
            return DeviceMesh.from_group(self.groups[tuple(ranks.tolist())], "cpu")
        i, j = (int(c) for c in (ranks == self.rank).nonzero()[0])
        column, row = tuple(ranks[:, j].tolist()), tuple(ranks[i, :].tolist())
        return DeviceMesh.from_group([self.groups[column], self.groups[row]], "cpu",
                                     mesh=ranks, mesh_dim_names=("rows", "cols"))

    def pipeline(self, root: str, world: int, **options: Any) -> cp.CheckpointPipeline:
        coordinator = cp.DistributedCoordinator(self.control[world], timeout_s=TIMEOUT_S)
        return cp.CheckpointPipeline(root, coordinator=coordinator, sigterm="off",
                                     coordination_timeout_s=TIMEOUT_S, **options)

    def save(self, msg: dict[str, Any]) -> dict[str, Any]:
        shape = tuple(msg["mesh"])
        mesh = self.mesh(shape)
        state = {t["name"]: distributed(mesh, t, "saved", full_tensor(t))
                 for t in msg["tensors"]}
        with self.pipeline(msg["root"], math.prod(shape), chunk_bytes=msg["chunk_bytes"]) as pipe:
            pipe.save(STEP, {"t": state}, cp.TrainState(step=STEP)).result(2 * TIMEOUT_S)
        return {}

    def restore(self, msg: dict[str, Any]) -> dict[str, Any]:
        shape = tuple(msg["mesh"])
        mesh = self.mesh(shape)
        live = {}
        for t in msg["tensors"]:
            filled = torch.full(t["shape"], FILL, dtype=DTYPES[t["dtype"]])
            live[t["name"]] = distributed(mesh, t, "live", filled)
        state = {"t": dict(live)}
        with self.pipeline(msg["root"], math.prod(shape),
                           reshard_bytes_in_flight=msg["reshard_bytes_in_flight"]) as pipe:
            result = pipe.restore_latest(state)
        differ = []
        for t in msg["tensors"]:
            got = live[t["name"]].to_local()
            want = distributed(mesh, t, "live", full_tensor(t)).to_local()
            where = first_difference(got, want)
            if where is not None:
                differ.append(f"{t['name']}: {where}")
        return {"step": None if result is None else result.step,
                "resharded_from": None if result is None else result.resharded_from,
                "differ": differ}


def distributed(mesh: DeviceMesh, spec: dict[str, Any], which: str, value: torch.Tensor) -> Any:
    """``value`` placed on ``mesh`` as ``spec[which]`` says (``["S0", "R"]``)."""
    placements = [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec[which]]
    # src_data_rank=None: every rank cuts its own shard out of ``value``, no collective.
    return distribute_tensor(value, mesh, placements, src_data_rank=None)


def first_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"local shard {list(got.shape)} {got.dtype}, expected {list(want.shape)} "
                f"{want.dtype}")
    unequal = (got != want).nonzero()
    if not len(unequal):
        return None
    at = tuple(int(i) for i in unequal[0])
    return (f"{len(unequal)} of {want.numel()} elements differ, the first at local index "
            f"{list(at)}: {got[at].item()}, expected {want[at].item()}")


def main() -> None:
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints: to stderr
    cp.enable_logging(logging.WARNING)
    me = Rank()
    protocol.write(json.dumps({"ready": me.rank}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            reply = me.save(msg) if msg["op"] == "save" else me.restore(msg)
        except Exception as exc:
            reply = {"error": traceback.format_exc(),
                     "clean": not isinstance(exc, cp.CoordinationError)}
        protocol.write(json.dumps({"id": msg["id"], **reply}) + "\n")
        protocol.flush()
    protocol.close()
    os._exit(0)  # no teardown that could wait on a peer that is gone


if __name__ == "__main__":
    main()
    exit_without_teardown()
