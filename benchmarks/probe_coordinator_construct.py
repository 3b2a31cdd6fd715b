"""How long making each control plane takes on every rank: the flat ``DistributedCoordinator``,
a ``HierarchicalCoordinator`` (nodes of ``LOCAL_WORLD_SIZE``) and ``job_coordinator`` (the
choice a pipeline makes), in that order, each after a barrier, each closed after. Run under
torchrun; each rank prints one line (milliseconds)::

    LOCAL_WORLD_SIZE=2 torchrun --nproc-per-node 8 benchmarks/probe_coordinator_construct.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_pipeline.coordination._control_plane import DistributedCoordinator
from ckpt_pipeline.coordination._hierarchy import (
    HierarchicalCoordinator,
    job_coordinator,
    node_size_from_env,
)


def main() -> None:
    dist.init_process_group("gloo")
    size = node_size_from_env(dist.get_world_size())
    made: dict[str, float] = {}
    for name, make in (("flat", lambda: DistributedCoordinator(timeout_s=60)),
                       ("hier", lambda: HierarchicalCoordinator(node_size=size, timeout_s=60)),
                       ("job", lambda: job_coordinator(timeout_s=60))):
        dist.barrier()
        started = time.perf_counter()
        coordinator = make()
        made[name] = round((time.perf_counter() - started) * 1e3, 1)
        coordinator.close()
    print(f"rank {dist.get_rank()} ms: {made}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
