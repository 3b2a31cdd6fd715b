"""One rank of the GPU reshard test and benchmark (tests/reshard/test_reshard_gpu.py,
benchmarks/gpu_reshard.py): CUDA DTensors saved by the ranks of a gloo job that share one
GPU, restored by another number of ranks.

The ranks share the one GPU, so the mesh is built without process groups of its own
(``_init_backend=False``: a CUDA mesh would create NCCL groups, and NCCL refuses two ranks on
one device) and each rank's shard is made in place with ``DTensor.from_local``: no collective
runs on a CUDA tensor. The saved values are a function of each element's index, so the
restoring rank knows what every element must hold.

``save``: the state of ``--mib`` MiB (a row-split matrix, uneven; a column-split one; a
replicated one) on a 1-D mesh of the job's ranks, saved as step 1 into ``--root``.
``restore``: the same tensors as zeros on this job's mesh, ``restore_latest``, then ``--out``
gets the result (step, resharded_from, bytes, seconds) and whether every element is right.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist

import ckpt_pipeline as cp
from tests._support.children import exit_without_teardown


def shapes(mib: int) -> dict[str, tuple[tuple[int, int], str]]:
    cols = 1024
    rows = max(3, mib * 1024 * 1024 // 4 // cols // 4)
    return {"rows": ((2 * rows + 1, cols), "S0"), "cols": ((rows, cols + 2), "S1"),
            "rep": ((rows, cols), "R")}


def expected(name: str, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    n = math.prod(shape)
    return (torch.arange(n, device=device, dtype=torch.float64).remainder(1 << 23)
            .to(torch.float32).reshape(shape) + len(name))


def mesh() -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cuda", list(range(dist.get_world_size())), _init_backend=False)


def state(mib: int, zeros: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    device = torch.device("cuda", 0)
    m = mesh()
    out = {}
    for name, (shape, spec) in shapes(mib).items():
        placement = Replicate() if spec == "R" else Shard(int(spec[1:]))
        local_shape, offset = compute_local_shape_and_global_offset(shape, m, [placement])
        if zeros:
            local = torch.zeros(local_shape, device=device)
        else:
            full = expected(name, shape, device)
            index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
            local = full[index].contiguous() if 0 not in local_shape else \
                torch.zeros(local_shape, device=device)
        out[name] = DTensor.from_local(local, m, [placement], run_check=False, shape=shape,
                                       stride=(shape[1], 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "restore"))
    parser.add_argument("--root", required=True)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where it is
    cp.enable_logging(logging.WARNING)
    dist.init_process_group("gloo")
    torch.cuda.set_device(0)
    if args.mode == "save":
        with cp.CheckpointPipeline(args.root, coordination_timeout_s=120) as pipe:
            pipe.save(1, {"t": state(args.mib, zeros=False)}, cp.TrainState(step=1)).result(300)
    else:
        live = state(args.mib, zeros=True)
        with cp.CheckpointPipeline(args.root, coordination_timeout_s=120) as pipe:
            dist.barrier()
            torch.cuda.synchronize()
            started = time.perf_counter()
            result = pipe.restore_latest({"t": live})
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
        assert result is not None
        right = {}
        for name, (shape, _spec) in shapes(args.mib).items():
            t = live[name]
            full = expected(name, shape, torch.device("cuda", 0))
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local_shape, offset = compute_local_shape_and_global_offset(
                shape, t.device_mesh, t.placements)
            index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
            local = t.to_local()
            right[name] = bool(local.is_cuda and torch.equal(local, full[index]))
        out = {"step": result.step, "resharded_from": result.resharded_from,
               "bytes": result.bytes, "seconds": seconds, "right": right,
               "world": dist.get_world_size(),
               "state_bytes": sum(4 * math.prod(s) for s, _ in shapes(args.mib).values())}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
    exit_without_teardown()
