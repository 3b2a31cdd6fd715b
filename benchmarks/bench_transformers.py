"""Time the Hugging Face Trainer spends inside its checkpoint call, stock against PipelineTrainer.

The same GPT-2 trains for ``--steps`` steps, saving every ``--save-every``, on the CPU or
(``--device cuda``) on one GPU; each variant is a fresh Trainer in a fresh output directory,
in one run. By default the model has about 17M parameters on the CPU (68 MB of fp32 weights
and 136 MB of AdamW moments) and about 84M on CUDA (a state of about 1 GB). What is timed is
the wall time of each ``_save_checkpoint`` call on the training thread: for the stock Trainer
the whole save (the model as safetensors, the optimizer with ``torch.save``, scheduler, RNG,
JSON; on CUDA each tensor is copied to the host first); for ``PipelineTrainer`` the hand-over
to the pipeline (the CPU tensors copied into its host buffer, or the CUDA copies queued), the
writes running in the background. After each of its saves the pipeline's ``wait_snapshot()``
and (on CUDA) the copies' completion are timed too, then the commit is waited for, so that no
save finds the previous one still writing; ``_call_timing.py`` says what each figure is.
``train_s`` is the whole ``train()`` call.

    python benchmarks/bench_transformers.py                   # JSON to benchmarks/results/
    python3 benchmarks/bench_transformers.py --device cuda --out /tmp/transformers_ckpt_cuda.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _call_timing import DEVICES, CallTimer, comparison, print_table, resolve_device
from _machine import machine_info
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ckpt_pipeline.integrations.transformers import PipelineTrainer, PipelineTrainerMixin

SIZES = {"cpu": {"layers": 4, "width": 512}, "cuda": {"layers": 6, "width": 1024}}
"""The default model per device: about 200 MB of state on the CPU, about 1 GB on CUDA."""


def timed(base: type[Any]) -> type[Any]:
    class Timed(base):  # type: ignore[misc, valid-type]
        timer: CallTimer

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            save = functools.partial(super()._save_checkpoint, model, trial)
            if not isinstance(self, PipelineTrainerMixin):
                self.timer.time_call(save)
                return
            # checkpoint_pipeline opens the pipeline on first use: inside the timed call.
            self.timer.time_call(save, lambda: self.checkpoint_pipeline.wait_snapshot())
            self.checkpoint_pipeline.wait()
            self.timer.mark_committed()

    Timed.__name__ = f"Timed{base.__name__}"
    return Timed


def run(base: type[Any], output_dir: str, args: argparse.Namespace,
        device: torch.device) -> tuple[dict[str, Any], CallTimer]:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=8, vocab_size=args.vocab,
                        n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(64):
        ids = torch.randint(0, args.vocab, (32,), generator=generator)
        data.append({"input_ids": ids, "labels": ids.clone()})
    training = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, save_steps=args.save_every,
        per_device_train_batch_size=2, logging_steps=args.steps, report_to=[],
        use_cpu=device.type == "cpu", seed=0, dataloader_num_workers=0, disable_tqdm=True,
        save_total_limit=2)
    trainer = timed(base)(model=model, args=training, train_dataset=data)
    trainer.timer = CallTimer(device)
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    seconds = trainer.timer.call
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # tied weights once
    state_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    optim_bytes = sum(v.numel() * v.element_size()
                      for s in trainer.optimizer.state_dict()["state"].values()
                      for v in s.values() if isinstance(v, torch.Tensor))
    result = {"trainer": base.__name__, "device": str(model.device), "saves": len(seconds),
              "save_s": seconds, "first_save_s": seconds[0], "later_saves_median_s":
                  statistics.median(seconds[1:]) if len(seconds) > 1 else None,
              "train_s": train_s, "model_bytes": state_bytes, "optimizer_bytes": optim_bytes}
    return result, trainer.timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/transformers_ckpt.json"))
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the output directories go (default: a temporary one)")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the model, the optimizer state and the training run")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer blocks (default 4 on the CPU, 6 on CUDA)")
    parser.add_argument("--width", type=int, default=None,
                        help="embedding width (default 512 on the CPU, 1024 on CUDA)")
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    for name, value in SIZES[device.type].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        machine = machine_info(Path(work), gpu=device.type == "cuda")
        runs = [run(base, os.path.join(work, base.__name__), args, device)
                for base in (Trainer, PipelineTrainer)]
    results = [result for result, _ in runs]
    (_, stock), (_, ours) = runs
    state_bytes = results[0]["model_bytes"] + results[0]["optimizer_bytes"]
    report: dict[str, Any] = {
        "benchmark": "bench_transformers", "device": device.type, "machine": machine,
        "config": vars(args) | {"out": str(args.out), "work_dir": str(args.work_dir)},
        "results": results,
        "comparison": comparison(ours, stock, ours_name="PipelineTrainer",
                                 default_name="Trainer", state_bytes=state_bytes)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"state: {state_bytes / 1e6:.0f} MB (model + AdamW) on {device.type}, {args.steps} "
          f"steps, a save every {args.save_every}")
    print(f"{'trainer':<18}{'saves':>6}{'first save s':>14}{'later median s':>16}"
          f"{'train() s':>11}")
    for r in results:
        later = r["later_saves_median_s"]
        print(f"{r['trainer']:<18}{r['saves']:>6}{r['first_save_s']:>14.3f}"
              f"{'n/a' if later is None else f'{later:.3f}':>16}{r['train_s']:>11.2f}")
    print_table([("transformers", report["comparison"])])
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
