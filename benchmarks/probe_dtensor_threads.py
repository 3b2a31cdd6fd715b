"""What walking an FSDP2 module's state costs on a thread that has not walked it before.

DTensor's sharding propagation caches its results per thread. ``module.state_dict()`` detaches
every parameter, and detaching a DTensor goes through that propagation; ``state_dict(
keep_vars=True)`` hands back the parameters themselves and does not. The restore walks the
live state from several threads (planning, validating, the backup's prefetch, the host
buffer's size), each new to DTensor, so this is what each walk costs there.

Two gloo ranks on this host, an FSDP2 model of ``--layers`` ``Linear`` layers of distinct
shapes, sharded over both. Each rank times, ``--repeats`` times each: ``state_dict()`` and
``state_dict(keep_vars=True)`` on the thread that built the model (warm after its first call)
and on a new thread each time. JSON to ``--out``, a table to stdout.

    python benchmarks/probe_dtensor_threads.py --out benchmarks/results/probe_dtensor_threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info


def _rank(rank: int, world: int, port: int, layers: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(*[torch.nn.Linear(64 + i, 65 + i) for i in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = sum(1 for _ in model.parameters())

    def timed(keep_vars: bool) -> float:
        started = time.perf_counter()
        model.state_dict(keep_vars=keep_vars)
        return (time.perf_counter() - started) * 1e3

    def on_new_thread(keep_vars: bool) -> float:
        result: list[float] = []
        thread = threading.Thread(target=lambda: result.append(timed(keep_vars)))
        thread.start()
        thread.join()
        return result[0]

    timed(False)  # the building thread's first walk: its cache warms here
    figures: dict[str, list[float]] = {
        "same_thread_detached_ms": [timed(False) for _ in range(repeats)],
        "same_thread_keep_vars_ms": [timed(True) for _ in range(repeats)],
        "new_thread_detached_ms": [on_new_thread(False) for _ in range(repeats)],
        "new_thread_keep_vars_ms": [on_new_thread(True) for _ in range(repeats)],
    }
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"params": params, "figures": figures}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scratch = Path(f"/tmp/probe_dtensor_threads.{os.getpid()}.json")
    mp.spawn(_rank, args=(2, port, args.layers, args.repeats, str(scratch)), nprocs=2)
    found = json.loads(scratch.read_text())
    scratch.unlink()
    result: dict[str, Any] = {
        "what": "module.state_dict() against state_dict(keep_vars=True) of an FSDP2 model, "
                "2 gloo ranks, rank 0's figures, on the building thread and on new threads",
        "machine": machine_info(Path("/tmp")), "torch": torch.__version__,
        "layers": args.layers, "repeats": args.repeats, **found,
        "medians_ms": {k: round(statistics.median(v), 3) for k, v in found["figures"].items()},
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{found['params']} DTensor parameters, median of {args.repeats}, ms a walk")
    for key, value in result["medians_ms"].items():
        print(f"{key:28s} {value:8.2f}  ({value / found['params']:.3f} a parameter)")


if __name__ == "__main__":
    main()
