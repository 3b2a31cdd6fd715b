"""Time to make a CPU state durable: ckpt_pipeline against plain writes and torch.save.

Every method writes the same bytes of the same state to the same disk, in one run, and counts
as done only once the data and its name are on disk (fsync of the file, rename, fsync of the
directory). Methods run round-robin, one repeat of each per round, in an order shuffled anew
each round (seeded), so that drift of the disk or of the machine, and whatever one method leaves
behind for the next, spread over all of them. Untimed warm-up rounds come first
(``--warmup-rounds``): the first writes of a run, while the files on disk still grow towards
their steady footprint, are much slower.

- ``plain_write_fsync``: the tensors' bytes written with ``os.pwrite`` in large chunks from one
  thread, then fsync, close, rename and fsync of the directory. The floor; every ratio is
  against its median.
- ``pwrite_threads_fsync``: the same, with the chunks spread over a pool of threads that write
  disjoint ranges of one file.
- ``aiofiles_write_fsync``: the same bytes written through ``aiofiles`` on an asyncio loop.
- ``torch_save``: ``torch.save(state, path)``, then fsync of the file, rename and fsync of the
  directory, so that durability matches.
- ``host_copy``: a copy of the tensors into a preallocated host buffer; the floor for the time
  ``save()`` blocks on a CPU state.
- ``ckpt_pipeline``: ``save()`` until ``result()`` returns (time to durable), on a pipeline
  opened once; its first save allocates the host buffer and is reported apart (``first_save``).
  ``ckpt_pipeline_blocking`` is the part of it spent in ``save()`` and ``wait_snapshot()``.

Reads are not measured: a read benchmark needs a cold page cache, which this one does not
arrange.

Run ``python benchmarks/bench_cpu_save.py --help`` for the options; results go to
``benchmarks/results/cpu_save.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from _baselines import (
    aiofiles_write_fsync,
    byte_views,
    chunked,
    iter_tensors,
    make_state,
    plain_write_fsync,
    pwrite_threads_fsync,
    torch_save,
)
from _machine import filesystem_of, machine_info

GB = 1e9  # decimal gigabytes, for sizes and for GB/s
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu_save.json"
BASELINE = "plain_write_fsync"
BLOCKING = "ckpt_pipeline_blocking"
KEEP_LAST = 2
# The pipeline's events that carry a stage's duration, and the name it gets in the JSON.
STAGE_EVENTS = {
    "SaveRequested": "save_call",
    "SnapshotTaken": "snapshot",
    "ShardDataWritten": "serialize",
    "ShardSealed": "write",
}
ALL_METHODS = (
    "plain_write_fsync",
    "pwrite_threads_fsync",
    "aiofiles_write_fsync",
    "torch_save",
    "host_copy",
    "ckpt_pipeline",
)
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs"}
NOTES = (
    "Reads are not measured here: a read benchmark needs a cold page cache, and this one "
    "does not drop it.",
    "Every write method ends with fsync of the file, rename to its final name and fsync of "
    "the directory; times run from the first byte written (or save()) to that point.",
    "ratio_to_plain_write is a time ratio against the median of plain_write_fsync in the same "
    "run: above 1 is slower than the floor.",
    "GB is 1e9 bytes; GB/s is the state's tensor bytes over the time.",
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- ckpt_pipeline ----------------------------------------------------------------------------


def import_ckpt_pipeline() -> Any:
    """The library, from the environment or else from this checkout."""
    try:
        import ckpt_pipeline
    except ImportError:
        sys.path.insert(0, str(REPO))
        import ckpt_pipeline
    return ckpt_pipeline


def pipeline_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``PipelineConfig`` fields set on the command line (``--io-threads`` and so on)."""
    overrides: dict[str, Any] = {}
    if args.io_threads is not None:
        overrides["io_threads"] = args.io_threads
    if args.pipeline_chunk_mb is not None:
        overrides["chunk_bytes"] = args.pipeline_chunk_mb * MiB
    return overrides


class PipelineRunner:
    """One pipeline, opened once, saving the same state at increasing steps.

    Retention prunes the step ``keep_last`` back after each commit, in the background. A save
    is over, for the benchmark, once that prune is done too (its ``CheckpointPruned`` event), so
    that deleting a checkpoint is not charged to whichever method runs next. The prune is not
    part of the time to durable. ``options``: more ``PipelineConfig`` fields.
    """

    def __init__(self, cp: Any, root: Path, state: dict[str, Any], args: argparse.Namespace,
                 *, keep_last: int = KEEP_LAST, options: dict[str, Any] | None = None):
        self.cp = cp
        self.root = root
        self.state = state
        self.args = args
        self.keep_last = keep_last
        self.options = dict(options or {})
        self.step = 0
        self.stack = contextlib.ExitStack()
        self.settings: dict[str, Any] = {"keep_last": keep_last}
        self.pruned: dict[int, float] = {}
        self.stages: dict[int, dict[str, float]] = {}
        self.pruned_changed = threading.Condition()

    def _on_event(self, event: Any) -> None:
        name = type(event).__name__
        if name in STAGE_EVENTS:
            seconds = getattr(event, "seconds", getattr(event, "blocking_seconds", None))
            self.stages.setdefault(event.step, {})[STAGE_EVENTS[name]] = seconds
        if name == "CheckpointPruned":
            with self.pruned_changed:
                self.pruned[event.step] = event.seconds
                self.pruned_changed.notify_all()

    def _wait_pruned(self, step: int, timeout: float = 120.0) -> float | None:
        with self.pruned_changed:
            self.pruned_changed.wait_for(lambda: step in self.pruned, timeout=timeout)
            return self.pruned.get(step)

    def open(self) -> None:
        kwargs: dict[str, Any] = {"keep_last": self.keep_last}
        overrides = {**self.options, **pipeline_overrides(self.args)}
        if overrides:
            config = self.cp.PipelineConfig(keep_last=self.keep_last, **overrides)
            kwargs = {"config": config}
            self.settings = {"keep_last": self.keep_last, **overrides}
        self.pipe = self.stack.enter_context(self.cp.CheckpointPipeline(self.root, **kwargs))
        self.can_wait_prune = hasattr(self.pipe, "subscribe")
        if self.can_wait_prune:
            self.pipe.subscribe(self._on_event)
        config = getattr(self.pipe, "config", None)
        if config is not None:
            with contextlib.suppress(TypeError):
                self.settings = dataclasses.asdict(config)

    def close(self) -> None:
        self.stack.close()

    def save(self) -> dict[str, Any]:
        self.step += 1
        args: tuple[Any, ...] = (self.step, self.state)
        if hasattr(self.cp, "TrainState"):
            args += (self.cp.TrainState(step=self.step),)
        t0 = time.perf_counter()
        handle = self.pipe.save(*args)
        t1 = time.perf_counter()
        self.pipe.wait_snapshot()
        t2 = time.perf_counter()
        info = handle.result(timeout=None)
        t3 = time.perf_counter()
        self.pipe.wait()
        prune_s = None
        if self.can_wait_prune and self.step > self.keep_last:
            prune_s = self._wait_pruned(self.step - self.keep_last)
            if prune_s is None:
                _log(f"ckpt_pipeline: step {self.step - self.keep_last} was not pruned within "
                     "120 s")
        return {
            "step": self.step,
            "durable_s": t3 - t0,
            "blocking_s": t2 - t0,
            "save_call_s": t1 - t0,
            "wait_snapshot_s": t2 - t1,
            "commit_info_seconds": getattr(info, "seconds", None),
            "bytes_written": getattr(info, "bytes", None),
            "prune_seconds": prune_s,
            "stage_seconds": self.stages.pop(self.step, None),
        }

    def verify_restore(self) -> dict[str, Any]:
        """Load the newest checkpoint into zeros and compare; a check, not a read benchmark."""
        target = {
            group: {name: torch.zeros_like(t) for name, t in tensors.items()}
            for group, tensors in self.state.items()
        }
        t0 = time.perf_counter()
        result = self.pipe.restore_latest(target)
        seconds = time.perf_counter() - t0
        equal = all(
            torch.equal(a, b)
            for a, b in zip(iter_tensors(self.state), iter_tensors(target), strict=True)
        )
        return {
            "step": getattr(result, "step", None),
            "expected_step": self.step,
            "tensors_equal": equal,
            "seconds_warm_cache": seconds,
        }


# --- the run ----------------------------------------------------------------------------------


def summarize(seconds: list[float], nbytes: int, baseline_median: float | None) -> dict[str, Any]:
    median = statistics.median(seconds)
    return {
        "seconds": seconds,
        "median_s": median,
        "min_s": min(seconds),
        "max_s": max(seconds),
        "gbps_median": nbytes / GB / median if median > 0 else None,
        "gbps_best": nbytes / GB / min(seconds) if min(seconds) > 0 else None,
        "ratio_to_plain_write": median / baseline_median if baseline_median else None,
    }


def stage_medians(saves: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds of each pipeline stage; ``commit_and_queues`` is the rest of durable."""
    rows = []
    for save in saves:
        stages = dict(save.get("stage_seconds") or {})
        if save.get("commit_info_seconds") is not None and stages:
            stages["commit_and_queues"] = save["commit_info_seconds"] - sum(
                v for v in stages.values() if v is not None)
        if save.get("prune_seconds") is not None:
            stages["prune_after_commit"] = save["prune_seconds"]
        rows.append(stages)
    names = [n for n in (*STAGE_EVENTS.values(), "commit_and_queues", "prune_after_commit")
             if any(row.get(n) is not None for row in rows)]
    return {n: statistics.median(r[n] for r in rows if r.get(n) is not None) for n in names}


def settle() -> None:
    """Let the previous method's deletes and writeback finish outside the next measurement."""
    gc.collect()
    os.sync()


def run_benchmark(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    state = make_state(int(args.size_gb * GB), args.tensors)
    views = byte_views(state)
    nbytes = sum(v.nbytes for v in views)
    pieces = chunked(views, args.chunk_mb * MiB)
    methods = [m for m in ALL_METHODS if m not in set(args.skip)]
    skipped = {m: "--skip" for m in args.skip}
    if "aiofiles_write_fsync" in methods and importlib.util.find_spec("aiofiles") is None:
        methods.remove("aiofiles_write_fsync")
        skipped["aiofiles_write_fsync"] = "aiofiles is not installed"
        _log("aiofiles is not installed: aiofiles_write_fsync is left out")
    samples: dict[str, list[float]] = {m: [] for m in methods}
    errors: dict[str, str] = {}
    pipeline: dict[str, Any] = {}

    pool = ThreadPoolExecutor(max_workers=args.threads, thread_name_prefix="bench-pwrite")
    host_buffer = torch.empty(nbytes // 4, dtype=torch.float32) if "host_copy" in methods else None
    runner: PipelineRunner | None = None
    if "ckpt_pipeline" in methods:
        try:
            cp = import_ckpt_pipeline()
            pipeline["version"] = getattr(cp, "__version__", None)
            runner = PipelineRunner(cp, workdir / "pipeline", state, args)
            runner.open()
            pipeline["settings"] = runner.settings
            _log("ckpt_pipeline: first save (allocates the host buffer)")
            pipeline["first_save"] = runner.save()
            settle()
        except Exception:
            errors["ckpt_pipeline"] = traceback.format_exc()
            _log(f"ckpt_pipeline failed, dropped from this run:\n{errors['ckpt_pipeline']}")
            methods.remove("ckpt_pipeline")
            samples.pop("ckpt_pipeline")
            if runner is not None:
                with contextlib.suppress(Exception):
                    runner.close()
                runner = None
    if runner is not None:
        samples[BLOCKING] = []
        pipeline["saves"] = []
    warmup: dict[str, list[float]] = {m: [] for m in methods}

    def host_copy() -> None:
        assert host_buffer is not None
        offset = 0
        for t in iter_tensors(state):
            host_buffer[offset:offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()

    if host_buffer is not None:
        for _ in range(3):  # fault the pages in and wake torch's threads, as a warm-up save does
            host_copy()

    def run_one(method: str, repeat: int) -> float:
        final = workdir / f"{method}-{repeat}.bin"
        t0 = time.perf_counter()
        if method == "plain_write_fsync":
            plain_write_fsync(pieces, final)
        elif method == "pwrite_threads_fsync":
            pwrite_threads_fsync(pieces, final, pool)
        elif method == "aiofiles_write_fsync":
            aiofiles_write_fsync(pieces, final)
        elif method == "torch_save":
            torch_save(state, final)
        elif method == "host_copy":
            host_copy()
        seconds = time.perf_counter() - t0
        final.unlink(missing_ok=True)
        return seconds

    shuffler = random.Random(args.seed)
    orders: list[dict[str, Any]] = []
    rounds = [("warm-up", i) for i in range(args.warmup_rounds)]
    rounds += [("round", i) for i in range(args.repeats)]
    try:
        for index, (kind, repeat) in enumerate(rounds):
            measured = kind == "round"
            total = args.repeats if measured else args.warmup_rounds
            order = methods[:]
            shuffler.shuffle(order)
            orders.append({"round": f"{kind} {repeat + 1}", "order": order})
            for method in order:
                if method == "ckpt_pipeline" and runner is not None:
                    try:
                        sample = runner.save()
                    except Exception:
                        errors["ckpt_pipeline"] = traceback.format_exc()
                        _log(f"ckpt_pipeline failed at step {runner.step}:\n"
                             f"{errors['ckpt_pipeline']}")
                        with contextlib.suppress(Exception):
                            runner.close()
                        runner = None
                        continue
                    seconds = sample["durable_s"]
                    sample["warmup"] = not measured
                    pipeline["saves"].append(sample)
                    if measured:
                        samples[BLOCKING].append(sample["blocking_s"])
                elif method == "ckpt_pipeline":
                    continue
                else:
                    seconds = run_one(method, index)
                (samples if measured else warmup)[method].append(seconds)
                _log(f"{kind} {repeat + 1}/{total}  {method:<22} {seconds:8.3f} s")
                settle()
        if runner is not None:
            try:
                pipeline["restore_check"] = runner.verify_restore()
            except Exception:
                errors["ckpt_pipeline.restore_latest"] = traceback.format_exc()
                _log(f"restore_latest failed:\n{errors['ckpt_pipeline.restore_latest']}")
    finally:
        if runner is not None:
            try:
                runner.close()
            except Exception:
                errors["ckpt_pipeline.close"] = traceback.format_exc()
        pool.shutdown()

    measured_saves = [x for x in pipeline.get("saves", []) if not x["warmup"]]
    if measured_saves:
        pipeline["stage_medians"] = stage_medians(measured_saves)
    baseline = samples.get(BASELINE)
    baseline_median = statistics.median(baseline) if baseline else None
    results = {
        name: summarize(secs, nbytes, baseline_median)
        for name, secs in samples.items()
        if secs
    }
    if "host_copy" in results and BLOCKING in results:
        results[BLOCKING]["ratio_to_host_copy"] = (
            results[BLOCKING]["median_s"] / results["host_copy"]["median_s"]
        )
    return {
        "state": {
            "tensors": args.tensors,
            "dtype": "float32",
            "device": "cpu",
            "bytes": nbytes,
            "layout": "{'model': {...}, 'optim': {...}}, equal 1-D tensors",
        },
        "results": results,
        "skipped": skipped,
        "warmup_seconds": {name: secs for name, secs in warmup.items() if secs},
        "round_orders": orders,
        "ckpt_pipeline": pipeline,
        "errors": errors,
    }


# --- output -----------------------------------------------------------------------------------


def format_table(report: dict[str, Any]) -> str:
    results = report["results"]
    rows = [("method", "median s", "min s", "GB/s", "x plain write")]
    order = [*ALL_METHODS[:-1], "ckpt_pipeline", BLOCKING]
    for name in order:
        if name not in results:
            continue
        r = results[name]
        ratio = r["ratio_to_plain_write"]
        rows.append((
            name,
            f"{r['median_s']:.3f}",
            f"{r['min_s']:.3f}",
            f"{r['gbps_median']:.2f}" if r["gbps_median"] else "-",
            f"{ratio:.2f}" if ratio else "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                  for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    state = report["state"]
    fs = report["machine"]["filesystem"]
    header = (f"{state['bytes'] / GB:.2f} GB in {state['tensors']} float32 CPU tensors, "
              f"{report['config']['repeats']} repeats, {fs.get('type', '?')} at "
              f"{fs.get('mount_point', '?')}")
    footer = []
    first = report["ckpt_pipeline"].get("first_save")
    if first:
        footer.append(f"ckpt_pipeline first save (allocates the host buffer; excluded): "
                      f"{first['durable_s']:.3f} s to durable, {first['blocking_s']:.3f} s blocking")
    stages = report["ckpt_pipeline"].get("stage_medians")
    if stages:
        footer.append("ckpt_pipeline stages, median s: " + ", ".join(
            f"{name} {seconds:.3f}" for name, seconds in stages.items()))
    check = report["ckpt_pipeline"].get("restore_check")
    if check:
        footer.append(f"restore_latest check: step {check['step']}, tensors equal: "
                      f"{check['tensors_equal']}")
    for name in report["errors"]:
        footer.append(f"ERROR in {name}: see 'errors' in the JSON")
    start, end = report["machine"]["loadavg_at_start"][0], report["loadavg_at_end"][0]
    footer.append(f"1-min load average {start:.2f} at start, {end:.2f} at end "
                  f"on {report['machine']['cpu_count']} CPUs.")
    footer.append("Reads are not measured here.")
    return "\n".join([header, *lines, *footer])


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Bar chart of median seconds with min-max whiskers; skipped when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log(f"matplotlib is not installed: no plot written to {path}")
        return
    results = report["results"]
    names = [n for n in (*ALL_METHODS, BLOCKING) if n in results]
    medians = [results[n]["median_s"] for n in names]
    low = [results[n]["median_s"] - results[n]["min_s"] for n in names]
    high = [results[n]["max_s"] - results[n]["median_s"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    ax.barh(names, medians, xerr=[low, high], color="tab:blue", capsize=3)
    ax.axvline(results[BASELINE]["median_s"], color="tab:red", linestyle="--",
               label=f"{BASELINE} median")
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median, whiskers min to max)")
    ax.set_title(f"CPU save of {report['state']['bytes'] / GB:.2f} GB, "
                 f"{report['config']['repeats']} repeats")
    ax.legend(loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    _log(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time to make a CPU state durable: ckpt_pipeline, torch.save and plain "
                    "write-and-fsync baselines, interleaved in one run.")
    parser.add_argument("--size-gb", type=float, default=1.0,
                        help="total size of the state in GB (1e9 bytes); default 1.0")
    parser.add_argument("--tensors", type=int, default=16, help="number of tensors; default 16")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each method; default 3")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the method order within each round; default 0")
    parser.add_argument("--warmup-rounds", type=int, default=2,
                        help="untimed rounds of every method before the measured ones; default 2")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write; a fresh subdirectory is made and removed "
                             "(default: under the current directory)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"JSON results (default {DEFAULT_OUT.relative_to(REPO)})")
    parser.add_argument("--chunk-mb", type=int, default=64,
                        help="write size of the plain baselines in MiB; default 64")
    parser.add_argument("--threads", type=int, default=4,
                        help="threads of pwrite_threads_fsync; default 4")
    parser.add_argument("--io-threads", type=int, default=None,
                        help="PipelineConfig.io_threads (default: the library's)")
    parser.add_argument("--pipeline-chunk-mb", type=int, default=None,
                        help="PipelineConfig.chunk_bytes in MiB (default: the library's)")
    parser.add_argument("--skip", action="append", default=[], choices=ALL_METHODS,
                        help="leave a method out (repeatable); plain_write_fsync is required")
    parser.add_argument("--plot", type=Path, default=None,
                        help="also draw a PNG bar chart here (needs matplotlib)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the library's info log lines (on stderr)")
    parser.add_argument("--json", action="store_true",
                        help="print the JSON report on stdout instead of the table")
    args = parser.parse_args(argv)
    if args.size_gb <= 0 or args.tensors < 1 or args.repeats < 1 or args.warmup_rounds < 0:
        parser.error("--size-gb, --tensors and --repeats must be positive, "
                     "--warmup-rounds not negative")
    if args.chunk_mb < 1 or args.threads < 1:
        parser.error("--chunk-mb and --threads must be positive")
    if BASELINE in args.skip:
        parser.error(f"{BASELINE} is the baseline of every ratio and cannot be skipped")
    return args


def route_library_logs(verbose: bool) -> None:
    """Send the library's structlog lines to stderr (warnings only unless verbose).

    An unconfigured structlog prints to stdout, which would mix with the table and the JSON.
    """
    import logging

    import structlog

    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.INFO if verbose else logging.WARNING),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    route_library_logs(args.verbose)
    parent = (args.dir or Path.cwd()).resolve()
    parent.mkdir(parents=True, exist_ok=True)
    fs_type = filesystem_of(parent).get("type")
    if fs_type in MEMORY_FILESYSTEMS:
        _log(f"WARNING: {parent} is on {fs_type}: fsync is a no-op there, so these numbers say "
             f"nothing about a disk. Pass --dir on a disk-backed filesystem.")
    need = int(args.size_gb * GB * 4)
    free = shutil.disk_usage(parent).free
    if free < need:
        _log(f"{parent} has {free / GB:.1f} GB free; this run needs about {need / GB:.1f} GB "
             f"(the pipeline keeps 2 checkpoints while a third is written). Use --dir or a "
             f"smaller --size-gb.")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix=".bench-cpu-save-", dir=parent))
    _log(f"writing under {workdir} ({fs_type})")
    try:
        machine = machine_info(workdir)
        started = time.perf_counter()
        measured = run_benchmark(args, workdir)
        wall = time.perf_counter() - started
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["command"] = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else None
    report = {
        "benchmark": "cpu_save",
        "schema_version": 1,
        "config": config,
        "machine": machine,
        "notes": list(NOTES),
        "wall_seconds": wall,
        "loadavg_at_end": os.getloadavg(),
        **measured,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _log(f"wrote {args.out}")
    if args.plot is not None:
        write_plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 1 if measured["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
