"""Issue 24's sweep: what checkpointing costs training at short save intervals, with and without
ckpt_pipeline's memory tier, beside NVIDIA's resiliency extension (NVRx) local checkpoints.

The training loop of ``bench_training.py`` (its workload, variants and timed loop, imported, not
copied: 24 x ``nn.Linear(4096, 4096)``, fused AdamW, bf16 autocast, a 4.83 GB state on the
H200) runs once per save interval and variant, on one GPU:

- ``none``: no checkpoints, the baseline of every ratio, measured at each interval in this run;
- ``ckpt_pipeline``: today's default (every save to the disk root);
- ``ckpt_pipeline_staged``: the same with ``device_staging=True`` (the tier off; its first
  save copies to the GPU and returns while its pinned host buffer is made);
- ``ckpt_pipeline_memory``: the memory tier, ``memory=cp.MemoryConfig(path=/dev/shm/..., slots=3,
  keep=1, disk_every=4)``: every save commits to shared memory, every 4th is written through;
- ``ckpt_pipeline_memory_sized``: the same, its buffers made at open
  (``MemoryConfig(slot_bytes=)``, as a restart makes them from its newest step);
- ``ckpt_pipeline_memory_staged``: sized, with ``device_staging=True`` (the caller's next
  update waits for a device-to-device copy only; costs GPU memory as large as the state);
- ``ckpt_pipeline_memory_staged_fresh``: device staging without a size (a fresh job): the
  first save copies to the GPU and returns while its shared-memory buffer is made;
- ``nvrx_local``: NVRx's ``LocalCheckpointManager``, asynchronous (``benchmarks/_nvrx_variant.py``).

Both end-of-loop sync modes of ``bench_training.py`` come from the same loop: it records the
time until the training stream is done (``stream``) and until ``torch.cuda.synchronize()``
returns (``device``), so each (interval, variant) runs once and is reported under both.

Default steps per interval (about 35 ms a step on the H200): 60 at 5, 100 at 10, 200 at 20
(12, 10 and 10 saves: a disk-bound variant takes about 2.3 s a save whatever the interval) and
600 at 100 (6 saves). The whole sweep takes about 7 minutes there; ``--intervals`` and
``--variants`` run subsets (``gpu_issue24_run.sh`` splits it with ``PART=1|2``).

``--restore-after-kill`` is a mode of its own: a child process runs the loop with the memory
tier, prints a line once its saves are committed (``handle.result()``, then ``wait()``), and is
killed with SIGKILL; this process then restores the child's checkpoint twice into a fresh model
and optimizer: from disk with the memory directory moved aside (a rebooted node: shm gone; done
first, because a clean close of a pipeline with the tier writes its newest memory step through
to disk and would change what the disk holds), then from memory with the directory back. It
reports both times and their ratio, and merges them into ``--out``.

    python benchmarks/bench_memory_tier.py --out /tmp/memory_tier.json            # GPU sweep
    python benchmarks/bench_memory_tier.py --intervals 5,10 --out /tmp/part1.json  # a subset
    python benchmarks/bench_memory_tier.py --restore-after-kill --out /tmp/memory_tier.json
    python benchmarks/bench_memory_tier.py --small --device cpu --variants none,ckpt_pipeline \\
        --out /tmp/mt.json                                                         # CPU smoke
    python benchmarks/plot_memory_tier.py /tmp/memory_tier.json --out fig.png
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from _machine import filesystem_of, machine_info
from _training_floors import drop_page_cache_tree
from _training_variants import (
    CkptPipeline,
    Variant,
    make_variant,
    memory_config,
    memory_tier_path,
    run_loop,
)
from _training_workload import (
    Workload,
    build_workload,
    release_cached_pinned_memory,
    state_tensors,
)
from bench_training import (
    MEMORY_FILESYSTEMS,
    PROFILES,
    gpu_info,
    import_ckpt_pipeline,
    init_process_group,
    log,
    route_library_logs,
    shm_free,
)

GB = 1e9
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "memory_tier_gpu.json"
SWEEP_VARIANTS = ("none", "ckpt_pipeline", "ckpt_pipeline_staged", "ckpt_pipeline_memory",
                  "ckpt_pipeline_memory_sized",
                  "ckpt_pipeline_memory_staged", "ckpt_pipeline_memory_staged_fresh",
                  "nvrx_local")
SYNC_MODES = ("device", "stream")
INTERVALS = (5, 10, 20, 100)
STEPS = {5: 60, 10: 100, 20: 200, 100: 600}  # the GPU defaults; other intervals: 10 saves
SMALL_STEPS = {5: 20, 10: 20, 20: 40, 100: 100}
CHILD_LINE = "MEMORY_COMMITTED"
SETTLED_LINE = "SETTLED"
NOTES = (
    "total_s: wall time of the timed steps including the saves, until the training stream is "
    "done (stream) or torch.cuda.synchronize() returns (device); one loop gives both. x_none: "
    "total_s over the same interval's 'none' run in this invocation, same sync mode.",
    "blocking: seconds on the training thread per save (save call and the wait before the next "
    "optimizer.step(); for nvrx_local also the wait for the previous save, the fork and the "
    "finalization). first_save_blocking_s: the untimed save before the loop (pinned or shm "
    "buffers allocated there).",
    "saves_attempted: save() calls in the timed loop. committed_memory: of those, the handles "
    "that resolved, for the memory tier (handle.result() returns at the memory commit). "
    "durable_disk: saves known durable on the disk root: handles that resolved without the "
    "tier; with it, the write-through events the pipeline emits (null when it emits none that "
    "this script recognizes; see event_counts). nvrx_local: the forked writer exited (NVRx does "
    "not fsync). write_throughs_skipped: WriteThroughSkipped events (null when the library has "
    "no such event).",
    "GB is 1e9 bytes.",
)


# --- per-run results ----------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _event_name(event: Any) -> str:
    return type(event).__name__


def tier_counts(variant: Variant, cp: Any) -> dict[str, Any]:
    """Saves attempted, committed in memory, durable on disk, write-throughs skipped."""
    saves = variant.saves
    out: dict[str, Any] = {"saves_attempted": len(saves), "committed_memory": None,
                           "durable_disk": None, "write_throughs_skipped": None,
                           "event_counts": {}}
    ok = sum(1 for s in saves if s.get("durable_s") is not None and not s.get("error"))
    if not isinstance(variant, CkptPipeline):
        if saves and variant.name == "nvrx_local":
            out["durable_disk"] = sum(1 for s in saves if s.get("exitcode") == 0)
        return out
    steps = {s["step"] for s in saves}
    events = [e for e in list(variant.events) if getattr(e, "step", None) in steps]
    counts = Counter(_event_name(e) for e in events)
    out["event_counts"] = dict(sorted(counts.items()))
    if "memory" not in variant.overrides:
        out["durable_disk"] = ok
        return out
    # The memory tier: MemoryCommitted per memory commit, CheckpointCommitted per step
    # committed on disk (a write-through), WriteThroughSkipped per skipped one.
    out["committed_memory"] = counts.get("MemoryCommitted", 0)
    out["durable_disk"] = len({e.step for e in events
                               if _event_name(e) == "CheckpointCommitted"})
    out["write_throughs_skipped"] = counts.get("WriteThroughSkipped", 0)
    return out


def summarize_run(record: dict[str, Any], variant: Variant, cp: Any) -> dict[str, Any]:
    saves = record.get("saves", [])
    blocking = [s["blocking_s"] for s in saves if s.get("blocking_s") is not None]
    durable = [s["durable_s"] for s in saves if s.get("durable_s") is not None]
    out = {
        "total_device_s": record["total_device_s"],
        "total_stream_s": record["total_stream_s"],
        "final_wait_s": record.get("final_wait_s"),
        "steps": record["steps"],
        "every": record["every"],
        "blocking_median_s": _median(blocking),
        "blocking_max_s": max(blocking) if blocking else None,
        "first_save_blocking_s": record.get("first_save_s"),
        "commit_median_s": _median(durable),
        "save_errors": [s["error"] for s in saves if s.get("error")][:5],
        **tier_counts(variant, cp),
    }
    return out


# --- the sweep ----------------------------------------------------------------------------------


class Sweep:
    def __init__(self, args: argparse.Namespace, workdir: Path, device: torch.device,
                 cp: Any) -> None:
        self.args = args
        self.workdir = workdir
        self.device = device
        self.cp = cp
        self.started = time.perf_counter()
        self.report: dict[str, Any] = {
            "benchmark": "memory_tier_gpu" if device.type == "cuda" else "memory_tier_cpu",
            "schema_version": 1, "notes": list(NOTES), "errors": {}, "skipped": {},
            "runs": {}, "results": {}, "raw": {},
        }
        self.lock = threading.RLock()

    def save_json(self) -> None:
        with self.lock:
            self.report["wall_seconds"] = time.perf_counter() - self.started
            out = self.args.out
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(self.report, indent=2, default=str) + "\n")
            os.replace(tmp, out)

    def build(self) -> Workload:
        a = self.args
        return build_workload(layers=a.layers, hidden=a.hidden, batch=a.batch,
                              device=self.device, autocast=a.autocast, fused=a.fused,
                              seed=a.seed)

    def run_one(self, work: Workload, name: str, interval: int) -> None:
        a = self.args
        key = f"{interval}/{name}"
        if time.perf_counter() - self.started > a.budget_s:
            self.report["skipped"][key] = f"past --budget-s {a.budget_s:.0f}"
            log(f"skipping {key}: past the budget")
            return
        steps = a.steps_for[interval]
        root = self.workdir / f"{name}-{interval}"
        variant: Variant | None = None
        log(f"{key}: {steps} steps, a save every {interval}")
        try:
            variant = make_variant(name, work, root, a, self.cp)
            if isinstance(variant, CkptPipeline):
                variant.isolated_save = False  # not needed here; saves the sweep's time
            record = run_loop(variant, steps=steps, every=interval,
                              warmup_steps=a.warmup_steps, sync_mode="device", log=log,
                              label=key)
            record.update(variant.report())
            self.report["runs"][key] = summarize_run(record, variant, self.cp)
            if a.keep_raw:
                self.report["raw"][key] = {k: v for k, v in record.items()
                                           if k not in ("step_end_s", "event_times_in_loop_s")}
        except BaseException as exc:
            self.report["errors"][key] = traceback.format_exc()
            log(f"{key} FAILED: {type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise
        finally:
            if variant is not None:
                try:
                    variant.close()
                except Exception:
                    self.report["errors"][f"{key}.close"] = traceback.format_exc()
            shutil.rmtree(root, ignore_errors=True)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            release_cached_pinned_memory()  # every variant pays its own pinned allocation
            os.sync()
            self.save_json()

    def tabulate(self) -> None:
        """results[sync][interval][variant]: the fields of the brief, x none per sync mode."""
        results: dict[str, Any] = {}
        runs = self.report["runs"]
        for mode in self.args.sync_modes:
            by_interval: dict[str, Any] = {}
            for interval in self.args.intervals:
                base = runs.get(f"{interval}/none", {}).get(f"total_{mode}_s")
                row: dict[str, Any] = {}
                for name in self.args.variant_list:
                    run = runs.get(f"{interval}/{name}")
                    if run is None:
                        why = self.report["skipped"].get(f"{interval}/{name}") or (
                            "failed" if f"{interval}/{name}" in self.report["errors"] else None)
                        if why:
                            row[name] = {"error": why}
                        continue
                    total = run[f"total_{mode}_s"]
                    row[name] = {
                        "total_s": total,
                        "x_none": total / base if base else None,
                        **{k: run.get(k) for k in (
                            "blocking_median_s", "blocking_max_s", "first_save_blocking_s",
                            "saves_attempted", "committed_memory", "durable_disk",
                            "write_throughs_skipped", "final_wait_s", "steps")},
                    }
                by_interval[str(interval)] = row
            results[mode] = by_interval
        self.report["results"] = results


def run_sweep(args: argparse.Namespace, device: torch.device, cp: Any, workdir: Path) -> int:
    sweep = Sweep(args, workdir, device, cp)
    sweep.report["config"] = _config(args)
    sweep.report["machine"] = machine_info(workdir)
    sweep.report["machine"]["gpu"] = gpu_info(device)
    sweep.report["machine"]["dev_shm_free_bytes"] = shm_free()
    sweep.report["machine"]["ckpt_pipeline_memory_tier"] = hasattr(cp, "MemoryConfig")
    if "nvrx_local" in args.variant_list:
        try:
            sweep.report["process_group"] = init_process_group(device)
        except Exception:
            sweep.report["errors"]["init_process_group"] = traceback.format_exc()
    watchdog = _watchdog(args.hard_limit_s, sweep)
    try:
        work = sweep.build()
        for _ in range(max(1, args.warmup_steps)):
            work.step()
        work.sync()
        state = state_tensors(work)
        sweep.report["state"] = {"bytes": sum(t.numel() * t.element_size() for t in state),
                                 "tensors": len(state)}
        log(f"state: {sweep.report['state']['bytes'] / GB:.3f} GB")
        for interval in args.intervals:
            for name in args.variant_list:
                sweep.run_one(work, name, interval)
    except BaseException as exc:
        sweep.report["errors"]["run"] = traceback.format_exc()
        log(f"run stopped: {type(exc).__name__}: {exc}")
    finally:
        watchdog.cancel()
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        sweep.tabulate()
        sweep.save_json()
    if args.json:
        print(json.dumps(sweep.report, indent=2, default=str))
    else:
        print(format_table(sweep.report))
    fatal = [k for k in sweep.report["errors"] if not k.split(".")[0].endswith("nvrx_local")
             and not k.startswith("init_process_group")
             and not (args.allow_missing_tier and k.split(".")[0].endswith("_memory"))]
    return 1 if fatal else 0


def format_table(report: dict[str, Any]) -> str:
    lines = []
    for mode, by_interval in report.get("results", {}).items():
        lines.append(f"end sync: {mode}")
        lines.append(f"{'every':>6} {'variant':<22} {'total s':>8} {'x none':>7} "
                     f"{'block med ms':>12} {'block max ms':>12} {'first s':>8} "
                     f"{'saves':>5} {'mem':>4} {'disk':>4} {'skip':>4}")
        for interval, row in by_interval.items():
            for name, r in row.items():
                if "error" in r:
                    lines.append(f"{interval:>6} {name:<22} {r['error'][:60]}")
                    continue

                def f(v: Any, fmt: str, scale: float | None = None) -> str:
                    return "-" if v is None else format(v if scale is None else v * scale, fmt)

                lines.append(
                    f"{interval:>6} {name:<22} {f(r['total_s'], '8.2f')} "
                    f"{f(r['x_none'], '7.3f')} {f(r['blocking_median_s'], '12.1f', 1e3)} "
                    f"{f(r['blocking_max_s'], '12.1f', 1e3)} "
                    f"{f(r['first_save_blocking_s'], '8.2f')} "
                    f"{f(r['saves_attempted'], '5d')} {f(r['committed_memory'], '4d')} "
                    f"{f(r['durable_disk'], '4d')} {f(r['write_throughs_skipped'], '4d')}")
    restore = report.get("restore_after_kill")
    if restore:
        lines.append(f"restore after SIGKILL: from memory {restore.get('memory', {}).get('restore_s')} "
                     f"s, from disk {restore.get('disk', {}).get('restore_s')} s, "
                     f"memory/disk {restore.get('memory_over_disk')}")
    return "\n".join(lines)


# --- restore after a SIGKILL ---------------------------------------------------------------------


def child_main(args: argparse.Namespace) -> int:
    """The killed process: the loop with the tier (or without, for a CPU smoke test of the
    plumbing), a line on stdout once ``--child-saves`` saves are committed, then more steps."""
    cp = import_ckpt_pipeline()
    device = torch.device(args.device)
    work = build_workload(layers=args.layers, hidden=args.hidden, batch=args.batch,
                          device=device, autocast=args.autocast, fused=args.fused,
                          seed=args.seed)
    options: dict[str, Any] = {"keep_last": args.keep, "coordinator": cp.LocalCoordinator()}
    if args.child_shm:
        options["memory"] = memory_config(cp, Path(args.child_shm),
                                          disk_every=args.kill_disk_every)
    pipe = cp.CheckpointPipeline(args.child_root, **options)
    pipe.open()
    step = 0
    handle = None
    for _ in range(args.child_saves):
        for _ in range(args.kill_every):
            step += 1
            work.step(pipe.wait_snapshot)
        handle = pipe.save(step, work.state(), cp.TrainState(step=step))
    assert handle is not None
    info = handle.result()
    print(f"{CHILD_LINE} {step} {info.seconds:.4f}", flush=True)
    pipe.wait()
    print(f"{SETTLED_LINE} {step}", flush=True)
    while True:  # train on, saving nothing more, until killed
        work.step(pipe.wait_snapshot)
        work.sync()


def _reader(stream: Any, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))


def _timed_restore(cp: Any, root: Path, options: dict[str, Any],
                   build: Any) -> tuple[dict[str, Any], Workload]:
    fresh = build()
    out: dict[str, Any] = {"files_dropped_from_page_cache": drop_page_cache_tree(root),
                           "released_cached_pinned_memory": release_cached_pinned_memory()}
    t0 = time.perf_counter()
    pipe = cp.CheckpointPipeline(root, **options)
    pipe.open()
    t1 = time.perf_counter()
    try:
        fresh.sync()
        t2 = time.perf_counter()
        result = pipe.restore_latest(fresh.state())
        fresh.sync()
        t3 = time.perf_counter()
    finally:
        t4 = time.perf_counter()
        pipe.close()
        out["close_s"] = time.perf_counter() - t4
    out.update({"open_s": t1 - t0, "restore_s": t3 - t2, "open_and_restore_s": t3 - t0,
                "step": getattr(result, "step", None), "bytes": getattr(result, "bytes", None),
                "library_seconds": getattr(result, "seconds", None)})
    for attr in ("sources", "tier", "from_memory"):
        if hasattr(result, attr):
            out[attr] = str(getattr(result, attr))
    return out, fresh


def _same_state(a: Workload, b: Workload) -> bool:
    pa, pb = list(a.model.parameters()), list(b.model.parameters())
    if len(pa) != len(pb) or not all(torch.equal(x.detach(), y.detach()) for x, y in zip(pa, pb)):
        return False
    for x, y in zip(pa, pb):
        sa, sb = a.optim.state.get(x, {}), b.optim.state.get(y, {})
        if set(sa) != set(sb):
            return False
        for k, v in sa.items():
            if isinstance(v, torch.Tensor) and not torch.equal(v, sb[k]):
                return False
    return True


def run_restore_after_kill(args: argparse.Namespace, device: torch.device, cp: Any,
                           workdir: Path) -> int:
    tier = hasattr(cp, "MemoryConfig")
    if not tier and not args.allow_missing_tier:
        raise SystemExit("--restore-after-kill needs the memory tier (cp.MemoryConfig, issue "
                         "24), which this ckpt_pipeline lacks; --allow-missing-tier runs the "
                         "plumbing without it (a disk restore only)")
    root = workdir / "killed"
    shm = memory_tier_path(root) if tier else None
    aside = shm.with_name(shm.name + ".aside") if shm else None
    out: dict[str, Any] = {"memory_tier": tier, "child_saves": args.child_saves,
                           "every": args.kill_every, "disk_every": args.kill_disk_every,
                           "kill_at": args.kill_at}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--child-root", str(root),
           "--child-saves", str(args.child_saves), "--kill-every", str(args.kill_every),
           "--kill-disk-every", str(args.kill_disk_every), "--device", args.device,
           "--layers", str(args.layers), "--hidden", str(args.hidden),
           "--batch", str(args.batch), "--seed", str(args.seed), "--keep", str(args.keep),
           "--autocast" if args.autocast else "--no-autocast",
           "--fused" if args.fused else "--no-fused"]
    if shm is not None:
        cmd += ["--child-shm", str(shm)]
    log(f"restore-after-kill: starting the child ({args.child_saves} saves, every "
        f"{args.kill_every} steps)")
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                             cwd=str(Path(__file__).resolve().parent))
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_reader, args=(child.stdout, lines), daemon=True).start()
    wanted = CHILD_LINE if args.kill_at == "memory" else SETTLED_LINE
    seen: list[str] = []
    try:
        while True:
            left = args.child_timeout_s - (time.perf_counter() - t0)
            try:
                line = lines.get(timeout=max(0.1, min(left, 1.0)))
            except queue.Empty:
                if child.poll() is not None:
                    raise RuntimeError(f"the child exited with {child.returncode} before "
                                       f"printing {wanted}; its lines: {seen}") from None
                if left <= 0:
                    raise RuntimeError(f"the child printed no {wanted} line within "
                                       f"--child-timeout-s {args.child_timeout_s:.0f}") from None
                continue
            seen.append(line)
            if line.startswith(CHILD_LINE):
                parts = line.split()
                out["child_step"] = int(parts[1])
                out["child_commit_s"] = float(parts[2])
            if line.startswith(wanted):
                break
        out["child_until_signal_s"] = time.perf_counter() - t0
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait()
    out["child_returncode"] = child.returncode
    log(f"child killed (status {child.returncode}) after step {out.get('child_step')}")

    def build() -> Workload:
        return build_workload(layers=args.layers, hidden=args.hidden, batch=args.batch,
                              device=device, autocast=args.autocast, fused=args.fused,
                              seed=args.seed + 1)

    base: dict[str, Any] = {"keep_last": args.keep, "coordinator": cp.LocalCoordinator()}
    options = dict(base)
    if shm is not None:
        options["memory"] = memory_config(cp, shm, disk_every=args.kill_disk_every)
    try:
        if shm is not None and aside is not None:
            os.rename(shm, aside)  # a rebooted node: the tier's files are gone
        try:
            disk, from_disk = _timed_restore(cp, root, dict(options, coordinator=cp.LocalCoordinator()),
                                             build)
        finally:
            if shm is not None and aside is not None:
                shutil.rmtree(shm, ignore_errors=True)  # what the pipeline made there, if any
                os.rename(aside, shm)
        out["disk"] = disk
        log(f"restore from disk: {disk['restore_s']:.3f} s (step {disk['step']})")
        if shm is not None:
            memory, from_memory = _timed_restore(
                cp, root, dict(options, coordinator=cp.LocalCoordinator()), build)
            out["memory"] = memory
            log(f"restore from memory: {memory['restore_s']:.3f} s (step {memory['step']})")
            out["memory_over_disk"] = memory["restore_s"] / disk["restore_s"] \
                if disk["restore_s"] else None
            out["memory_over_disk_with_open"] = \
                memory["open_and_restore_s"] / disk["open_and_restore_s"] \
                if disk["open_and_restore_s"] else None
            if memory["step"] == disk["step"]:
                out["same_state"] = _same_state(from_memory, from_disk)
            del from_memory
        del from_disk
    except Exception:
        out["error"] = traceback.format_exc()
        log(f"restore-after-kill FAILED:\n{out['error']}")
    finally:
        for path in (shm, aside):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
    report: dict[str, Any] = {}
    if args.out.exists():
        with contextlib.suppress(ValueError, OSError):
            report = json.loads(args.out.read_text())
    report["restore_after_kill"] = out
    report.setdefault("restore_config", _config(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f"{args.out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, args.out)
    print(json.dumps(out, indent=2, default=str) if args.json else format_table(report))
    return 1 if "error" in out else 0


# --- command line -------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def _watchdog(limit_s: float, sweep: Sweep) -> threading.Timer:
    """Past ``limit_s``: the JSON so far is written, the files removed, exit status 3."""
    def fire() -> None:
        log(f"watchdog: {limit_s:.0f} s passed; writing what was measured and exiting")
        sweep.report["errors"]["watchdog"] = f"stopped after --hard-limit-s {limit_s:.0f} s"
        with contextlib.suppress(Exception):
            sweep.tabulate()
            sweep.save_json()
        shutil.rmtree(sweep.workdir, ignore_errors=True)
        for path in Path("/dev/shm").glob(f"ckpt-bench-*-{os.getpid()}-memory"):
            shutil.rmtree(path, ignore_errors=True)
        os._exit(3)

    timer = threading.Timer(limit_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Issue 24: training overhead of checkpointing at "
                                            "short save intervals, memory tier and NVRx.")
    p.add_argument("--small", action="store_true",
                   help="a tiny workload (4 x Linear(256, 256), batch 64) for a CPU smoke run")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--intervals", type=_ints, default=list(INTERVALS),
                   help="save intervals in steps (default 5,10,20,100)")
    p.add_argument("--steps", default=None,
                   help="timed steps per interval, as 5:60,10:100 or one number for all "
                        "(default 5:60,10:100,20:200,100:600; --small: 5:20,10:20,20:40,100:100)")
    p.add_argument("--variants", default=",".join(SWEEP_VARIANTS),
                   help=f"comma-separated subset of {','.join(SWEEP_VARIANTS)} (none always runs)")
    p.add_argument("--sync-modes", default=",".join(SYNC_MODES),
                   help="which end-of-loop times to report (device, stream; both by default; "
                        "one loop measures both)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=None, help="where the disk root goes (a fresh "
                                                          "subdirectory, removed at the end)")
    p.add_argument("--out", type=Path, default=None, help=f"JSON (default {DEFAULT_OUT})")
    p.add_argument("--keep", type=int, default=2, help="keep_last of the pipelines (default 2)")
    p.add_argument("--budget-s", type=float, default=500.0,
                   help="runs that would start past this many seconds are skipped and "
                        "recorded (default 500)")
    p.add_argument("--hard-limit-s", type=float, default=570.0,
                   help="watchdog: write the JSON and exit 3 past this (default 570)")
    p.add_argument("--keep-raw", action=argparse.BooleanOptionalAction, default=True,
                   help="keep each run's full record under 'raw' (default on)")
    p.add_argument("--allow-missing-tier", action="store_true",
                   help="no memory tier in this ckpt_pipeline is not an error (CPU smoke runs)")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    p.add_argument("--verbose", action="store_true")
    g = p.add_argument_group("restore after SIGKILL")
    g.add_argument("--restore-after-kill", action="store_true",
                   help="the restore experiment instead of the sweep (merged into --out)")
    g.add_argument("--child-saves", type=int, default=8,
                   help="saves the child commits before it signals (default 8: two "
                        "write-throughs with disk_every 4)")
    g.add_argument("--kill-every", type=int, default=5, help="the child's save interval")
    g.add_argument("--kill-disk-every", type=int, default=4, help="the child's disk_every")
    g.add_argument("--kill-at", choices=("memory", "settled"), default="settled",
                   help="kill once the last save is committed in memory (handle.result()), or "
                        "once the pipeline has settled as well (wait(): the write-throughs "
                        "done; default)")
    g.add_argument("--child-timeout-s", type=float, default=240.0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-shm", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    profile = PROFILES["small" if args.small else "default"]
    for key in ("layers", "hidden", "batch", "warmup_steps"):
        if getattr(args, key) is None:
            setattr(args, key, profile[key])
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if not cuda and not args.small and args.hidden * args.layers > 8192:
        p.error("no CUDA here: the default workload is for a GPU; use --small")
    # What the variants of _training_variants read besides the above: the library's defaults.
    for key, value in (("io_threads", None), ("buffer_slots", None), ("pipeline_chunk_mb", None),
                       ("pipeline_coordinator", "local"), ("streamed_buffer_mb", 1024),
                       ("dcp_shared_memory", False)):
        setattr(args, key, value)
    args.autocast = cuda if args.autocast is None else args.autocast
    args.fused = cuda if args.fused is None else args.fused
    if args.child:
        return args
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(wanted) - set(SWEEP_VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(SWEEP_VARIANTS)}")
    args.variant_list = [v for v in SWEEP_VARIANTS if v in wanted or v == "none"]
    args.sync_modes = [m.strip() for m in args.sync_modes.split(",") if m.strip()]
    if not args.sync_modes or set(args.sync_modes) - set(SYNC_MODES):
        p.error(f"--sync-modes: choose from {', '.join(SYNC_MODES)}")
    if not args.intervals or min(args.intervals) < 1:
        p.error("--intervals must be positive integers")
    table = SMALL_STEPS if args.small else STEPS
    steps: dict[int, int] = {i: table.get(i, 10 * i) for i in args.intervals}
    if args.steps:
        if ":" in args.steps:
            for part in args.steps.split(","):
                interval, _, n = part.partition(":")
                steps[int(interval)] = int(n)
        else:
            steps = dict.fromkeys(args.intervals, int(args.steps))
    if any(steps[i] < i for i in args.intervals):
        p.error("--steps: at least one save per interval")
    args.steps_for = {i: steps[i] for i in args.intervals}
    if args.out is None:
        args.out = DEFAULT_OUT if not args.small else DEFAULT_OUT.with_name(
            "memory_tier_small.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    route_library_logs(args.verbose)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cp = import_ckpt_pipeline()
    if not hasattr(cp, "MemoryConfig"):
        log("note: this ckpt_pipeline has no MemoryConfig (issue 24): the memory-tier runs fail")
    parent = (args.dir or Path.cwd()).resolve()
    parent.mkdir(parents=True, exist_ok=True)
    if filesystem_of(parent).get("type") in MEMORY_FILESYSTEMS:
        log(f"WARNING: {parent} is on a memory filesystem: fsync is a no-op there")
    workdir = Path(tempfile.mkdtemp(prefix=".bench-memory-tier-", dir=parent))

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        if args.restore_after_kill:
            return run_restore_after_kill(args, device, cp, workdir)
        return run_sweep(args, device, cp, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        log(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
