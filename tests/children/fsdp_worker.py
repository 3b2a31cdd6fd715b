"""One rank of the FSDP2 / DDP checkpoint tests (run by tests/coordination/test_fsdp.py, one
process a rank).

Trains a small model one step, saves it with the pipeline, builds a fresh differently
initialised model, restores into it, takes one more identical step on both, and writes what it
saw as JSON. CUDA runs use NCCL for training and gloo (the pipeline's own group) for the
control plane.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import ckpt_pipeline as cp
from tests._support.children import exit_without_teardown


def build(kind: str, device: torch.device, seed: int) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).to(device)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: Any, device: torch.device, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    x = torch.randn(16, 32, generator=g).to(device)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().cpu()


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(local(x), local(y))
               for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("fsdp", "ddp"))
    parser.add_argument("--root", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True)
    parser.add_argument("--shared-root", action="store_true",
                        help="every rank saves into --root itself (one root for the job), and "
                             "rank 0 writes the full tensors of the saved model to full.npz")
    parser.add_argument("--replicas", type=int, default=0,
                        help="keep this many copies of each shard (each rank its own node)")
    args = parser.parse_args()
    cp.enable_logging(logging.WARNING)
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    root = args.root if args.shared_root else os.path.join(args.root, f"rank-{rank}")
    model, opt = build(args.kind, device, seed=0)
    train_step(model, opt, device, seed=1)
    blocking = []
    replication = (cp.ReplicationConfig() if not args.replicas else
                   cp.ReplicationConfig(copies=args.replicas, node_name=f"node-{rank}"))
    with cp.CheckpointPipeline(root, coordination_timeout_s=60,
                               replication=replication) as pipe:
        for step in (1, 2):
            started = time.perf_counter()
            handle = pipe.save(step, {"model": model, "optim": opt}, cp.TrainState(step=step))
            pipe.wait_snapshot()
            blocking.append(time.perf_counter() - started)
            handle.result(120)
    if args.shared_root:  # what cp.load(..., consolidate=True) must assemble
        import numpy as np

        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().numpy()
                for k, v in model.state_dict().items()}
        if rank == 0:
            np.savez(os.path.join(os.path.dirname(args.out), "full.npz"), **full)
    fresh, fresh_opt = build(args.kind, device, seed=1)
    with cp.CheckpointPipeline(root, coordination_timeout_s=60,
                               replication=replication) as pipe:
        result = pipe.restore_latest({"model": fresh, "optim": fresh_opt})
    equal_after_restore = same(model, fresh)
    first_state = next(iter(fresh_opt.state_dict()["state"].values()))
    train_step(model, opt, device, seed=2)
    train_step(fresh, fresh_opt, device, seed=2)
    out = {
        "rank": rank,
        "restored_step": None if result is None else result.step,
        "equal_after_restore": equal_after_restore,
        "equal_after_next_step": same(model, fresh),
        "param_type": type(next(iter(fresh.state_dict().values()))).__name__,
        "optim_state_type": type(first_state["exp_avg"]).__name__,
        "param_device": str(local(next(iter(fresh.parameters()))).device
                            if args.device == "cpu" else next(iter(fresh.parameters())).device),
        "blocking_s": blocking,
    }
    with open(args.out, "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
