"""Training-time overhead of checkpointing: ckpt_pipeline against PyTorch's own, in one run.

One GPU training loop (default: 24 x ``nn.Linear(4096, 4096)`` in fp32 with ReLU between,
fused AdamW, bf16 autocast, a fixed batch of 8192; a state of about 4.8 GB) runs ``--steps``
steps with a save after every ``--every``-th optimizer step, once per variant, on the same
machine and disk:

- ``none``: no checkpoints, the baseline of every ratio (run first and, by default, again last;
  the faster of the two is the baseline);
- ``ckpt_pipeline``: ``wait_snapshot()`` before ``optimizer.step()``, ``save()`` after it,
  ``wait()`` at the end; one untimed first save allocates the pinned pool (``first_save``);
- ``torch_save``: ``torch.save`` of the model's and optimizer's state dicts, fsync, rename;
- ``dcp_save``: ``torch.distributed.checkpoint.save``;
- ``dcp_async_save``: ``dcp.async_save``, the previous save awaited before the next;
- ``dcp_async_save_pinned``: the same with a pinned, shared-memory, asynchronous ``DefaultStager``.

Each variant's time is the wall time of the steps including its saves, until
``torch.cuda.synchronize()`` returns (the time until the training stream alone is done is
recorded too); the wait until its last save is durable is reported apart. Floors of the same run:
a plain pinned device-to-host copy of the same tensors, a plain write + fsync of the same bytes
(1 and 8 threads), a plain read back (page cache dropped) plus host-to-device copy. The targets
of the GPU issue are evaluated against them and printed as PASS or MISS.

    python benchmarks/bench_training.py                       # the GPU run (about 4 minutes)
    python benchmarks/bench_training.py --variants ckpt_pipeline,dcp_async_save   # a subset
    python benchmarks/bench_training.py --small --out /tmp/t.json   # CPU smoke test, seconds
    python benchmarks/plot_training.py benchmarks/results/training_gpu.json --out fig.png
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()

import torch  # noqa: E402
from _machine import filesystem_of, machine_info  # noqa: E402
from _training_floors import plain_copy, plain_read, plain_write  # noqa: E402
from _training_report import evaluate_targets, format_table, summarize  # noqa: E402
from _training_variants import VARIANTS, make_variant, restore_check, run_loop  # noqa: E402
from _training_workload import (  # noqa: E402
    HostMirror,
    build_workload,
    release_cached_pinned_memory,
    state_tensors,
)

GB = 1e9
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "training_gpu.json"
SMALL_OUT = REPO / "benchmarks" / "results" / "training_small.json"
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs"}
# Order of the run: the headline first, so that a run cut short still has it.
RUN_ORDER = ("none", "ckpt_pipeline", "ckpt_pipeline_staged", "ckpt_pipeline_2slots",
             "ckpt_pipeline_streamed", "ckpt_pipeline_persist",
             "ckpt_pipeline_persist_shm", "dcp_async_save_pinned", "dcp_async_save", "dcp_save",
             "torch_save")
DCP_VARIANTS = {"dcp_save", "dcp_async_save", "dcp_async_save_pinned"}
PEERS = {"torch_save", *DCP_VARIANTS, "init_process_group"}
PROFILES = {
    "default": {"layers": 24, "hidden": 4096, "batch": 8192, "steps": 300, "every": 100,
                "warmup_steps": 5},
    "small": {"layers": 4, "hidden": 256, "batch": 64, "steps": 20, "every": 5,
              "warmup_steps": 2},
}
NOTES = (
    "total_s: wall time of the timed steps including the saves, until torch.cuda.synchronize() "
    "returns (--end-sync device; total_device_s). total_stream_s: until the training stream "
    "alone is done, which leaves out side-stream copies queued by the last save (in a longer "
    "run they would overlap the next step). final_wait_s: after total_s, until the last save "
    "is durable. overhead_ratio: total_s over the fastest 'none' run of this run; "
    "overhead_ratio_stream: the same with total_stream_s.",
    "blocking_s: time on the training thread in the save call and in waiting for its copy "
    "before the next optimizer.step(); for the async DCP variants also the wait for the "
    "previous save and the stager's construction.",
    "durable_s: ckpt_pipeline: CommitInfo.seconds (save() to commit record fsynced); torch_save "
    "and dcp_save: the call; async DCP: from the call to its upload future done.",
    "snapshot target: bytes/second of the pipeline's SnapshotTaken stage against the plain "
    "pinned copy, taken from one save with the GPU idle (isolated_save); the in-loop "
    "SnapshotTaken seconds also include waiting for the training step queued before the copy.",
    "plain_read drops the file's pages with POSIX_FADV_DONTNEED after fsync; on a VM the host "
    "may still cache the disk, so a cold read cannot be guaranteed. The restore check drops the "
    "checkpoint's files the same way.",
    "GB is 1e9 bytes.",
)


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


def import_ckpt_pipeline() -> Any:
    try:
        import ckpt_pipeline
    except ImportError:
        sys.path.insert(0, str(REPO))
        import ckpt_pipeline
    return ckpt_pipeline


def route_library_logs(verbose: bool) -> None:
    """The library's structlog lines go to stderr (warnings only unless verbose)."""
    import logging

    import structlog

    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.INFO if verbose else logging.WARNING),
    )


# --- set-up -----------------------------------------------------------------------------------


def gpu_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch_cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available()}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        info["memory_gb"] = round(props.total_memory / GB, 1)
        with contextlib.suppress(Exception):
            info["cudnn"] = torch.backends.cudnn.version()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
        if smi.returncode == 0:
            info["nvidia_smi"] = smi.stdout.strip()
    return info


def init_process_group(device: torch.device) -> dict[str, Any]:
    """A single-rank group for DCP (async_save needs one with a CPU backend)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return {"backend": str(dist.get_backend()), "preexisting": True}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{port}")
    return {"backend": backend, "world_size": 1}


def shm_free() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None


# --- the run ----------------------------------------------------------------------------------


class Run:
    """Everything one invocation measures, written to JSON after every phase."""

    def __init__(self, args: argparse.Namespace, workdir: Path, device: torch.device) -> None:
        self.args = args
        self.workdir = workdir
        self.device = device
        self.report: dict[str, Any] = {
            "benchmark": "training_gpu" if device.type == "cuda" else "training_cpu",
            "schema_version": 1,
            "notes": list(NOTES),
            "errors": {},
            "skipped": {},
            "variants": {},
            "floors": {},
            "timeline": [],
        }
        self.cp: Any = None
        self.lock = threading.RLock()

    @property
    def errors(self) -> dict[str, str]:
        return self.report["errors"]

    def mark(self, what: str) -> None:
        self.report["timeline"].append([round(time.perf_counter() - STARTED, 3), what])

    def save_json(self) -> None:
        with self.lock:
            self.report["wall_seconds"] = time.perf_counter() - STARTED
            self.args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.args.out.with_name(f"{self.args.out.name}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(self.report, indent=2, default=str) + "\n")
            os.replace(tmp, self.args.out)

    def build(self) -> Any:
        a = self.args
        return build_workload(layers=a.layers, hidden=a.hidden, batch=a.batch, device=self.device,
                              autocast=a.autocast, fused=a.fused, relu=not a.no_relu,
                              seed=a.seed)

    # -- floors

    def floors(self, work: Any) -> None:
        a = self.args
        tensors = state_tensors(work)
        floors = self.report["floors"]
        t0 = time.perf_counter()
        mirror = HostMirror(tensors, pinned=self.device.type == "cuda")
        floors["host_buffer"] = {"bytes": mirror.nbytes, "tensor_bytes": mirror.tensor_bytes,
                                 "pinned": mirror.pinned,
                                 "allocate_s": time.perf_counter() - t0}
        try:
            copy = plain_copy(mirror, self.device, repeats=3)
            floors["plain_copy"] = {"seconds": copy, "bytes": mirror.tensor_bytes,
                                    "best_s": min(copy),
                                    "gbps_best": mirror.tensor_bytes / GB / min(copy)}
            log(f"plain copy: best {min(copy):.4f} s of {copy}")
            keep = self.workdir / "plain-read.bin"
            threads = (1, a.write_threads) if a.write_threads > 1 else (1,)
            writes = plain_write(mirror, self.workdir, thread_counts=threads,
                                 repeats=a.write_repeats, chunk_bytes=a.chunk_mb * MiB,
                                 direct_threads=a.write_threads, keep=keep)
            floors["plain_write"] = {
                key: {"seconds": s, "best_s": min(s), "gbps_best": mirror.nbytes / GB / min(s)}
                for key, s in writes.items() if s}
            floors["plain_write"]["bytes"] = mirror.nbytes
            # The durable target is against the fastest plain method, O_DIRECT included.
            floors["plain_write"]["best_s"] = min(min(s) for s in writes.values() if s)
            floors["plain_write"]["best_buffered_s"] = min(
                min(s) for key, s in writes.items() if s and key.startswith("threads_"))
            log("plain write + fsync: " + ", ".join(f"{key} best {min(s):.3f} s"
                                                    for key, s in writes.items() if s))
            self.save_json()
            reads = plain_read(mirror, keep, self.device, threads=a.read_threads,
                               repeats=a.read_repeats, chunk_bytes=a.chunk_mb * MiB)
            best = min(r["total_s"] for r in reads)
            floors["plain_read"] = {"samples": reads, "best_s": best, "threads": a.read_threads,
                                    "gbps_best": mirror.nbytes / GB / best,
                                    "cold_read_guaranteed": False}
            log(f"plain read + H2D: best {best:.3f} s")
            keep.unlink(missing_ok=True)
        finally:
            del mirror
            gc.collect()
            floors["released_cached_pinned_memory"] = release_cached_pinned_memory()
            os.sync()

    # -- variants

    def estimate_s(self, name: str) -> float:
        """A rough upper estimate of a variant's wall time, for the time budget."""
        a = self.args
        none = self.report["variants"].get("none", {})
        loop = none.get("total_s") or a.steps * 0.06
        write = self.report["floors"].get("plain_write", {}).get("best_s") or \
            self.state_bytes / 1e9
        saves = a.steps // a.every
        factor = {"none": 0.0, "ckpt_pipeline": 0.5, "ckpt_pipeline_2slots": 0.5,
                  "ckpt_pipeline_staged": 0.5,
                  "ckpt_pipeline_streamed": 1.0, "ckpt_pipeline_persist": 1.0,
                  "ckpt_pipeline_persist_shm": 1.0,
                  "torch_save": 2.5, "dcp_save": 2.0,
                  "dcp_async_save": 2.0, "dcp_async_save_pinned": 2.0}[name]
        extra = 0.0
        if name.startswith("ckpt_pipeline"):
            extra = 4 * write + 10 + (3 * write if a.restore_check else 0)
        return loop * 1.1 + saves * factor * write + write + extra + 5

    def run_variant(self, name: str, work: Any, key: str | None = None) -> None:
        key = key or name
        a = self.args
        left = a.budget_s - (time.perf_counter() - STARTED)
        estimate = self.estimate_s(name)
        if estimate > left:
            self.report["skipped"][key] = (f"time budget: about {estimate:.0f} s needed, "
                                           f"{left:.0f} s left of --budget-s {a.budget_s:.0f}")
            log(f"skipping {key}: {self.report['skipped'][key]}")
            return
        root = self.workdir / key
        variant = None
        self.mark(f"{key} start")
        log(f"{key}: start (estimate {estimate:.0f} s)")
        try:
            variant = make_variant(name, work, root, a, self.cp)
            record = run_loop(variant, steps=a.steps, every=a.every,
                              warmup_steps=a.warmup_steps, sync_mode=a.end_sync, log=log,
                              label=key)
            record.update(variant.report())
            self.report["variants"][key] = record
            if name == "ckpt_pipeline" and a.restore_check:
                variant.close()
                log("ckpt_pipeline: restore check (page cache dropped)")
                try:
                    check = restore_check(self.cp, root, work, self.build, variant._options(),
                                          record.get("last_step", -1))
                except Exception:
                    self.errors[f"{key}.restore_check"] = traceback.format_exc()
                    check = {"ok": False, "error": self.errors[f"{key}.restore_check"]}
                record["restore_check"] = check
                log(f"restore: {check.get('restore_s', float('nan')):.3f} s, ok={check['ok']}")
        except BaseException as exc:
            self.errors[key] = traceback.format_exc()
            log(f"{key} FAILED: {type(exc).__name__}: {exc}")
            if variant is not None and key not in self.report["variants"]:
                with contextlib.suppress(Exception):
                    self.report.setdefault("partial", {})[key] = variant.report()
            if not isinstance(exc, Exception):
                raise
        finally:
            if variant is not None:
                try:
                    variant.close()
                except Exception:
                    self.errors[f"{key}.close"] = traceback.format_exc()
            shutil.rmtree(root, ignore_errors=True)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            os.sync()
            self.mark(f"{key} end")
            self.save_json()

    @property
    def state_bytes(self) -> int:
        return int(self.report.get("state", {}).get("bytes", 0))


# --- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Training-time overhead of checkpointing on a GPU training loop: "
                    "ckpt_pipeline against torch.save and torch.distributed.checkpoint.")
    p.add_argument("--small", action="store_true",
                   help="a tiny workload (4 x Linear(256, 256), batch 64, 20 steps, a save "
                        "every 5) that runs on CPU in seconds: a smoke test")
    p.add_argument("--layers", type=int, help="Linear layers (default 24)")
    p.add_argument("--hidden", type=int, help="width of each layer (default 4096)")
    p.add_argument("--batch", type=int, help="batch size (default 8192)")
    p.add_argument("--steps", type=int, help="timed steps per variant (default 300)")
    p.add_argument("--every", type=int, help="save after every N-th step (default 100)")
    p.add_argument("--warmup-steps", type=int, help="untimed steps before each timed loop "
                                                    "(default 5)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (none is always run)")
    p.add_argument("--no-repeat-none", action="store_true",
                   help="do not run 'none' again at the end (it measures drift)")
    p.add_argument("--device", default=None,
                   help="cuda (default when available) or cpu")
    p.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast forward (default: on with CUDA, off on CPU)")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="fused AdamW (default: on with CUDA, off on CPU)")
    p.add_argument("--no-relu", action="store_true", help="no ReLU between the layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=None,
                   help="where to write; a fresh subdirectory is made and removed (default: "
                        "under the current directory)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results (default benchmarks/results/training_gpu.json, or "
                        "training_small.json with --small)")
    p.add_argument("--keep", type=int, default=2,
                   help="checkpoints kept on disk by every variant (ckpt_pipeline keep_last); "
                        "default 2")
    p.add_argument("--io-threads", type=int, default=None, help="PipelineConfig.io_threads")
    p.add_argument("--buffer-slots", type=int, default=None,
                   help="PipelineConfig.buffer_slots")
    p.add_argument("--streamed-buffer-mb", type=int, default=1024,
                   help="host_buffer_bytes of the ckpt_pipeline_streamed variant (MiB)")
    p.add_argument("--pipeline-chunk-mb", type=int, default=None,
                   help="PipelineConfig.chunk_bytes in MiB")
    p.add_argument("--pipeline-coordinator", choices=("local", "default"), default="local",
                   help="local: cp.LocalCoordinator (a single-process job); default: the "
                        "library's choice, a gloo DistributedCoordinator since this run "
                        "initializes torch.distributed for DCP")
    p.add_argument("--dcp-shared-memory", choices=("auto", "on", "off"), default="auto",
                   help="use_shared_memory of the pinned DefaultStager (auto: on when "
                        "/dev/shm has room for a copy of the state per save, plus one)")
    p.add_argument("--end-sync", choices=("device", "stream"), default="device",
                   help="what ends a timed loop for total_s: torch.cuda.synchronize() "
                        "(device, the default: it also waits for copies the last save queued "
                        "on a side stream) or the training stream alone (stream); both are "
                        "recorded")
    p.add_argument("--restore-check", action=argparse.BooleanOptionalAction, default=True,
                   help="restore the last ckpt_pipeline checkpoint into a fresh model and "
                        "optimizer, time it and compare (default on)")
    p.add_argument("--skip-floors", action="store_true",
                   help="do not measure the plain copy, write and read")
    p.add_argument("--write-threads", type=int, default=8)
    p.add_argument("--write-repeats", type=int, default=2)
    p.add_argument("--read-threads", type=int, default=8)
    p.add_argument("--read-repeats", type=int, default=2)
    p.add_argument("--chunk-mb", type=int, default=64, help="piece size of the floors (MiB)")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="wall-clock budget: a variant whose estimated time would not fit is "
                        "skipped and recorded (default 330)")
    p.add_argument("--hard-limit-s", type=float, default=480.0,
                   help="watchdog: past this many seconds the run is interrupted, writes what it "
                        "has, removes its files and exits with status 3 (default 480)")
    p.add_argument("--verbose", action="store_true", help="the library's info log lines")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    args = p.parse_args(argv)
    profile = PROFILES["small" if args.small else "default"]
    for key, value in profile.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if not cuda and not args.small and args.hidden * args.layers > 8192:
        p.error("no CUDA here: the default workload is for a GPU; use --small for a CPU "
                "smoke test (or give smaller --layers/--hidden/--batch)")
    if args.autocast is None:
        args.autocast = cuda
    if args.fused is None:
        args.fused = cuda
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(wanted) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    args.variant_list = [v for v in RUN_ORDER if v in wanted or v == "none"]
    if min(args.layers, args.hidden, args.batch, args.steps, args.every, args.keep) < 1 \
            or args.warmup_steps < 0:
        p.error("sizes, --steps, --every and --keep must be positive")
    if args.out is None:
        args.out = SMALL_OUT if args.small else DEFAULT_OUT
    return args


def finalize(run: Run) -> None:
    run.report["loadavg_at_end"] = os.getloadavg()
    try:
        run.report["summary"] = summarize(run.report)
        run.report["targets"] = evaluate_targets(run.report)
        run.report["targets_by_variant"] = {
            key: evaluate_targets(run.report, key) for key in run.report["variants"]
            if key.startswith("ckpt_pipeline")}
    except Exception:
        run.errors["summary"] = traceback.format_exc()
    run.save_json()


def start_watchdog(run: Run, workdir: Path, limit_s: float,
                   grace_s: float = 20.0) -> threading.Timer:
    """Past ``limit_s`` (a hang, or a far slower machine), so that a run under a hard time limit
    still reports: stacks of every thread to stderr, KeyboardInterrupt in the main thread (which
    then writes the JSON, removes its files and prints the table), and if the main thread is
    stuck for ``grace_s`` more, the same from here and exit status 3."""
    import _thread
    import faulthandler

    left = limit_s - (time.perf_counter() - STARTED)
    faulthandler.dump_traceback_later(max(1.0, left - 1), exit=False)

    def fire() -> None:
        log(f"watchdog: {limit_s:.0f} s passed; stopping the run")
        run.errors["watchdog"] = f"stopped after --hard-limit-s {limit_s:.0f} s"
        _thread.interrupt_main()
        time.sleep(grace_s)
        log("watchdog: the main thread did not stop; writing what was measured and exiting")
        for _ in range(5):
            try:
                finalize(run)
                print(format_table(run.report), flush=True)
                break
            except Exception:
                time.sleep(0.2)
        for _ in range(3):  # the main thread may still be creating files in it
            shutil.rmtree(workdir, ignore_errors=True)
            time.sleep(0.05)
        os._exit(3)

    timer = threading.Timer(max(1.0, left), fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    route_library_logs(args.verbose)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    parent = (args.dir or Path.cwd()).resolve()
    parent.mkdir(parents=True, exist_ok=True)
    fs = filesystem_of(parent)
    if fs.get("type") in MEMORY_FILESYSTEMS:
        log(f"WARNING: {parent} is on {fs.get('type')}: fsync is a no-op there")
    workdir = Path(tempfile.mkdtemp(prefix=".bench-training-", dir=parent))
    run = Run(args, workdir, device)

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["command"] = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) \
        if argv is None else None
    run.report["config"] = config
    log(f"writing under {workdir} ({fs.get('type')}); results to {args.out}")
    watchdog = start_watchdog(run, workdir, args.hard_limit_s)
    try:
        run.report["machine"] = machine_info(workdir)
        run.report["machine"]["gpu"] = gpu_info(device)
        run.cp = import_ckpt_pipeline()
        run.report["machine"]["ckpt_pipeline"] = getattr(run.cp, "__version__", None)
        if any(v in DCP_VARIANTS for v in args.variant_list):
            try:
                run.report["process_group"] = init_process_group(device)
            except Exception:
                run.errors["init_process_group"] = traceback.format_exc()
        t0 = time.perf_counter()
        work = run.build()
        for _ in range(max(1, args.warmup_steps)):  # creates the optimizer state
            work.step()
        work.sync()
        tensors = state_tensors(work)
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        params = sum(p.numel() for p in work.model.parameters())
        run.report["state"] = {"bytes": state_bytes, "tensors": len(tensors),
                               "parameters": params, "build_and_warmup_s":
                                   time.perf_counter() - t0}
        log(f"state: {state_bytes / GB:.3f} GB in {len(tensors)} tensors "
            f"({params / 1e6:.1f} M parameters)")
        need = 3.5 * state_bytes
        free = shutil.disk_usage(workdir).free
        if free < need:
            raise SystemExit(f"{workdir} has {free / GB:.1f} GB free; this run needs about "
                             f"{need / GB:.1f} GB (use --dir)")
        shm = shm_free()
        if args.dcp_shared_memory == "auto":
            # a full /dev/shm kills the process with SIGBUS: leave room for every save's copy
            room = (args.steps // args.every + 1) * state_bytes
            args.dcp_shared_memory = shm is not None and shm > room
        else:
            args.dcp_shared_memory = args.dcp_shared_memory == "on"
        run.report["config"]["dcp_shared_memory"] = args.dcp_shared_memory
        run.report["machine"]["dev_shm_free_bytes"] = shm
        run.save_json()
        if not args.skip_floors:
            run.mark("floors start")
            try:
                run.floors(work)
            except Exception:
                run.errors["floors"] = traceback.format_exc()
                log(f"floors FAILED:\n{run.errors['floors']}")
            run.mark("floors end")
            run.save_json()
        for name in args.variant_list:
            run.run_variant(name, work)
        if not args.no_repeat_none:
            run.run_variant("none", work, key="none_end")
    except BaseException as exc:
        run.errors["run"] = traceback.format_exc()
        log(f"run stopped: {type(exc).__name__}: {exc}")
    finally:
        watchdog.cancel()
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
        shutil.rmtree(workdir, ignore_errors=True)
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        finalize(run)
        log(f"wrote {args.out}")
    if args.json:
        print(json.dumps(run.report, indent=2, default=str))
    else:
        try:
            print(format_table(run.report))
        except Exception:
            traceback.print_exc()
    # A peer that cannot run here (the pinned DCP stager needs CUDA) is recorded, not fatal.
    fatal = [k for k in run.errors if k.split(".")[0] not in PEERS]
    if "watchdog" in run.errors:
        return 3
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main())
