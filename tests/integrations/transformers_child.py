"""A tiny GPT-2 trained by ``PipelineTrainer`` on CPU: the builders the tests share, and a
script the kill test runs as a child process.

``python transformers_child.py OUTPUT_DIR LOSS_LOG [--resume] [--hold-at STEP READY_FILE]``
trains to ``MAX_STEPS``, appending ``step loss.hex()`` per logged step to ``LOSS_LOG`` (started
by torchrun: ``LOSS_LOG`` with the suffix ``.rankR``, a log a rank). With
``--hold-at``, once step ``STEP`` has ended it waits for the saves in flight to commit, writes
``READY_FILE`` (the newest committed step) and blocks until it is killed; a rank started by
torchrun first writes its pid to ``READY_FILE`` with the suffix ``.pidR``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from ckpt_pipeline.integrations.transformers import PipelineTrainer

SEED = 1234
VOCAB = 64
SEQ = 16
SAMPLES = 48
BATCH = 4
MAX_STEPS = 18          # 12 steps an epoch: the run crosses an epoch boundary
SAVE_STEPS = 5


def build_model(attn_implementation: str | None = None) -> GPT2LMHeadModel:
    """Two layers of width 32, dropout on (its RNG must be restored for exact losses).
    ``attn_implementation``: the model's attention kernels (``"eager"``: plain matmuls and
    softmax, no fused kernel whose backward may accumulate with atomics); None: the default."""
    torch.manual_seed(SEED)
    chosen = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                        bos_token_id=0, eos_token_id=0, **chosen)
    return GPT2LMHeadModel(config)


def build_dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED + 1)
    rows = []
    for _ in range(SAMPLES):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def build_args(output_dir: str | os.PathLike[str], **overrides: Any) -> TrainingArguments:
    options: dict[str, Any] = dict(
        output_dir=os.fspath(output_dir), max_steps=MAX_STEPS, save_steps=SAVE_STEPS,
        per_device_train_batch_size=BATCH, logging_steps=1, report_to=[], use_cpu=True,
        seed=SEED, dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-3,
        lr_scheduler_type="linear", warmup_steps=3, save_total_limit=2)
    options.update(overrides)
    return TrainingArguments(**options)


def build_trainer(output_dir: str | os.PathLike[str], *, callbacks: list[Any] | None = None,
                  trainer_cls: type[Any] = PipelineTrainer,
                  attn_implementation: str | None = None, **overrides: Any) -> Any:
    """A trainer of ``build_model(attn_implementation)``; ``overrides`` go to
    ``TrainingArguments`` (``use_cpu=False`` trains on CUDA)."""
    args = build_args(output_dir, **overrides)
    return trainer_cls(model=build_model(attn_implementation), args=args,
                       train_dataset=build_dataset(), callbacks=callbacks)


def losses(trainer: Any) -> dict[int, float]:
    """The loss of every logged step of this ``train()`` call (logging_steps=1)."""
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history
            if "loss" in entry}


class LossLog(TrainerCallback):
    """Appends ``step loss.hex()`` to a file at every log, flushed: what a killed run logged."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        if logs and "loss" in logs:
            with self.path.open("a") as out:
                out.write(f"{state.global_step} {float(logs['loss']).hex()}\n")
                out.flush()
                os.fsync(out.fileno())


class StopAt(TrainerCallback):
    """Ends training after ``step`` (a crash without the crash: no save at that step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


class HoldAt(TrainerCallback):
    """At the end of ``step``: wait for the commits, say which step is newest, block."""

    def __init__(self, step: int, ready: Path) -> None:
        self.step = step
        self.ready = ready
        self.trainer: Any = None

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            pipe = self.trainer.checkpoint_pipeline
            pipe.wait()
            if "RANK" in os.environ:  # torchrun's ranks: the test kills each by its pid
                self.ready.with_suffix(f".pid{os.environ['RANK']}").write_text(str(os.getpid()))
            tmp = self.ready.with_suffix(f".tmp{os.getpid()}")  # several ranks write it
            tmp.write_text(str(pipe.latest_step()))
            tmp.rename(self.ready)
            threading.Event().wait()  # until SIGKILL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("loss_log", type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold-at", nargs=2, default=None)
    options = parser.parse_args(argv)
    if "RANK" in os.environ:  # one of several ranks (torchrun): a log of its own
        options.loss_log = options.loss_log.with_suffix(f".rank{os.environ['RANK']}")
    callbacks: list[Any] = [LossLog(options.loss_log)]
    hold = None
    if options.hold_at is not None:
        hold = HoldAt(int(options.hold_at[0]), Path(options.hold_at[1]))
        callbacks.append(hold)
    trainer = build_trainer(options.output_dir, callbacks=callbacks)
    if hold is not None:
        hold.trainer = trainer
    trainer.train(resume_from_checkpoint=True if options.resume else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
