"""Train a small FSDP2 model on several ranks with asynchronous checkpoints, and resume it.

Launch it with torchrun, one process per rank (CPU with gloo here; one GPU per rank with NCCL
when CUDA is available)::

    torchrun --nproc-per-node 2 examples/train_distributed.py --fresh   # trains, saving every 50
    torchrun --nproc-per-node 2 examples/train_distributed.py           # resumes at the last step

Every rank opens its own ``cp.CheckpointPipeline``. Because ``torch.distributed`` is initialized,
the pipelines coordinate: a step is committed only when every rank's shard is durable, and
``restore_latest`` brings every rank back to the same step. The coordination runs on a gloo
group of the pipeline's own, so it never waits behind the NCCL streams of training.

By default each rank checkpoints into its own root, ``<root>/rank-<r>``, as it would on the
node-local disk of a multi-node job; ``--shared-root`` puts every rank's files under one root,
as on one node or a shared file system. Each rank only ever touches its own files.

As in ``examples/train_resume.py``, everything that decides a step's result is saved or a pure
function of the step: the batch of step ``k`` on rank ``r`` comes from a generator seeded with
``(seed, k, r)``, and dropout draws from each rank's torch generator, whose state each rank's
pipeline captures at ``save()`` and re-applies on restore. ``--loss-log`` (written by rank 0)
records the mean loss over ranks of every step, to compare a resumed run with an uninterrupted
one.

The model is sharded with FSDP2 (``fully_shard``), so its ``state_dict()`` and the optimizer's
hold DTensors: each rank saves its local shard and restores it into the same mesh.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

try:
    import ckpt_pipeline as cp
except ImportError:  # run from a checkout without installing the package
    sys.exit("ckpt_pipeline is not importable: install it first with `pip install -e .`")

IN_FEATURES = 8
WIDTH = 32
DEPTH = 3
TEACHER_HIDDEN = 16
DROPOUT = 0.05
LEARNING_RATE = 3e-3
BATCH_SIZE = 32  # per rank
WARMUP_STEPS = 20


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Read the command line; defaults finish in seconds on two CPU cores."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("checkpoints/train_distributed"),
                        help="checkpoint directory (default: %(default)s)")
    parser.add_argument("--shared-root", action="store_true",
                        help="every rank saves under --root itself, instead of the default "
                             "per-rank roots <root>/rank-<r> (node-local disks)")
    parser.add_argument("--steps", type=_positive_int, default=300,
                        help="train until this step (default: %(default)s)")
    parser.add_argument("--save-every", type=_positive_int, default=50,
                        help="save every N steps, and always at the last one (default: %(default)s)")
    parser.add_argument("--keep-last", type=_positive_int, default=3,
                        help="committed checkpoints kept on disk (default: %(default)s)")
    parser.add_argument("--coordination-timeout", type=_positive_float, default=60.0,
                        metavar="SECONDS",
                        help="how long a rank waits for the others in the pipeline's "
                             "collectives before the save or restore fails (default: %(default)s)")
    parser.add_argument("--replicas", type=int, default=0,
                        help="extra copies of each rank's shard on other nodes (needs that "
                             "many other nodes; default: %(default)s)")
    parser.add_argument("--ranks-per-node", type=_positive_int, default=None,
                        help="pretend every N consecutive ranks are one node (node_name), to "
                             "try --replicas on one machine (default: the host name)")
    parser.add_argument("--parallel", choices=("fsdp2", "ddp"), default="fsdp2",
                        help="shard the model with FSDP2 (DTensor state) or replicate it with "
                             "DDP (plain tensors, a full copy per rank) (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model, the data and dropout (default: %(default)s)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto picks CUDA (NCCL) when available, else CPU (gloo) "
                             "(default: %(default)s)")
    parser.add_argument("--loss-log", type=Path, default=None,
                        help="rank 0 appends `step loss` per step (mean over ranks, as "
                             "float.hex()) to this file")
    parser.add_argument("--sleep-per-step", type=float, default=0.0, metavar="SECONDS",
                        help="slow training down, to have time to interrupt it (default: 0)")
    parser.add_argument("--fresh", action="store_true",
                        help="delete the checkpoints (each rank its own) and the loss log first")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per line instead of text, for scripts")
    parser.add_argument("--verbose", action="store_true",
                        help="show the pipeline's info-level log events on stderr")
    return parser.parse_args(argv)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


class Reporter:
    """Prints progress on rank 0 only, as sentences for a person or as JSON lines for a script."""

    def __init__(self, as_json: bool, rank: int) -> None:
        self.as_json = as_json
        self.enabled = rank == 0

    def __call__(self, event: str, text: str, **fields: Any) -> None:
        if not self.enabled:
            return
        line = json.dumps({"event": event, **fields}) if self.as_json else text
        print(line, flush=True)


def configure_logging(verbose: bool) -> None:
    """Show the pipeline's log lines on stderr: every commit and restore with ``--verbose``,
    else only warnings and errors.

    The library is silent until asked (stdlib logging, logger ``ckpt_pipeline``); this is the
    one call that asks. Every rank logs; each line carries the
    rank that emitted it.
    """
    cp.enable_logging(logging.INFO if verbose else logging.WARNING)


def init_distributed(choice: str) -> tuple[int, int, torch.device]:
    """Join the job torchrun started: NCCL on one GPU per rank, or gloo on the CPU."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit("launch this example with torchrun, e.g. "
                 "`torchrun --nproc-per-node 2 examples/train_distributed.py`")
    if choice == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available")
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            sys.exit(f"local rank {local_rank} has no GPU: this node has "
                     f"{torch.cuda.device_count()}; lower --nproc-per-node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


class Teacher:
    """The hidden function the model learns: a fixed random two-layer network plus noise."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        w1 = torch.randn(IN_FEATURES, TEACHER_HIDDEN, generator=generator)
        w2 = torch.randn(TEACHER_HIDDEN, 1, generator=generator)
        self.w1 = w1 / math.sqrt(IN_FEATURES)
        self.w2 = w2 / math.sqrt(TEACHER_HIDDEN)
        self.seed = seed

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step`` on ``rank``: a pure function of (seed, step, rank), on the CPU."""
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 65_537 + rank)
        x = torch.randn(BATCH_SIZE, IN_FEATURES, generator=generator)
        noise = 0.05 * torch.randn(BATCH_SIZE, 1, generator=generator)
        return x, torch.sin(x @ self.w1) @ self.w2 + noise


class Block(nn.Module):
    """A pre-norm residual feed-forward block, as in a transformer layer without attention."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update: torch.Tensor = self.dropout(self.down(nn.functional.gelu(self.up(self.norm(x)))))
        return x + update


class Net(nn.Module):
    """Embedding, ``DEPTH`` residual blocks, a final norm and a scalar head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def build_model(seed: int, device: torch.device, world_size: int, parallel: str) -> nn.Module:
    """The same initial weights on every rank, then sharded (FSDP2) or replicated (DDP).

    FSDP2 shards each block, then the root (embedding, final norm, head). The head's weight has
    one row, so with two ranks one of them holds an empty shard: the checkpoint must handle that
    as well as the even shards.
    """
    torch.manual_seed(seed)
    model = Net().to(device)
    if parallel == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    mesh = init_device_mesh(device.type, (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def warmup_cosine(total_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warm-up, then cosine decay to 10 % at ``total_steps``."""

    def factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = min(1.0, (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return factor


def rewind_loss_log(path: Path, step: int) -> None:
    """Keep only the log lines of steps up to ``step``, the step training resumes after.

    A crashed run may have logged steps past its last committed checkpoint, and may have died
    half-way through a line. Those steps are trained again, so their old lines go.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        fields = line.split()
        if line.endswith("\n") and len(fields) == 2 and int(fields[0]) <= step:
            kept.append(line)
    path.write_text("".join(kept))


def checkpoint_root(args: argparse.Namespace, rank: int) -> Path:
    """Where this rank's pipeline saves: the shared root, or a root of its own."""
    root: Path = args.root
    return root if args.shared_root else root / f"rank-{rank}"


def start_fresh(args: argparse.Namespace, rank: int, pipe_root: Path) -> None:
    """Delete what an earlier run left. Each rank deletes only what it can see and owns.

    With per-rank roots (possibly on different nodes) each rank removes its own; a shared root
    is removed by rank 0 alone. The barrier keeps any rank from opening its pipeline, which
    creates the root, before the deletion is done.
    """
    if not args.shared_root:
        shutil.rmtree(pipe_root, ignore_errors=True)
    if rank == 0:
        if args.shared_root:
            shutil.rmtree(args.root, ignore_errors=True)
        if args.loss_log is not None:
            args.loss_log.unlink(missing_ok=True)
    dist.barrier()


class Timings:
    """This rank's own measurements, gathered on rank 0 at the end."""

    def __init__(self) -> None:
        self.blocking: list[float] = []  # per save: save() plus the wait_snapshot() after it
        self.to_durable: list[float] = []  # per committed save: save() to commit record fsynced
        self._waiting_on_save = False

    def saved(self, seconds: float) -> None:
        self.blocking.append(seconds)
        self._waiting_on_save = True

    def waited(self, seconds: float) -> None:
        if self._waiting_on_save:
            self.blocking[-1] += seconds
            self._waiting_on_save = False

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        """[saves, median to-durable s, median blocking s, max blocking s, total blocking s]."""
        def median(values: list[float]) -> float:
            return statistics.median(values) if values else math.nan

        return torch.tensor([
            float(len(self.to_durable)), median(self.to_durable), median(self.blocking),
            max(self.blocking, default=math.nan), sum(self.blocking),
        ], dtype=torch.float64, device=device)


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> None:
    """Restore what the last run committed on every rank, train to ``args.steps``, save."""
    report = Reporter(args.json, rank)
    pipe_root = checkpoint_root(args, rank)
    if args.fresh:
        start_fresh(args, rank, pipe_root)

    teacher = Teacher(args.seed)
    model = build_model(args.seed, device, world_size, args.parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    torch.manual_seed(args.seed * 1_000_003 + 7_919 * (rank + 1))  # this rank's dropout
    layout = "shared root" if args.shared_root else "per-rank roots"
    timings = Timings()

    node = None if args.ranks_per_node is None else f"node{rank // args.ranks_per_node}"
    with cp.CheckpointPipeline(pipe_root, keep_last=args.keep_last,
                               coordination_timeout_s=args.coordination_timeout,
                               replication=cp.ReplicationConfig(copies=args.replicas,
                                                                node_name=node)) as pipe:
        restored = pipe.restore_latest(state)
        resumed_step = 0 if restored is None else restored.step
        check_same_everywhere(resumed_step, device, "restored step")
        where = (f"{args.root} ({layout}), {world_size} ranks on {device.type}, "
                 f"{args.parallel}")
        if restored is None:
            ts = cp.TrainState()
            report("started", f"started fresh in {where}", root=str(args.root),
                   layout=layout, world_size=world_size, device=device.type,
                   parallel=args.parallel)
        else:
            ts = restored.train_state
            report("resumed", f"resumed from step {restored.step} in {where}",
                   step=restored.step, save_id=restored.save_id, path=restored.path,
                   fetched={str(r): h for r, h in restored.fetched.items()},
                   rejected=[r.step for r in restored.rejected], layout=layout,
                   world_size=world_size, device=device.type, parallel=args.parallel)
            for rejected in restored.rejected:
                report("rejected", f"  rank 0 skipped step {rejected.step}: {rejected.reason}",
                       step=rejected.step, path=rejected.path, reason=rejected.reason)
            for lost, holder in sorted(restored.fetched.items()):
                report("fetched", f"  rank {lost}'s shard came from its copy on rank {holder}",
                       rank=lost, holder=holder)
        if args.loss_log is not None and rank == 0:
            args.loss_log.parent.mkdir(parents=True, exist_ok=True)
            rewind_loss_log(args.loss_log, ts.step)

        first_step = ts.step + 1
        pending: list[cp.SaveHandle] = []
        model.train()
        log_file = (args.loss_log.open("a") if args.loss_log is not None and rank == 0
                    else nullcontext())
        with log_file as log:
            for step in range(first_step, args.steps + 1):
                x, y = (t.to(device) for t in teacher.batch(step, rank))
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                started = time.perf_counter()
                pipe.wait_snapshot()  # a save may still be copying the parameters
                timings.waited(time.perf_counter() - started)
                optimizer.step()
                scheduler.step()

                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss)
                loss_value = mean_loss.item() / world_size
                ts = ts.advanced(step=step, samples=BATCH_SIZE * world_size, loss=loss_value)
                if log is not None:
                    log.write(f"{step} {loss_value.hex()}\n")
                    log.flush()
                if step % args.save_every == 0 or step == args.steps:
                    started = time.perf_counter()
                    pending.append(pipe.save(step, state, ts))
                    timings.saved(time.perf_counter() - started)
                    report("saving", f"step {step}: loss {loss_value:.5f}, saving",
                           step=step, loss=loss_value)
                pending = _collect_committed(pending, report, timings, wait=False)
                if args.sleep_per_step > 0:
                    time.sleep(args.sleep_per_step)

        pipe.wait()
        _collect_committed(pending, report, timings, wait=True)

    trained = max(0, args.steps - first_step + 1)
    final_loss = ts.extra.get("loss")
    loss_text = "n/a" if final_loss is None else f"{final_loss:.5f}"
    if trained:
        text = f"finished at step {ts.step} after {trained} steps; final loss {loss_text}"
    else:
        text = (f"nothing to train: resumed from the checkpoint of step {ts.step}, which is "
                f"already --steps {args.steps}; loss {loss_text}. To train further, run again "
                f"with a larger --steps (e.g. --steps {args.steps + 100})")
    report("finished", text, step=ts.step, trained_steps=trained, loss=final_loss)
    report_summary(timings, report, device, world_size)


def check_same_everywhere(value: int, device: torch.device, what: str) -> None:
    """Stop if the ranks disagree on ``value``: the library promises they never do."""
    values = [torch.zeros(1, dtype=torch.int64, device=device)
              for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.int64, device=device))
    seen = [int(v.item()) for v in values]
    if len(set(seen)) != 1:
        raise SystemExit(f"the ranks disagree on the {what}: {seen} (rank i at index i)")


def _collect_committed(
    pending: list[cp.SaveHandle], report: Reporter, timings: Timings, *, wait: bool
) -> list[cp.SaveHandle]:
    """Record and report the saves that committed; return those still in flight.

    Every rank's handle of a save settles the same way: committed on all ranks, or ``SaveError``
    on all ranks, naming the ranks that failed. ``result()`` re-raises it, which ends the run;
    the previous checkpoint is intact on every rank, and the next run resumes from it.
    """
    still_pending = []
    for handle in pending:
        if not (wait or handle.done()):
            still_pending.append(handle)
            continue
        info = handle.result()
        timings.to_durable.append(info.seconds)
        report("committed",
               f"committed step {info.step}: {info.seconds * 1e3:.0f} ms from "
               f"save() to commit, rank 0 wrote {info.bytes} bytes in {info.path}",
               step=info.step, seconds=info.seconds, bytes=info.bytes, path=str(info.path),
               save_id=info.save_id)
    return still_pending


def report_summary(timings: Timings, report: Reporter, device: torch.device,
                   world_size: int) -> None:
    """Gather every rank's timings on all ranks (a small tensor) and print them on rank 0."""
    mine = timings.as_tensor(device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    rows = [t.tolist() for t in gathered]

    def ms(seconds: float) -> float | None:
        return None if math.isnan(seconds) else round(seconds * 1e3, 3)

    per_rank = [
        {"rank": r, "saves": int(row[0]), "median_to_durable_ms": ms(row[1]),
         "median_blocking_ms": ms(row[2]), "max_blocking_ms": ms(row[3]),
         "total_blocking_ms": ms(row[4])}
        for r, row in enumerate(rows)
    ]
    for entry in per_rank if any(entry["saves"] for entry in per_rank) else []:
        report("rank_timings",
               f"  rank {entry['rank']}: {entry['saves']} saves, blocking in save()+"
               f"wait_snapshot() median {_fmt(entry['median_blocking_ms'])} ms, max "
               f"{_fmt(entry['max_blocking_ms'])} ms; save() to commit median "
               f"{_fmt(entry['median_to_durable_ms'])} ms",
               **entry)
    saves = per_rank[0]["saves"]
    median_save = per_rank[0]["median_to_durable_ms"]
    blocking = [entry["median_blocking_ms"] for entry in per_rank]
    report("summary",
           f"summary: {saves} saves, median {_fmt(median_save)} ms per save (save() to "
           f"commit, rank 0), median blocking ms per rank "
           f"[{', '.join(_fmt(b) for b in blocking)}]",
           saves=saves, median_save_ms=median_save, median_blocking_ms_per_rank=blocking,
           world_size=world_size)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world_size, device = init_distributed(args.device)
    configure_logging(args.verbose)
    try:
        train(args, rank, world_size, device)
    except cp.CheckpointError as exc:
        # The other ranks raise the same error (or wait in a collective until torchrun ends
        # them once this process exits).
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
