"""Time the Hugging Face Trainer spends inside its checkpoint call, stock against PipelineTrainer.

The same GPT-2 (about 17M parameters: 68 MB of fp32 weights and 136 MB of AdamW moments by
default) trains on CPU for ``--steps`` steps, saving every ``--save-every``; each variant is a
fresh Trainer in a fresh output directory, in one run. What is timed is the wall time of each
``_save_checkpoint`` call on the training thread: for the stock Trainer the whole save
(``torch.save`` of the model as safetensors, the optimizer, scheduler, RNG, JSON); for
``PipelineTrainer`` the hand-over to the pipeline (the CPU tensors copied into its host
buffer), the writes running in the background. ``train_s`` is the whole ``train()`` call,
which for the pipeline includes waiting for the last save to commit.

    python benchmarks/bench_transformers.py                   # JSON to benchmarks/results/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ckpt_pipeline.integrations.transformers import PipelineTrainer


def timed(base: type[Any]) -> type[Any]:
    class Timed(base):  # type: ignore[misc, valid-type]
        save_seconds: list[float]

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            start = time.perf_counter()
            super()._save_checkpoint(model, trial)
            self.save_seconds.append(time.perf_counter() - start)

    Timed.__name__ = f"Timed{base.__name__}"
    return Timed


def run(base: type[Any], output_dir: str, args: argparse.Namespace) -> dict[str, Any]:
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
        per_device_train_batch_size=2, logging_steps=args.steps, report_to=[], use_cpu=True,
        seed=0, dataloader_num_workers=0, disable_tqdm=True, save_total_limit=2)
    trainer = timed(base)(model=model, args=training, train_dataset=data)
    trainer.save_seconds = []
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    seconds = trainer.save_seconds
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # tied weights once
    state_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    optim_bytes = sum(v.numel() * v.element_size()
                      for s in trainer.optimizer.state_dict()["state"].values()
                      for v in s.values() if isinstance(v, torch.Tensor))
    return {"trainer": base.__name__, "saves": len(seconds), "save_s": seconds,
            "first_save_s": seconds[0], "later_saves_median_s":
                statistics.median(seconds[1:]) if len(seconds) > 1 else None,
            "train_s": train_s, "model_bytes": state_bytes, "optimizer_bytes": optim_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/transformers_ckpt.json"))
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the output directories go (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        results = [run(base, os.path.join(work, base.__name__), args)
                   for base in (Trainer, PipelineTrainer)]
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "torch": torch.__version__},
              "config": vars(args) | {"out": str(args.out), "work_dir": str(args.work_dir)},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    mb = (results[0]["model_bytes"] + results[0]["optimizer_bytes"]) / 1e6
    print(f"state: {mb:.0f} MB (model + AdamW), {args.steps} steps, a save every "
          f"{args.save_every}")
    print(f"{'trainer':<18}{'saves':>6}{'first save s':>14}{'later median s':>16}"
          f"{'train() s':>11}")
    for r in results:
        later = r["later_saves_median_s"]
        print(f"{r['trainer']:<18}{r['saves']:>6}{r['first_save_s']:>14.3f}"
              f"{'n/a' if later is None else f'{later:.3f}':>16}{r['train_s']:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
