"""One rank of ``bench_reshard.py``: save the benchmark's state, or restore it once.

``bench_reshard.py`` forks each rank from its own process, where this module is already
imported (so that a job of ranks starts in a second, not in the tens of seconds that four
processes importing torch take on two busy cores), with the environment ``torchrun`` would
set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); run as a script with that environment it
does the same::

    python benchmarks/_reshard_worker.py save --total-bytes B --ckpt-root DIR --dcp-root DIR --out F
    python benchmarks/_reshard_worker.py restore --lib ckpt_pipeline --root DIR --saved-world N \
        --total-bytes B --out F

The state (``layout``): 16 float32 matrices of 1024 columns, each a DTensor ``Shard(0)`` on a
1-D CPU mesh of every rank, most with row counts that divide by neither 2 nor 4, in
``{"tensors": {...}}``; and ``{"model": ...}``, four ``nn.Linear(1024, rows)`` layers sharded
with FSDP2's ``fully_shard`` (weights and biases, uneven rows too): a quarter of the bytes.
Every element is a function of its tensor's seed and its index in the full tensor
(``expected_values``), so a rank computes the values of its own slice, at any world size,
without the full tensor.

``save``: ckpt_pipeline saves step 1 into ``--ckpt-root`` (a ``CheckpointPipeline`` on the
default gloo group), then ``dcp.save`` into ``--dcp-root``.

``restore``: a zeroed live state of this world size, then one restore, timed between
barriers: ``CheckpointPipeline(...).restore_latest(state)`` (the pipeline opened before the
timer, its ``open_s`` reported apart), or DCP's recipe for FSDP2: ``get_model_state_dict``,
``dcp.load`` of it and the tensors in place, ``set_model_state_dict`` (each part timed). The
peak resident memory of the call: VmHWM, reset before it through ``/proc/self/clear_refs``
(``5``) where that is allowed. Every element of every local shard is then compared with
``expected_values``, bit for bit. ``--out`` gets the figures as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # DTensor's first op imports it: once here, not in every rank
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

try:
    import ckpt_pipeline as cp
except ImportError:  # a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ckpt_pipeline as cp

LIBRARY_FILE = cp.__file__
"""Where ``ckpt_pipeline`` was imported from (a checkout, an archive of one, or installed)."""
COLS = 1024
TENSORS = 16
LAYERS = 4
_ROW_SHIFTS = (0, 1, -1, 3)  # a row count of 4k, 4k+1, 4k-1, 4k+3: uneven over 2 and 4 ranks
_CHUNK = 1 << 22  # elements computed at a time by expected_values' callers


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the state: where it lives, its full shape and the seed of its values."""

    group: str  # "tensors" or "model"
    name: str
    shape: tuple[int, ...]
    seed: int

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return 4 * count


def layout(total_bytes: int) -> list[TensorSpec]:
    """The state's tensors for about ``total_bytes``: three quarters in 16 matrices, one
    quarter in the model's four layers."""
    per_tensor = total_bytes * 3 // 4 // TENSORS
    base = max(8, per_tensor // (4 * COLS) // 4 * 4)
    specs = [TensorSpec("tensors", f"t{i:02d}", (base + _ROW_SHIFTS[i % 4], COLS), i)
             for i in range(TENSORS)]
    per_layer = total_bytes // 4 // LAYERS
    rows = max(8, per_layer // (4 * (COLS + 1)) // 4 * 4)
    for j in range(LAYERS):
        layer_rows = rows + _ROW_SHIFTS[(j + 1) % 4]
        specs.append(TensorSpec("model", f"layers.{j}.weight", (layer_rows, COLS), 100 + 2 * j))
        specs.append(TensorSpec("model", f"layers.{j}.bias", (layer_rows,), 101 + 2 * j))
    return specs


def rows_of(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [start, end) of ``Shard(0)`` on ``rank`` of ``world``: torch.chunk's split,
    which DTensor and FSDP2 use."""
    per = -(-rows // world)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


def expected_values(first: int, count: int, seed: int) -> torch.Tensor:
    """The float32 values of elements [first, first + count) of the full tensor of ``seed``:
    30 bits of an odd multiple of the index (distinct for every element of a tensor of up to
    2**30) plus the seed's offset, laid out as a finite, normal float32."""
    x = torch.arange(first, first + count, dtype=torch.int32)
    x.mul_(0x2545F491).add_((seed * 0x9E3779B + 0x6F4A7C15) & 0x7FFFFFFF)
    bits = ((x >> 23) & 0x7F).add_(0x40).bitwise_left_shift_(23).bitwise_or_(x & 0x7FFFFF)
    return bits.view(torch.float32)


def _flat_offset(spec: TensorSpec, world: int, rank: int) -> tuple[int, int]:
    start, end = rows_of(spec.shape[0], world, rank)
    inner = spec.nbytes // 4 // spec.shape[0]
    return start * inner, (end - start) * inner


def fill(local: torch.Tensor, spec: TensorSpec, world: int, rank: int) -> None:
    """Write this rank's slice of ``spec``'s values into ``local``."""
    first, count = _flat_offset(spec, world, rank)
    flat = local.view(-1)
    for at in range(0, count, _CHUNK):
        n = min(_CHUNK, count - at)
        flat[at:at + n] = expected_values(first + at, n, spec.seed)


def mismatch(local: torch.Tensor, spec: TensorSpec, world: int, rank: int) -> str | None:
    """Why ``local`` is not this rank's slice of ``spec``'s values, or None."""
    start, end = rows_of(spec.shape[0], world, rank)
    if tuple(local.shape) != (end - start, *spec.shape[1:]):
        return f"{spec.name}: local shape {tuple(local.shape)}, expected rows {start}-{end}"
    first, count = _flat_offset(spec, world, rank)
    flat = local.contiguous().view(-1)
    for at in range(0, count, _CHUNK):
        n = min(_CHUNK, count - at)
        if not torch.equal(flat[at:at + n], expected_values(first + at, n, spec.seed)):
            return f"{spec.name}: elements {first + at}-{first + at + n} differ"
    return None


class Layers(torch.nn.Module):
    """The model part of the state: four Linear layers (never run, only sharded and saved)."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(COLS, n) for n in rows)


def build(specs: list[TensorSpec], values: bool) -> tuple[Layers, dict[str, Any]]:
    """This rank's state on a 1-D mesh of every rank: the saved values (``values``) or zeros."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    tensors: dict[str, Any] = {}
    for spec in specs:
        if spec.group != "tensors":
            continue
        start, end = rows_of(spec.shape[0], world, rank)
        local = torch.zeros((end - start, *spec.shape[1:]))
        if values:
            fill(local, spec, world, rank)
        tensors[spec.name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(spec.shape),
            stride=torch.empty(spec.shape, device="meta").stride())
    weights = [s for s in specs if s.group == "model" and s.name.endswith(".weight")]
    with torch.device("meta"):
        model = Layers([s.shape[0] for s in weights])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    by_name = {s.name: s for s in specs if s.group == "model"}
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = _local(param)
            local.zero_()
            if values:
                fill(local, by_name[name], world, rank)
    return model, tensors


def _local(t: Any) -> torch.Tensor:
    """A DTensor's (or a DTensor parameter's) local shard."""
    local: torch.Tensor = t.to_local()
    return local


def check(specs: list[TensorSpec], model: torch.nn.Module, tensors: dict[str, Any]) -> list[str]:
    """Every local shard against its expected values: the names that differ, with why."""
    world, rank = dist.get_world_size(), dist.get_rank()
    locals_ = {name: _local(t) for name, t in tensors.items()}
    locals_.update({name: _local(p) for name, p in model.named_parameters()})
    problems = []
    for spec in specs:
        got = locals_.get(spec.name)
        why = f"{spec.name}: missing" if got is None else mismatch(got, spec, world, rank)
        if why:
            problems.append(why)
    return problems


def _status_kib(key: str) -> int | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (``/proc/self/clear_refs``); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def save(args: argparse.Namespace, specs: list[TensorSpec]) -> dict[str, Any]:
    model, tensors = build(specs, values=True)
    dist.barrier()
    started = time.perf_counter()
    with cp.CheckpointPipeline(args.ckpt_root, coordination_timeout_s=args.timeout_s) as pipe:
        pipe.save(1, {"model": model, "tensors": tensors},
                  cp.TrainState(step=1)).result(args.timeout_s)
    ckpt_s = time.perf_counter() - started
    dist.barrier()
    started = time.perf_counter()
    dcp_state = {"model": get_model_state_dict(model), "tensors": tensors}
    dcp.save(dcp_state, checkpoint_id=args.dcp_root)  # type: ignore[attr-defined]
    dcp_s = time.perf_counter() - started
    return {"ckpt_pipeline_save_s": ckpt_s, "dcp_save_s": dcp_s}


def _profiler() -> Any:
    """A started ``cProfile.Profile`` of the timed call where ``CKPT_BENCH_PROFILE`` names a
    path prefix (the stats go to PREFIX.LIB.RANK; the figures are then not comparable)."""
    if not os.environ.get("CKPT_BENCH_PROFILE"):
        return None
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile


class _Sampler:
    """Where every thread of the process is, every ``CKPT_BENCH_SAMPLE_MS`` (default 2 ms)
    while the timed call runs (``sys._current_frames``): for each sample, each thread's
    innermost frame in ckpt_pipeline or torch (else its innermost frame), counted by
    ``file:function``; written to ``CKPT_BENCH_SAMPLE``.LIB.NtoM.RANK.json (N the saved
    world size, M this one; the DCP case's N is its --saved-world too). Made for the 16-core
    GPU host, where py-spy is not there; the sampling thread holds the GIL for each sample,
    so the figures are then not comparable with unsampled ones."""

    def __init__(self) -> None:
        import threading

        self.period = float(os.environ.get("CKPT_BENCH_SAMPLE_MS", "2")) / 1e3
        self.counts: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _where(frame: Any) -> str:
        inner = frame
        while frame is not None:
            name = frame.f_code.co_filename
            if "ckpt_pipeline" in name or "/torch/" in name:
                inner = frame
                break
            frame = frame.f_back
        code = inner.f_code
        parts = code.co_filename.split("/")
        return f"{'/'.join(parts[-2:])}:{code.co_name}"

    def _run(self) -> None:
        import threading

        me = threading.get_ident()
        while not self._stop.wait(self.period):
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    key = self._where(frame)
                    self.counts[key] = self.counts.get(key, 0) + 1

    def dump(self, lib: str, case: str, rank: int) -> None:
        self._stop.set()
        self._thread.join()
        top = sorted(self.counts.items(), key=lambda kv: -kv[1])[:60]
        with open(f"{os.environ['CKPT_BENCH_SAMPLE']}.{lib}.{case}.{rank}.json", "w") as f:
            json.dump({"samples": self.samples, "period_s": self.period, "top": top}, f,
                      indent=0)


_PHASES = (  # (module, attribute): what CKPT_BENCH_PHASES times inside restore_latest
    ("ckpt_pipeline._restore.recovery", "Recovery.load_latest"),
    ("ckpt_pipeline._restore.recovery", "Recovery.apply"),
    ("ckpt_pipeline._restore.recovery", "Recovery.finish"),
    ("ckpt_pipeline._restore.reshard", "reshard_latest"),
    ("ckpt_pipeline._restore.reshard", "_load"),
    ("ckpt_pipeline._restore.reshard", "_plan"),
    ("ckpt_pipeline._restore.reshard", "read_group"),
    ("ckpt_pipeline._restore.reshard", "validate_state"),
    ("ckpt_pipeline._restore.reshard", "prefetch_backup"),
    ("ckpt_pipeline._restore.inplace", "_Entry.before"),
    ("ckpt_pipeline._restore.recovery", "apply_state"),
    ("ckpt_pipeline._restore.sourcing", "Sourcing.load"),
    ("ckpt_pipeline._reshard.ranges", "ShardRanges.read_blocks"),
    ("ckpt_pipeline._reshard.ranges", "checksum"),
    ("ckpt_pipeline._reshard.ranges", "_Staging.copy"),
    ("ckpt_pipeline._restore.rollback", "AppliedState.release"),
    ("ckpt_pipeline._pipeline.pool_prep", "PoolPrep.from_state"),
    ("ckpt_pipeline._save.buffers", "HostPool._build"),
    ("ckpt_pipeline._pipeline.lifecycle", "AsyncCheckpointPipeline.finish_restore"),
)


def _time_phases() -> dict[str, list[tuple[float, float, float]]]:
    """With ``CKPT_BENCH_PHASES`` set: wrap each of ``_PHASES`` (where it exists) so that
    every call's (start, end, thread CPU seconds) is recorded; ``_phase_summary`` turns them
    into figures."""
    import functools
    import importlib
    import inspect

    spans: dict[str, list[tuple[float, float, float]]] = {}
    for module_name, attr in _PHASES:
        owner: Any = importlib.import_module(module_name)
        *outer, name = attr.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue
        record = spans.setdefault(attr, [])

        def wrap(fn: Any, record: list[tuple[float, float, float]]) -> Any:
            if inspect.iscoroutinefunction(fn):  # CPU seconds: not this thread's alone
                @functools.wraps(fn)
                async def timed_async(*a: Any, **k: Any) -> Any:
                    at = time.perf_counter()
                    try:
                        return await fn(*a, **k)
                    finally:
                        record.append((at, time.perf_counter(), float("nan")))
                return timed_async

            @functools.wraps(fn)
            def timed(*a: Any, **k: Any) -> Any:
                at, cpu = time.perf_counter(), time.thread_time()
                try:
                    return fn(*a, **k)
                finally:
                    record.append((at, time.perf_counter(), time.thread_time() - cpu))
            return timed

        setattr(owner, name, wrap(fn, record))
    return spans


def _phase_summary(spans: dict[str, list[tuple[float, float, float]]], started: float
                   ) -> dict[str, Any]:
    """Per phase: calls, the sum of their seconds (over threads), the sum of the calling
    threads' CPU seconds in them (``time.thread_time``; nested phases count in each), and
    the first start and last end after ``started``."""
    return {name: {"calls": len(v), "sum_s": sum(b - a for a, b, _ in v),
                   "cpu_s": sum(c for _, _, c in v),
                   "first_start_s": min(a for a, _, _ in v) - started,
                   "last_end_s": max(b for _, b, _ in v) - started}
            for name, v in spans.items() if v}


def restore(args: argparse.Namespace, specs: list[TensorSpec]) -> dict[str, Any]:
    built = time.monotonic()
    model, tensors = build(specs, values=False)
    out: dict[str, Any] = {"build_s": time.monotonic() - built}
    share = sum(_local(t).numel() * 4 for t in [*tensors.values(), *model.parameters()])
    out["share_bytes"] = share
    with contextlib.ExitStack() as stack:
        if args.lib == "ckpt_pipeline":
            dist.barrier()
            started = time.perf_counter()
            threads = int(os.environ.get("CKPT_BENCH_IO_THREADS", "0"))  # 0: the default
            extra: dict[str, Any] = {"io_threads": threads} if threads else {}
            pipe = stack.enter_context(cp.CheckpointPipeline(
                args.root, coordination_timeout_s=args.timeout_s, **extra))
            out["open_s"] = time.perf_counter() - started
            state: dict[str, Any] = {"model": model, "tensors": tensors}

            def call() -> None:
                result = pipe.restore_latest(state)
                out["restored_step"] = None if result is None else result.step
                out["resharded_from"] = None if result is None else result.resharded_from
                out["bytes_read"] = None if result is None else result.bytes
        else:
            state = {"tensors": tensors}

            def call() -> None:  # DCP's recipe for FSDP2: get, load in place, set
                at = time.perf_counter()
                state["model"] = get_model_state_dict(model)
                out["dcp_state_dict_s"], at = time.perf_counter() - at, time.perf_counter()
                dcp.load(state, checkpoint_id=args.root)  # type: ignore[attr-defined]
                out["dcp_load_s"], at = time.perf_counter() - at, time.perf_counter()
                set_model_state_dict(model, state["model"])
                out["dcp_set_s"] = time.perf_counter() - at
        gc.collect()
        dist.barrier()
        out["rss_before_kib"] = _status_kib("VmRSS")
        out["peak_reset"] = _reset_peak()
        out["hwm_before_kib"] = _status_kib("VmHWM")
        dist.barrier()
        profile = _profiler()
        sampler = _Sampler() if os.environ.get("CKPT_BENCH_SAMPLE") else None
        phases = _time_phases() if os.environ.get("CKPT_BENCH_PHASES") else None
        started = time.perf_counter()
        call()
        out["restore_s"] = time.perf_counter() - started
        if phases is not None:
            out["phases"] = _phase_summary(phases, started)
        if sampler is not None:
            sampler.dump(args.lib, f"{args.saved_world}to{dist.get_world_size()}",
                         dist.get_rank())
        if profile is not None:
            profile.disable()
            profile.dump_stats(f"{os.environ['CKPT_BENCH_PROFILE']}.{args.lib}.{dist.get_rank()}")
        out["hwm_after_kib"] = _status_kib("VmHWM")
        out["rss_after_kib"] = _status_kib("VmRSS")
        dist.barrier()
    checked = time.monotonic()
    out["problems"] = check(specs, model, state["tensors"])
    out["check_s"] = time.monotonic() - checked
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("save", "restore"))
    parser.add_argument("--total-bytes", type=int, required=True)
    parser.add_argument("--ckpt-root", default="")
    parser.add_argument("--dcp-root", default="")
    parser.add_argument("--root", default="", help="restore: the checkpoint to read")
    parser.add_argument("--lib", choices=("ckpt_pipeline", "dcp"), default="ckpt_pipeline")
    parser.add_argument("--saved-world", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    started = time.monotonic()
    dist.init_process_group("gloo")
    init_s = time.monotonic() - started
    specs = layout(args.total_bytes)
    result = save(args, specs) if args.mode == "save" else restore(args, specs)
    result.update(rank=dist.get_rank(), world=dist.get_world_size(),
                  init_s=init_s)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
