"""Train a small transformer with FSDP2, checkpointing as a torchtitan job does, and resume it.

The loop has torchtitan's shape: a config from flags, a decoder-only transformer sharded with
``fully_shard`` (each block, then the root) in bf16 mixed precision, AdamW with a warm-up and
cosine LR schedule, and a checkpoint manager called at torchtitan's points:
``checkpoint.load()`` at start-up, ``checkpoint.maybe_wait_for_staging()`` right before
``optimizer.step()``, ``checkpoint.save(step)`` after every step. The manager here is
``ckpt_pipeline.integrations.torchtitan.PipelineCheckpointManager``: it saves every
``--save-every`` steps and at the last one, asynchronously, and every rank's shard of a step is
committed together. Launch it with torchrun (NCCL on one GPU per rank when the node has a GPU
for each of its ranks, else gloo on the CPU; ``--device`` chooses), or as one plain process::

    torchrun --nproc-per-node 2 examples/train_fsdp2.py --ckpt-dir checkpoints/fsdp2
    torchrun --nproc-per-node 2 examples/train_fsdp2.py --ckpt-dir checkpoints/fsdp2  # resumes
    python examples/train_fsdp2.py --steps 20                                          # one rank

Killed at any moment, the next run resumes from the newest committed step; on the CPU in fp32
its losses (``--loss-log``) continue bit-identically to those of an uninterrupted run. SIGTERM
(a scheduler's preemption, or torchrun passing one on) to any rank is a graceful stop: every
rank finishes the step it is in, and they agree on it (the stop request travels with the
step's loss all-reduce), save it, wait for the commit and exit 0.

The data are synthetic and deterministic: sample ``i`` is a pure function of ``(seed, i)``, and
the position in the stream is the manager's ``train_state.consumed_train_samples``, saved with
every checkpoint, so a resumed run reads the samples the lost one would have read.

``--dtype bf16`` computes in bfloat16 with fp32 gradient reduction
(``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``); it is the
default on CUDA. On the CPU the default is fp32: bf16 runs there too (gloo), but slower than
fp32 on most CPUs, and fp32 is the mode whose resume is checked bit for bit.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

try:
    from ckpt_pipeline.integrations.torchtitan import PipelineCheckpointManager
except ImportError:  # run from a checkout without installing the package
    sys.exit("ckpt_pipeline is not importable: install it first with `pip install -e .`")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The job's config; the defaults train in seconds on two CPU cores."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=_positive_int, default=100,
                        help="train until this step (default: %(default)s)")
    parser.add_argument("--save-every", type=_positive_int, default=20,
                        help="checkpoint interval in steps; the last step is always saved "
                             "(default: %(default)s)")
    parser.add_argument("--keep-last", type=_positive_int, default=3,
                        help="committed checkpoints kept (default: %(default)s)")
    parser.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints/train_fsdp2"),
                        help="checkpoint root, shared by the ranks (default: %(default)s)")
    parser.add_argument("--dim", type=_positive_int, default=64,
                        help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=_positive_int, default=2,
                        help="decoder blocks (default: %(default)s)")
    parser.add_argument("--heads", type=_positive_int, default=4,
                        help="attention heads; must divide --dim (default: %(default)s)")
    parser.add_argument("--vocab-size", type=_positive_int, default=256,
                        help="tokens in the vocabulary (default: %(default)s)")
    parser.add_argument("--seq-len", type=_positive_int, default=32,
                        help="tokens per sample (default: %(default)s)")
    parser.add_argument("--batch-size", type=_positive_int, default=8,
                        help="samples per rank and step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="peak learning rate (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="linear warm-up steps, then cosine decay (default: %(default)s)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA when this node has a GPU for each of its ranks, "
                             "else the CPU (default: %(default)s)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                        help="compute dtype: bf16 (fp32 reductions) or fp32 (default: bf16 on "
                             "CUDA, fp32 on the CPU)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and the data (default: %(default)s)")
    parser.add_argument("--loss-log", type=Path, default=None,
                        help="rank 0 appends `step loss` per step (mean over ranks, "
                             "float.hex()) to this file")
    parser.add_argument("--sleep-per-step", type=float, default=0.0, metavar="SECONDS",
                        help="slow training down, to have time to interrupt it (default: 0)")
    parser.add_argument("--fresh", action="store_true",
                        help="delete the checkpoints and the loss log first")
    args = parser.parse_args(argv)
    if args.dim % args.heads:
        parser.error(f"--heads {args.heads} does not divide --dim {args.dim}")
    return args


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def init_distributed(choice: str) -> tuple[int, int, torch.device]:
    """Join torchrun's job (NCCL on one GPU per rank, or gloo on the CPU), or, started as a
    plain process, make a one-rank group so that the same FSDP2 code runs. ``choice``:
    ``cuda``, ``cpu``, or ``auto`` (CUDA when this node has a GPU for each of its ranks)."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if torchrun else 0
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torchrun else 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = choice == "cuda" or (choice == "auto" and gpus >= local_ranks)
    if use_cuda and gpus < local_ranks:
        raise SystemExit(f"--device cuda needs a GPU for each of this node's {local_ranks} "
                         f"ranks; it has {gpus}: start fewer ranks, or use --device cpu")
    if choice == "auto" and 0 < gpus < local_ranks and local_rank == 0:
        print(f"{local_ranks} ranks on this node and {gpus} GPU(s): training on the CPU "
              f"(gloo)", flush=True)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if use_cuda else "gloo"
    if torchrun:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
                   for t in self.wqkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        result: torch.Tensor = self.wo(out.transpose(1, 2).reshape(batch, seq, dim))
        return result


class FeedForward(nn.Module):
    """The SwiGLU MLP of Llama-style blocks."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        hidden = 4 * dim
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return result


class Block(nn.Module):
    """A pre-norm decoder block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        result: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return result


class Transformer(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm, an untied output head."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.seq_len, args.dim)
        self.layers = nn.ModuleList(Block(args.dim, args.heads) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        logits: torch.Tensor = self.output(self.norm(h))
        return logits


def build_model(args: argparse.Namespace, device: torch.device, world_size: int) -> nn.Module:
    """The same initial weights on every rank, then sharded: each block, then the root."""
    torch.manual_seed(args.seed)
    model = Transformer(args).to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.dtype == "bf16" else MixedPrecisionPolicy())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


class SyntheticTokens:
    """A stream of learnable token sequences; sample ``i`` is a pure function of (seed, i).

    Each sample counts from a random start by a random stride (mod the vocabulary), with a
    few tokens replaced by noise: the next token is predictable from the previous two.
    """

    def __init__(self, seed: int, vocab_size: int, seq_len: int) -> None:
        self.seed, self.vocab_size, self.seq_len = seed, vocab_size, seq_len

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=generator))
        stride = int(torch.randint(1, 8, (1,), generator=generator))
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        noisy = torch.rand(self.seq_len + 1, generator=generator) < 0.05
        noise = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator)
        return torch.where(noisy, noise, tokens)

    def batch(self, position: int, batch_size: int, rank: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets of the global batch that starts at ``position``."""
        first = position + rank * batch_size
        rows = torch.stack([self.sample(first + j) for j in range(batch_size)]).to(device)
        return rows[:, :-1], rows[:, 1:]


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warm-up, then cosine decay to 10 % at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return factor


class StopRequest:
    """Records a SIGTERM instead of dying of it: the loop finishes the step, saves, exits 0.

    A second SIGTERM (torchrun passes the one it receives on to its workers) changes nothing;
    a stuck job is still ended by torchrun's SIGKILL after its grace period, or by SIGKILL.
    """

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def rewind_loss_log(path: Path, step: int) -> None:
    """Keep only the complete log lines of steps up to ``step``, where training resumes:
    a killed run may have logged steps past its last commit, which are trained again."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n") and len(line.split()) == 2 and int(line.split()[0]) <= step]
    path.write_text("".join(kept))


def say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> str:
    """Resume from the newest committed step, train to ``args.steps``; returns how it ended."""
    stop = StopRequest()
    if args.fresh:
        if rank == 0:
            shutil.rmtree(args.ckpt_dir, ignore_errors=True)
            if args.loss_log is not None:
                args.loss_log.unlink(missing_ok=True)
        dist.barrier()

    model = build_model(args, device, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(args.warmup_steps, args.steps))
    data = SyntheticTokens(args.seed, args.vocab_size, args.seq_len)
    global_batch = args.batch_size * world_size
    states = {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler}

    with PipelineCheckpointManager(args.ckpt_dir, states, interval=args.save_every,
                                   keep_last=args.keep_last) as checkpoint:
        if checkpoint.load():
            say(rank, f"resumed at step {checkpoint.train_state.step} from {args.ckpt_dir}")
        else:
            say(rank, f"started fresh in {args.ckpt_dir}: {world_size} ranks on "
                      f"{device.type}, {args.dtype}")
        if args.loss_log is not None and rank == 0:
            args.loss_log.parent.mkdir(parents=True, exist_ok=True)
            rewind_loss_log(args.loss_log, checkpoint.train_state.step)

        ended = f"finished at step {checkpoint.train_state.step}"
        model.train()
        log_file = (args.loss_log.open("a") if args.loss_log is not None and rank == 0
                    else nullcontext())
        with log_file as log:
            for step in range(checkpoint.train_state.step + 1, args.steps + 1):
                position = checkpoint.train_state.consumed_train_samples
                inputs, targets = data.batch(position, args.batch_size, rank, device)
                logits = model(inputs)
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                loss.backward()
                checkpoint.maybe_wait_for_staging()  # a save may still be copying the weights
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

                # One all-reduce carries the loss and the stop request: every rank sees the
                # same sum, so every rank stops after the same step.
                shared = torch.stack([loss.detach(),
                                      torch.tensor(float(stop.requested), device=device)])
                dist.all_reduce(shared)
                loss_value, stopping = shared[0].item() / world_size, shared[1].item() > 0
                if log is not None:
                    log.write(f"{step} {loss_value.hex()}\n")
                    log.flush()
                last_step = stopping or step == args.steps
                if checkpoint.save(step, last_step, samples=global_batch, loss=loss_value):
                    say(rank, f"step {step}: loss {loss_value:.4f}, saving")
                if stopping:
                    ended = f"stopped at step {step} on SIGTERM, its checkpoint committed"
                    break
                ended = f"finished at step {step}"
                if args.sleep_per_step > 0:
                    time.sleep(args.sleep_per_step)
    return ended


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world_size, device = init_distributed(args.device)
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    ended = train(args, rank, world_size, device)
    say(rank, ended)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
