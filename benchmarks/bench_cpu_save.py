"""Time to make a CPU state durable: ckpt_pipeline against plain writes and torch.save.

Every method writes the same bytes of the same state to the same disk, in one run, and counts
as done only once the data and its name are on disk (fsync of the file, rename, fsync of the
directory). Methods run round-robin, one repeat of each per round, so that drift of the disk
or of the machine spreads over all of them.

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
  opened once; its first save allocates the host buffer and is reported apart as the warm-up.
  ``ckpt_pipeline_blocking`` is the part of it spent in ``save()`` and ``wait_snapshot()``.

Reads are not measured: a read benchmark needs a cold page cache, which this one does not
arrange.

Run ``python benchmarks/bench_cpu_save.py --help`` for the options; results go to
``benchmarks/results/cpu_save.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

GB = 1e9  # decimal gigabytes, for sizes and for GB/s
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu_save.json"
BASELINE = "plain_write_fsync"
BLOCKING = "ckpt_pipeline_blocking"
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


# --- the state --------------------------------------------------------------------------------


def make_state(total_bytes: int, tensors: int, seed: int = 0) -> dict[str, Any]:
    """A nested dict of float32 CPU tensors of random values, about ``total_bytes`` in all."""
    numel = max(1, total_bytes // tensors // 4)
    gen = torch.Generator().manual_seed(seed)
    half = tensors // 2
    model = {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(half)}
    optim = {f"exp_avg.{i}": torch.randn(numel, generator=gen) for i in range(tensors - half)}
    return {"model": model, "optim": optim}


def iter_tensors(state: Any) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from iter_tensors(value)


def byte_views(state: Any) -> list[memoryview]:
    return [memoryview(t.numpy()).cast("B") for t in iter_tensors(state)]


def chunked(views: list[memoryview], chunk_bytes: int) -> list[tuple[int, memoryview]]:
    """(file offset, bytes) pieces of at most ``chunk_bytes``, the views laid end to end."""
    pieces = []
    offset = 0
    for view in views:
        for start in range(0, view.nbytes, chunk_bytes):
            piece = view[start:start + chunk_bytes]
            pieces.append((offset, piece))
            offset += piece.nbytes
    return pieces


# --- durable writes ---------------------------------------------------------------------------


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def plain_write_fsync(pieces: list[tuple[int, memoryview]], final: Path) -> None:
    tmp = final.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset, piece in pieces:
            _pwrite_all(fd, piece, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    _publish(tmp, final)


def pwrite_threads_fsync(
    pieces: list[tuple[int, memoryview]], final: Path, pool: ThreadPoolExecutor
) -> None:
    tmp = final.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        futures = [pool.submit(_pwrite_all, fd, piece, offset) for offset, piece in pieces]
        for future in futures:
            future.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    _publish(tmp, final)


async def _aiofiles_write(pieces: list[tuple[int, memoryview]], final: Path) -> None:
    import aiofiles
    import aiofiles.os

    tmp = final.with_suffix(".tmp")
    async with aiofiles.open(tmp, "wb") as f:
        for _, piece in pieces:
            await f.write(piece)
        await f.flush()
        await asyncio.to_thread(os.fsync, f.fileno())
    await aiofiles.os.rename(tmp, final)
    await asyncio.to_thread(_fsync_dir, final.parent)


def aiofiles_write_fsync(pieces: list[tuple[int, memoryview]], final: Path) -> None:
    asyncio.run(_aiofiles_write(pieces, final))


def torch_save(state: dict[str, Any], final: Path) -> None:
    tmp = final.with_suffix(".tmp")
    torch.save(state, tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _publish(tmp, final)


# --- ckpt_pipeline ----------------------------------------------------------------------------


def import_ckpt_pipeline() -> Any:
    """The library, from the environment or else from this checkout."""
    try:
        import ckpt_pipeline
    except ImportError:
        sys.path.insert(0, str(REPO))
        import ckpt_pipeline
    return ckpt_pipeline


class PipelineRunner:
    """One pipeline, opened once, saving the same state at increasing steps."""

    def __init__(self, cp: Any, root: Path, state: dict[str, Any], args: argparse.Namespace):
        self.cp = cp
        self.root = root
        self.state = state
        self.args = args
        self.step = 0
        self.stack = contextlib.ExitStack()
        self.settings: dict[str, Any] = {"keep_last": 2}

    def open(self) -> None:
        kwargs: dict[str, Any] = {"keep_last": 2}
        overrides = {}
        if self.args.io_threads is not None:
            overrides["io_threads"] = self.args.io_threads
        if self.args.pipeline_chunk_mb is not None:
            overrides["chunk_bytes"] = self.args.pipeline_chunk_mb * MiB
        if overrides:
            config = self.cp.PipelineConfig(keep_last=2, **overrides)
            kwargs = {"config": config}
            self.settings = {"keep_last": 2, **overrides}
        self.pipe = self.stack.enter_context(self.cp.CheckpointPipeline(self.root, **kwargs))
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
        return {
            "step": self.step,
            "durable_s": t3 - t0,
            "blocking_s": t2 - t0,
            "save_call_s": t1 - t0,
            "wait_snapshot_s": t2 - t1,
            "commit_info_seconds": getattr(info, "seconds", None),
            "bytes_written": getattr(info, "bytes", None),
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
            _log("ckpt_pipeline: warm-up save (allocates the host buffer)")
            pipeline["warmup"] = runner.save()
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

    try:
        for repeat in range(args.repeats):
            shift = repeat % len(methods)
            for method in methods[shift:] + methods[:shift]:
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
                    pipeline["saves"].append(sample)
                    samples["ckpt_pipeline"].append(sample["durable_s"])
                    samples[BLOCKING].append(sample["blocking_s"])
                    seconds = sample["durable_s"]
                elif method == "ckpt_pipeline":
                    continue
                else:
                    seconds = run_one(method, repeat)
                    samples[method].append(seconds)
                _log(f"round {repeat + 1}/{args.repeats}  {method:<22} {seconds:8.3f} s")
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
        "ckpt_pipeline": pipeline,
        "errors": errors,
    }


# --- where and on what ------------------------------------------------------------------------


def filesystem_of(path: Path) -> dict[str, Any]:
    real = os.path.realpath(path)
    best: dict[str, Any] = {}
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            device, mount_point, fstype, options, *_ = line.split()
            inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best.get("mount_point", "")):
                best = {"device": device, "mount_point": mount_point, "type": fstype,
                        "options": options}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        df = subprocess.run(["df", "-T", "-B1", real], capture_output=True, text=True, timeout=10)
        if df.returncode == 0:
            best["df_T"] = df.stdout.strip()
    return best


def machine_info(workdir: Path) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "filesystem": filesystem_of(workdir),
        "loadavg_at_start": os.getloadavg(),
    }
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                info["mem_total_gb"] = round(int(line.split()[1]) * 1024 / GB, 1)
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    for package in ("numpy", "aiofiles", "anyio", "msgpack", "xxhash"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            info[package] = version(package)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            info["git_commit"] = head.stdout.strip()
            info["git_dirty"] = bool(dirty.stdout.strip())
    return info


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
    warmup = report["ckpt_pipeline"].get("warmup")
    if warmup:
        footer.append(f"ckpt_pipeline warm-up save (excluded): {warmup['durable_s']:.3f} s to "
                      f"durable, {warmup['blocking_s']:.3f} s blocking")
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
    if args.size_gb <= 0 or args.tensors < 1 or args.repeats < 1:
        parser.error("--size-gb, --tensors and --repeats must be positive")
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
