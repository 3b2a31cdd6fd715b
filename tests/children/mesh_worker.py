"""One rank of the 2-D mesh consolidation test (tests/coordination/test_fsdp.py): four gloo
ranks on a 2x2 DeviceMesh save DTensors of several placements into one root, uneven sizes
included; rank 0 writes the full tensors to ``full.npz`` beside ``--root``. A second root
holds a tensor whose dimension 0 is sharded by both mesh dimensions (``Shard(0), Shard(0)``,
11 rows: uneven at both levels), which ``cp.load(consolidate=True)`` assembles too.
"""

from __future__ import annotations

import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckpt_pipeline as cp
from tests._support.children import exit_without_teardown

PLACEMENTS = {
    "rows_and_cols": ((7, 5), (Shard(0), Shard(1))),  # uneven both ways (TP x FSDP)
    "hsdp": ((9, 3), (Replicate(), Shard(0))),         # replicated across mesh dim 0
    "cols_only": ((4, 6), (Shard(1), Replicate())),
    "one_row": ((1, 3), (Shard(0), Replicate())),      # the ranks of mesh row 1 hold 0 rows
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    cp.enable_logging(logging.WARNING)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2))
    full = {}
    state = {}
    for name, (shape, placements) in PLACEMENTS.items():
        torch.manual_seed(len(name))  # the same full tensor on every rank
        full[name] = torch.randn(shape)
        state[name] = distribute_tensor(full[name], mesh, list(placements))
    state["plain"] = torch.arange(4.0)
    with cp.CheckpointPipeline(args.root, coordination_timeout_s=60) as pipe:
        pipe.save(5, {"model": state}, cp.TrainState(step=5)).result(120)
    twice = distribute_tensor(torch.arange(22.0).view(11, 2), mesh, [Shard(0), Shard(0)])
    with cp.CheckpointPipeline(args.root + "-twice", coordination_timeout_s=60) as pipe:
        pipe.save(5, {"w": twice}, cp.TrainState(step=5)).result(120)
    if dist.get_rank() == 0:
        np.savez(os.path.join(os.path.dirname(args.root), "full.npz"),
                 **{k: v.numpy() for k, v in full.items()})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
