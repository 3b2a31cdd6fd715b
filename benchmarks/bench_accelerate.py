"""Time inside the checkpoint call: ``save_state`` of the accelerate integration against
``accelerator.save_state(dir)``, on the same prepared model and AdamW state, in one run.

- ``ckpt_pipeline``: ``ckpt_pipeline.integrations.accelerate.save_state(accelerator, pipe,
  step)``, which returns once the CPU tensors are copied into the host buffer; the writes, the
  fsyncs and the commit follow in the background. Reported: the time in the call
  (``blocking``) and, apart, the time until the handle's ``result()`` (``to_commit``, durable
  with fsync). Its first save allocates the host buffer and is reported apart (``first``).
- ``accelerate``: ``accelerator.save_state(dir)`` (safetensors for the model, ``torch.save``
  for the optimizer, scheduler, RNG and sampler files), into a fresh directory each time; it
  blocks until the files are written (no fsync).

The methods alternate, one repeat each per round. Output: a table, and JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _machine import machine_info
from torch import nn

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048, help="Linear layers' width")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--out", type=Path,
                        default=REPO / "benchmarks" / "results" / "accelerate_ckpt.json")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(REPO))
    from accelerate import Accelerator

    import ckpt_pipeline as cp
    from ckpt_pipeline.integrations.accelerate import save_state

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model(torch.randn(4, args.width)).sum().backward()
    optimizer.step()  # the AdamW moments exist from here on
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(t.numel() * t.element_size()
                       for s in optimizer.state_dict()["state"].values()
                       for t in s.values() if isinstance(t, torch.Tensor))

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-accelerate-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ours: list[float] = []
    to_commit: list[float] = []
    theirs: list[float] = []
    first: dict[str, float] = {}
    try:
        with cp.CheckpointPipeline(workdir / "pipeline", keep_last=1) as pipe:
            for step in range(args.repeats + 1):
                started = time.perf_counter()
                handle = save_state(accelerator, pipe, step + 1)
                blocked = time.perf_counter() - started
                handle.result(timeout=600)
                durable = time.perf_counter() - started
                if step == 0:
                    first = {"blocking_s": blocked, "to_commit_s": durable}
                else:
                    ours.append(blocked)
                    to_commit.append(durable)

                target = workdir / f"accelerate-{step}"
                started = time.perf_counter()
                accelerator.save_state(str(target))
                if step:
                    theirs.append(time.perf_counter() - started)
                shutil.rmtree(target)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    def summary(values: list[float]) -> dict[str, Any]:
        return {"median_s": statistics.median(values), "min_s": min(values),
                "max_s": max(values), "all_s": values}

    result = {
        "benchmark": "accelerate_ckpt",
        "state_bytes": state_bytes,
        "repeats": args.repeats,
        "ckpt_pipeline": {"blocking": summary(ours), "to_commit": summary(to_commit),
                          "first": first},
        "accelerate_save_state": {"blocking": summary(theirs)},
        "blocking_ratio_accelerate_over_ours": (statistics.median(theirs)
                                                / statistics.median(ours)),
        "machine": machine_info(workdir.parent),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    mb = state_bytes / 1e6
    print(f"state: {mb:.0f} MB (model + AdamW moments), {args.repeats} repeats, medians")
    print(f"{'method':<40}{'in the call':>14}{'to durable':>14}")
    print(f"{'ckpt_pipeline save_state':<40}{statistics.median(ours) * 1e3:>11.1f} ms"
          f"{statistics.median(to_commit) * 1e3:>11.1f} ms")
    print(f"{'  (first save, allocates the buffer)':<40}{first['blocking_s'] * 1e3:>11.1f} ms"
          f"{first['to_commit_s'] * 1e3:>11.1f} ms")
    print(f"{'accelerator.save_state(dir)':<40}{statistics.median(theirs) * 1e3:>11.1f} ms"
          f"{'(no fsync)':>14}")
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
