"""Time inside the checkpoint call: ``save_state`` of the accelerate integration against
``accelerator.save_state(dir)``, on the same prepared model and AdamW state, in one run, on
the CPU or (``--device cuda``) on one GPU.

- ``ckpt_pipeline``: ``ckpt_pipeline.integrations.accelerate.save_state(accelerator, pipe,
  step)``, which returns once the CPU tensors are copied into the host buffer (on CUDA: once
  their copies are queued); the writes, the fsyncs and the commit follow in the background.
  Reported: the time in the call (``blocking``), the ``wait_snapshot()`` that goes before the
  next optimizer step and (CUDA) the copies' completion, and, apart, the time until the
  handle's ``result()`` (``to_commit``, durable with fsync). Its first save allocates the host
  buffer and is reported apart (``first``).
- ``accelerate``: ``accelerator.save_state(dir)`` (safetensors for the model, ``torch.save``
  for the optimizer, scheduler, RNG and sampler files; on CUDA each tensor is copied to the
  host first), into a fresh directory each time; it blocks until the files are written (no
  fsync).

Each round makes a training step, then one save of each method. The default state is about
200 MB on the CPU (4 layers of 2048) and 1 GB on CUDA (20 layers); ``_call_timing.py`` says
what each figure is. Output: a table, and JSON to ``--out``.

    python benchmarks/bench_accelerate.py
    python3 benchmarks/bench_accelerate.py --device cuda --out /tmp/accelerate_ckpt_cuda.json
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _call_timing import DEVICES, CallTimer, comparison, print_table, resolve_device
from _machine import machine_info
from torch import nn

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"cpu": 4, "cuda": 20}
"""The default number of layers per device: about 200 MB of state on the CPU, 1 GB on CUDA."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the model, the optimizer state and the training run")
    parser.add_argument("--width", type=int, default=2048, help="Linear layers' width")
    parser.add_argument("--layers", type=int, default=None,
                        help="Linear layers (default 4 on the CPU, 20 on CUDA)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--out", type=Path,
                        default=REPO / "benchmarks" / "results" / "accelerate_ckpt.json")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    device = resolve_device(args.device)
    layers = args.layers if args.layers is not None else LAYERS[device.type]
    sys.path.insert(0, str(REPO))
    from accelerate import Accelerator

    import ckpt_pipeline as cp
    from ckpt_pipeline.integrations.accelerate import save_state, step_after_snapshot

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=device.type == "cpu")
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    inputs = torch.randn(4, args.width, device=accelerator.device)
    state_bytes = 0  # once the AdamW moments exist (after the first step)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-accelerate-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ours, theirs = CallTimer(device), CallTimer(device)
    try:
        with cp.CheckpointPipeline(workdir / "pipeline", keep_last=1) as pipe:
            for step in range(args.repeats + 1):
                accelerator.backward(model(inputs).square().mean())
                step_after_snapshot(pipe, optimizer)  # wait_snapshot, then the update
                optimizer.zero_grad()
                if not state_bytes:
                    state_bytes = sum(t.numel() * t.element_size()
                                      for t in model.state_dict().values())
                    state_bytes += sum(t.numel() * t.element_size()
                                       for s in optimizer.state_dict()["state"].values()
                                       for t in s.values() if isinstance(t, torch.Tensor))

                handle = ours.time_call(functools.partial(save_state, accelerator, pipe, step + 1),
                                        pipe.wait_snapshot)
                handle.result(timeout=600)
                ours.mark_committed()

                target = workdir / f"accelerate-{step}"
                theirs.time_call(functools.partial(accelerator.save_state, str(target)))
                shutil.rmtree(target)
        machine = machine_info(workdir.parent, gpu=device.type == "cuda")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    def summary(values: list[float]) -> dict[str, Any]:
        return {"median_s": statistics.median(values), "min_s": min(values),
                "max_s": max(values), "all_s": values}

    blocking, to_commit, theirs_later = ours.call[1:], ours.committed[1:], theirs.call[1:]
    result = {
        "benchmark": "accelerate_ckpt",
        "device": device.type,
        "state_bytes": state_bytes,
        "repeats": args.repeats,
        "ckpt_pipeline": {"blocking": summary(blocking), "to_commit": summary(to_commit),
                          "first": {"blocking_s": ours.call[0],
                                    "to_commit_s": ours.committed[0]}},
        "accelerate_save_state": {"blocking": summary(theirs_later)},
        "blocking_ratio_accelerate_over_ours": (statistics.median(theirs_later)
                                                / statistics.median(blocking)),
        "comparison": comparison(ours, theirs, ours_name="integrations.accelerate.save_state",
                                 default_name="accelerator.save_state",
                                 state_bytes=state_bytes),
        "machine": machine,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    mb = state_bytes / 1e6
    print(f"state: {mb:.0f} MB (model + AdamW moments) on {device.type}, {args.repeats} "
          "repeats, medians")
    print(f"{'method':<40}{'in the call':>14}{'to durable':>14}")
    print(f"{'ckpt_pipeline save_state':<40}{statistics.median(blocking) * 1e3:>11.1f} ms"
          f"{statistics.median(to_commit) * 1e3:>11.1f} ms")
    print(f"{'  (first save, allocates the buffer)':<40}{ours.call[0] * 1e3:>11.1f} ms"
          f"{ours.committed[0] * 1e3:>11.1f} ms")
    print(f"{'accelerator.save_state(dir)':<40}{statistics.median(theirs_later) * 1e3:>11.1f} ms"
          f"{'(no fsync)':>14}")
    print_table([("accelerate", result["comparison"])])
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
