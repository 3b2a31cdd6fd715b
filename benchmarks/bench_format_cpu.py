"""What the on-disk format costs on a CPU: shard size, save and restore, against the floors.

For each case (a shape of state: many tiny tensors, a realistic mix, a few large ones, tied
weights, a view, one 2 GiB tensor; ``_format_cases.py``), every method runs on the same state,
in the same directory on the same disk, in one run:

- ``ckpt_save``: ``CheckpointPipeline(root, keep_last=1, buffer_slots=1).save()`` on one
  pipeline; ``ckpt_save_blocking`` until ``save()`` and ``wait_snapshot()`` return,
  ``ckpt_save_commit`` until ``handle.result()`` (committed). The first save allocates the host
  buffer and is reported apart (``first_save``), with ``host_memory_bytes``.
- ``torch_save``: ``torch.save`` of the plain state dict, fsync, rename, fsync of the directory.
- ``direct_write_threads``: the same bytes gathered (untimed) into one 4 KiB-aligned buffer,
  written with ``O_DIRECT`` from a pool of threads (8) in 64 MiB pieces, fsync, rename, fsync of
  the directory: how ckpt_pipeline writes, without the pipeline; the write floor its time to
  commit is measured against.
- ``plain_write_fsync``: the unique bytes of the state (each distinct storage's covered bytes
  once, small ones gathered into one buffer untimed), written with ``os.pwrite`` in large
  pieces, fsync, rename, fsync of the directory: the write floor.
- ``ckpt_restore``: a fresh pipeline on the same root, ``restore_latest(live)`` into a live
  state of the same structure (preallocated tensors, loaded in place); opening is not timed.
- ``torch_load``: ``torch.load(path, weights_only=True)``; ``torch_load_copy`` is the same load
  plus the copy into the same live state (``copy_`` per tensor, ``load_state_dict`` for a
  module), which is what a restore does.
- ``plain_read_fresh``: ckpt_pipeline's shard file read with ``os.preadv`` from a pool of
  threads (8), 64 MiB disjoint pieces, into a buffer allocated in the timed part (its pages are
  faulted in by the reads, as for any reader that makes new tensors): the read floor the
  restore goal is measured against.
- ``plain_read_threads``: the same into a buffer whose pages were touched before (untimed):
  the memory-speed floor, below what a restore can reach without reading into memory that
  already exists.

Every read runs cold and warm. Cold: every file under the run's directory is fsynced and
dropped from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` right before the timed
call (no privileges needed for clean pages; a VM's host may still cache the disk). Warm: the
files were just read through. Each sample records the fraction of the file the page cache held
before it (``mincore``), so that both can be checked. Methods run round-robin, one sample of
each per round, in an order shuffled anew each round (seeded); writes first (the pipeline holds
the root), then reads. The state is freed before the reads; restores are checked against
checksums of it. The 1,000,000-tensor and 4 GiB cases, and any case whose first save takes
longer than ``--cap-after-s``, run one round without warm-up (``--no-cap`` runs them all).

Run ``python benchmarks/bench_format_cpu.py --help`` for the options; results go to
``benchmarks/results/format_cpu.json``, figures and tables from ``plot_format.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from _baselines import (
    chunked,
    coalesced,
    drop_page_cache_tree,
    iter_tensors,
    plain_read_threads,
    plain_write_fsync,
    pwrite_threads_fsync,
    resident_fraction,
    torch_save,
    warm_page_cache,
)
from _format_cases import (
    Case,
    alias_report,
    copy_into,
    dtype_counts,
    fingerprint,
    make_cases,
    plain_state,
    region_views,
    select_cases,
    storage_regions,
)
from _machine import filesystem_of, machine_info
from bench_cpu_save import (
    MEMORY_FILESYSTEMS,
    PipelineRunner,
    import_ckpt_pipeline,
    pipeline_overrides,
    route_library_logs,
    settle,
    stage_medians,
    summarize,
)
from plot_format import CACHES, GOALS, READ_METHODS, derive, markdown

GB = 1e9
MiB = 1 << 20
ALIGN = 4096
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "format_cpu.json"
KEEP_LAST = 1
PIPELINE_OPTIONS = {"buffer_slots": 1}
WRITE_METHODS = ("plain_write_fsync", "direct_write_threads", "torch_save", "ckpt_save")
PADDED_TENSOR_BYTES = 4096
"""Format 1 stores each tensor at a 4 KiB-aligned offset: the memory and disk checks assume it."""
CACHE_NOTE = {
    "cold": "every file under the run's directory: os.fsync, then os.posix_fadvise(fd, 0, 0, "
            "POSIX_FADV_DONTNEED), right before the timed call; resident_before (mincore) "
            "shows what the page cache still held",
    "warm": "the files read through once right before the timed call",
}
NOTES = (
    "unique_bytes: the bytes of the distinct storages that the state's tensors cover (a tied "
    "weight once, a view inside its base); what any format must store.",
    "ckpt_save_commit, torch_save and plain_write_fsync run until the data and the name are "
    "durable (fsync of file and directory).",
    "plain_read_threads reads ckpt_pipeline's shard file itself (its padding included), so "
    "ckpt_restore / plain_read_threads is the cost of restore beyond reading that file.",
    "A case with repeats_capped_from ran one round without warm-up (cap_reason: the "
    "1,000,000-tensor and 4 GiB cases, and a case whose first save took longer than "
    "--cap-after-s); --no-cap runs them all. Warm-up rounds are of the writes only.",
    "GB is 1e9 bytes, MiB 2**20; per-tensor times are microseconds per tensor of the state.",
)


def aligned_copy(pieces: list[tuple[int, memoryview]], piece_bytes: int
                 ) -> tuple[list[tuple[int, memoryview]], torch.Tensor]:
    """The pieces' bytes in one 4 KiB-aligned buffer (its length rounded up to 4 KiB), cut
    into ``piece_bytes`` pieces for direct I/O; and the tensor that owns the buffer."""
    total = sum(piece.nbytes for _, piece in pieces)
    size = max(ALIGN, -(-total // ALIGN) * ALIGN)
    raw = torch.zeros(size + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    buffer = raw[skip:skip + size]
    view = buffer.numpy().data
    at = 0
    for _, piece in pieces:
        view[at:at + piece.nbytes] = piece.cast("B")
        at += piece.nbytes
    return [(start, view[start:min(start + piece_bytes, size)])
            for start in range(0, size, piece_bytes)], raw


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _meminfo_available() -> int | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def shard_files(root: Path) -> list[Path]:
    """The newest step's shard files (``step-*/rank-*.shard``)."""
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    return sorted(steps[-1].glob("*.shard")) if steps else []


def header_size(shard: Path) -> tuple[int | None, str]:
    """(header bytes, how they were found), from the shard preamble through the library's own
    decoder; None where it is not importable or its answer is not understood."""
    try:
        from ckpt_pipeline._format import shard as layout

        decode = layout.decode_preamble
    except (ImportError, AttributeError) as exc:
        return None, f"no decoder: {type(exc).__name__}: {exc}"
    size = shard.stat().st_size
    with open(shard, "rb") as f:
        raw = f.read(max(4096, getattr(layout, "PREAMBLE_SIZE", 0)))
    try:
        fields = tuple(decode(raw, size, str(shard)))
    except Exception as exc:
        return None, f"decode_preamble failed: {type(exc).__name__}: {exc}"
    # format 1 answers (offset, length, checksum), format 2 (version, offset, length, checksum)
    for offset, length in itertools.pairwise(fields):
        if isinstance(offset, int) and isinstance(length, int) and offset + length == size:
            return length, "ckpt_pipeline._format.shard.decode_preamble"
    return None, f"decode_preamble answered {fields!r}, not understood"


class CaseRun:
    """One case: build the state, run the writes then the reads, measure, free everything."""

    def __init__(self, case: Case, args: argparse.Namespace, workdir: Path, cp: Any,
                 shuffler: random.Random) -> None:
        self.case = case
        self.args = args
        self.dir = workdir / case.name
        self.root = self.dir / "ckpt"
        self.torch_file = self.dir / "torch" / "state.pt"
        self.cp = cp
        self.shuffler = shuffler
        self.repeats = args.repeats
        self.warmup = args.warmup_rounds
        self.samples: dict[str, list[float]] = {}
        self.errors: dict[str, str] = {}
        self.record: dict[str, Any] = {
            "kind": case.kind, "description": case.description, "params": case.params,
            "repeats": self.repeats, "repeats_capped_from": None, "cap_reason": None,
            "warmup_rounds": self.warmup, "round_orders": [], "errors": self.errors,
        }
        if case.heavy:
            self.cap("a heavy case (1,000,000 tensors, or 4 GiB and more)")

    def cap(self, reason: str) -> None:
        """One round, no warm-up (unless ``--no-cap``), so that a full run stays near 20 min."""
        if self.args.no_cap or (self.repeats == 1 and self.warmup == 0):
            return
        self.record.update(repeats=1, repeats_capped_from=self.repeats, warmup_rounds=0,
                           cap_reason=reason)
        self.repeats, self.warmup = 1, 0
        _log(f"{self.case.name}: one round ({reason}; --no-cap runs them all)")

    def fail(self, what: str) -> None:
        self.errors[what] = traceback.format_exc()
        _log(f"{self.case.name}: {what} failed:\n{self.errors[what]}")

    def add(self, name: str, seconds: float) -> None:
        self.samples.setdefault(name, []).append(seconds)

    def rounds(self, units: list[Any], run: Callable[[Any, bool], None], phase: str,
               warmup: int) -> None:
        for index in range(warmup + self.repeats):
            measured = index >= warmup
            order = units[:]
            self.shuffler.shuffle(order)
            label = f"{phase} {'round' if measured else 'warm-up'} {index + 1}"
            self.record["round_orders"].append({"round": label, "order": [str(u) for u in order]})
            for unit in order:
                if unit in units:  # a unit that failed is dropped from the later rounds
                    run(unit, measured)
                    settle()

    # --- writes --------------------------------------------------------------------------------

    def write_phase(self, state: dict[str, Any], plain: dict[str, Any],
                    regions: list[Any]) -> None:
        pieces = chunked(coalesced(region_views(regions), MiB), self.args.chunk_mb * MiB)
        direct_pieces, direct_keep = aligned_copy(pieces, self.args.chunk_mb * MiB)
        direct_pool = ThreadPoolExecutor(max_workers=self.args.read_threads,
                                         thread_name_prefix="bench-pwrite")
        (self.dir / "plain").mkdir(parents=True)
        self.torch_file.parent.mkdir(parents=True)
        units = list(WRITE_METHODS)
        runner: PipelineRunner | None = None
        if self.cp is None:
            units.remove("ckpt_save")
        else:
            try:
                runner = PipelineRunner(self.cp, self.root, state, self.args,
                                        keep_last=KEEP_LAST, options=PIPELINE_OPTIONS)
                runner.open()
                self.record["pipeline_settings"] = runner.settings
                _log(f"{self.case.name}: ckpt_pipeline first save (allocates the host buffer)")
                first = self.record["first_save"] = runner.save()
                self.record["host_memory_bytes"] = runner.pipe.host_memory_bytes
                if first["durable_s"] > self.args.cap_after_s:
                    self.cap(f"the first save took {first['durable_s']:.1f} s, more than "
                             f"--cap-after-s {self.args.cap_after_s:g}")
                settle()
            except Exception:
                self.fail("ckpt_save")
                units.remove("ckpt_save")
        saves: list[dict[str, Any]] = []

        def run(method: str, measured: bool) -> None:
            t0 = time.perf_counter()
            try:
                if method == "ckpt_save":
                    assert runner is not None
                    sample = runner.save()
                    sample["warmup"] = not measured
                    saves.append(sample)
                    seconds = sample["durable_s"]
                    if measured:
                        self.add("ckpt_save_blocking", sample["blocking_s"])
                elif method == "torch_save":
                    torch_save(plain, self.torch_file)
                    seconds = time.perf_counter() - t0
                elif method == "direct_write_threads":
                    final = self.dir / "plain" / "direct.bin"
                    pwrite_threads_fsync(direct_pieces, final, direct_pool, direct=True)
                    seconds = time.perf_counter() - t0
                    final.unlink()
                else:
                    final = self.dir / "plain" / "state.bin"
                    plain_write_fsync(pieces, final)
                    seconds = time.perf_counter() - t0
                    final.unlink()
            except Exception:
                self.fail(method)
                units.remove(method)
                return
            name = "ckpt_save_commit" if method == "ckpt_save" else method
            if measured:
                self.add(name, seconds)
            _log(f"{self.case.name}: {'' if measured else 'warm-up '}{name:<22} {seconds:8.3f} s")

        try:
            self.rounds(units, run, "write", self.warmup)
        finally:
            direct_pool.shutdown()
            del direct_keep
            if runner is not None:
                try:
                    runner.close()
                except Exception:
                    self.fail("ckpt_pipeline.close")
        self.record["ckpt_saves"] = saves
        measured_saves = [s for s in saves if not s["warmup"]]
        if measured_saves:
            self.record["stage_medians"] = stage_medians(measured_saves)

    def measure_files(self, unique: int) -> Path | None:
        sizes: dict[str, Any] = {"unique_bytes": unique}
        shards = shard_files(self.root) if self.root.exists() else []
        shard = shards[0] if shards else None
        if shard is not None:
            sizes["shard_bytes"] = shard.stat().st_size
            sizes["header_bytes"], sizes["header_source"] = header_size(shard)
            sizes["step_files_bytes"] = sum(p.stat().st_size for p in shard.parent.iterdir())
        if self.torch_file.exists():
            sizes["torch_file_bytes"] = self.torch_file.stat().st_size
        self.record["sizes"] = sizes
        return shard

    # --- reads ---------------------------------------------------------------------------------

    def prepare(self, cache: str, files: list[Path]) -> float | None:
        if cache == "cold":
            drop_page_cache_tree(self.dir)
        else:
            for path in files:
                warm_page_cache(path)
        return resident_fraction(files[0])

    def read_phase(self, live: dict[str, Any], expected: list[int], shard: Path | None) -> None:
        ckpt_files = [p for p in sorted(self.root.rglob("*")) if p.is_file()]
        if shard is not None:  # the shard first: its residency is the one recorded
            ckpt_files = [shard, *[p for p in ckpt_files if p != shard]]
        available = {"plain_read_threads": shard is not None,
                     "plain_read_fresh": shard is not None,
                     "torch_load": self.torch_file.exists(),
                     "ckpt_restore": shard is not None and self.cp is not None}
        units = [(m, c) for m in READ_METHODS for c in CACHES if available[m]]
        self.record["read_methods_left_out"] = [m for m, ok in available.items() if not ok]
        resident: dict[str, list[float | None]] = {}
        checks: dict[str, bool] = {}
        self.record["restore_check"] = checks
        self.record["resident_before"] = resident
        restores: list[dict[str, Any]] = []
        self.record["ckpt_restores"] = restores
        pool = ThreadPoolExecutor(max_workers=self.args.read_threads,
                                  thread_name_prefix="bench-pread")
        config = (self.cp.PipelineConfig(keep_last=KEEP_LAST, **PIPELINE_OPTIONS,
                                         **pipeline_overrides(self.args))
                  if self.cp is not None else None)

        def verify(name: str) -> None:
            checks[name] = fingerprint(live) == expected
            if not checks[name]:
                _log(f"{self.case.name}: {name} restored different values")

        def run(unit: tuple[str, str], measured: bool) -> None:
            method, cache = unit
            # the first restore and the first load are compared with the saved state
            check = not method.startswith("plain_read") and method not in checks
            if check:
                with torch.no_grad():
                    for t in iter_tensors(plain_state(live)):
                        t.zero_()
            try:
                if method == "ckpt_restore":
                    t0 = time.perf_counter()
                    with self.cp.CheckpointPipeline(self.root, config=config) as pipe:
                        opened = time.perf_counter() - t0
                        fraction = self.prepare(cache, ckpt_files)
                        t1 = time.perf_counter()
                        result = pipe.restore_latest(live)
                        seconds = {f"ckpt_restore_{cache}": time.perf_counter() - t1}
                    restores.append({"cache": cache, "open_s": opened,
                                     "step": getattr(result, "step", None),
                                     "result_seconds": getattr(result, "seconds", None),
                                     "result_bytes": getattr(result, "bytes", None)})
                elif method == "torch_load":
                    fraction = self.prepare(cache, [self.torch_file])
                    t0 = time.perf_counter()
                    loaded = torch.load(self.torch_file, weights_only=True)
                    t1 = time.perf_counter()
                    copy_into(live, loaded)
                    t2 = time.perf_counter()
                    del loaded
                    seconds = {f"torch_load_{cache}": t1 - t0, f"torch_load_copy_{cache}": t2 - t0}
                elif method == "plain_read_fresh":
                    assert shard is not None
                    fraction = self.prepare(cache, [shard])
                    t0 = time.perf_counter()
                    # new memory, as any reader that makes tensors gets: its pages are faulted
                    # in by the reads
                    buffer = torch.empty(max(shard.stat().st_size, 1), dtype=torch.uint8)
                    plain_read_threads(shard, buffer.numpy().data, pool,
                                       self.args.read_piece_mb * MiB)
                    seconds = {f"plain_read_fresh_{cache}": time.perf_counter() - t0}
                    del buffer
                else:
                    assert shard is not None
                    buffer = torch.empty(max(shard.stat().st_size, 1), dtype=torch.uint8)
                    buffer.zero_()  # fault the pages in, untimed: a floor
                    fraction = self.prepare(cache, [shard])
                    t0 = time.perf_counter()
                    plain_read_threads(shard, buffer.numpy().data, pool,
                                       self.args.read_piece_mb * MiB)
                    seconds = {f"plain_read_threads_{cache}": time.perf_counter() - t0}
                    del buffer
            except Exception:
                self.fail(f"{method}_{cache}")
                units.remove(unit)
                return
            if check:
                verify(method)
            resident.setdefault(f"{method}_{cache}", []).append(fraction)
            for name, value in seconds.items():
                if measured:
                    self.add(name, value)
                _log(f"{self.case.name}: {name:<26} {value:8.3f} s  (page cache held "
                     f"{'?' if fraction is None else f'{fraction:.0%}'} before)")

        try:
            self.rounds(units, run, "read", 0)
        finally:
            pool.shutdown()

    def alias_check(self, empty: Callable[[], dict[str, Any]], pair: Any) -> None:
        """Restore into empty containers (the checkpoint's tensors are materialized) and load
        with torch.load; do the two tensors that shared memory still share it?"""
        out: dict[str, Any] = {"pair": [pair.first, pair.second, pair.byte_offset]}
        self.record["alias"] = out
        if self.cp is not None and shard_files(self.root):
            try:
                target = empty()
                with self.cp.CheckpointPipeline(self.root, keep_last=KEEP_LAST) as pipe:
                    pipe.restore_latest(target)
                out["ckpt_restore"] = alias_report(target, pair)
            except Exception:
                self.fail("alias.ckpt_restore")
        if self.torch_file.exists():
            try:
                out["torch_load"] = alias_report(
                    torch.load(self.torch_file, weights_only=True), pair)
            except Exception:
                self.fail("alias.torch_load")

    # --- the case ------------------------------------------------------------------------------

    def fits(self, unique: int, tensors: int) -> str | None:
        """Why this case cannot run here (memory, disk), or None."""
        padded = tensors * PADDED_TENSOR_BYTES
        need_mem = 4 * unique + 3 * padded + tensors * 2048
        available = _meminfo_available()
        if available is not None and need_mem > available:
            return (f"needs about {need_mem / GB:.1f} GB of memory, {available / GB:.1f} GB "
                    "available")
        need_disk = 3 * unique + 2 * padded + 256 * MiB
        free = shutil.disk_usage(self.dir.parent).free
        if need_disk > free:
            return f"needs about {need_disk / GB:.1f} GB of disk, {free / GB:.1f} GB free"
        return None

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        _log(f"{self.case.name}: building the state ({self.case.description})")
        built = self.case.build()
        regions = storage_regions(built.state)
        unique = sum(end - start for _, start, end in regions)
        tensors = list(iter_tensors(plain_state(built.state)))
        storages = {owner.untyped_storage().data_ptr() for owner, _, _ in regions}
        self.record["state"] = {
            "tensors": len(tensors), "tensor_bytes": sum(t.nbytes for t in tensors),
            "unique_bytes": unique, "storages": len(storages),
            "dtypes": dtype_counts(built.state),
        }
        why = self.fits(unique, len(tensors))
        if why is not None:
            self.record["skipped"] = why
            _log(f"{self.case.name}: skipped: {why}")
            return self.record
        del tensors
        expected = fingerprint(built.state)
        live = built.make_live()
        empty, pair = built.empty, built.alias
        try:
            self.write_phase(built.state, built.plain, regions)
            shard = self.measure_files(unique)
            del built, regions  # the reads need only the live state: room for 4 GB cases
            gc.collect()
            self.read_phase(live, expected, shard)
            if empty is not None and pair is not None:
                self.alias_check(empty, pair)
        finally:  # what was measured is kept when a case stops half way
            shutil.rmtree(self.dir, ignore_errors=True)
            self.record["results"] = {
                name: summarize(secs, unique, None) for name, secs in self.samples.items()}
            self.record["seconds"] = time.perf_counter() - started
        return self.record


# --- the run ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="What the on-disk format costs on a CPU: shard size, ckpt_pipeline save "
                    "and restore against torch.save, torch.load and plain write/read floors.")
    parser.add_argument("--cases", action="append", default=[],
                        help="cases to run, by name or kind, comma-separated or repeated "
                             "(default: all; --list shows them)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--quick", action="store_true",
                        help="small cases, one round, no warm-up: a smoke test of seconds")
    parser.add_argument("--repeats", type=int, default=None,
                        help="measured rounds of every method (default 3; 1 with --quick)")
    parser.add_argument("--warmup-rounds", type=int, default=None,
                        help="untimed rounds of the writes first (default 1; 0 with --quick)")
    parser.add_argument("--no-cap", action="store_true",
                        help="run every case --repeats times with warm-up (by default the "
                             "1,000,000-tensor and 4 GiB cases, and any whose first save takes "
                             "longer than --cap-after-s, run one round without warm-up)")
    parser.add_argument("--cap-after-s", type=float, default=10.0,
                        help="a first save longer than this caps the case to one round; "
                             "default 10")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the method order within each round; default 0")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write; a fresh hidden subdirectory is made and removed "
                             "(default: under the current directory; not tmpfs)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"JSON results (default {DEFAULT_OUT.relative_to(REPO)}); "
                             "rewritten after every case")
    parser.add_argument("--chunk-mb", type=int, default=64,
                        help="write size of plain_write_fsync in MiB; default 64")
    parser.add_argument("--read-threads", type=int, default=8,
                        help="threads of plain_read_threads; default 8")
    parser.add_argument("--read-piece-mb", type=int, default=64,
                        help="read size of plain_read_threads in MiB; default 64")
    parser.add_argument("--io-threads", type=int, default=None,
                        help="PipelineConfig.io_threads (default: the library's)")
    parser.add_argument("--pipeline-chunk-mb", type=int, default=None,
                        help="PipelineConfig.chunk_bytes in MiB (default: the library's)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the library's info log lines (on stderr)")
    parser.add_argument("--json", action="store_true",
                        help="print the JSON report on stdout instead of the tables")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.warmup_rounds is None:
        args.warmup_rounds = 0 if args.quick else 1
    if args.repeats < 1 or args.warmup_rounds < 0:
        parser.error("--repeats must be positive, --warmup-rounds not negative")
    if min(args.chunk_mb, args.read_threads, args.read_piece_mb) < 1:
        parser.error("--chunk-mb, --read-threads and --read-piece-mb must be positive")
    try:
        args.case_list = select_cases(make_cases(args.quick), args.cases)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for case in args.case_list:
            print(f"{case.name:<20} {case.kind:<11} {case.description}"
                  + ("  (one round unless --no-cap)" if case.heavy else ""))
        return 0
    route_library_logs(args.verbose)
    parent = (args.dir or Path.cwd()).resolve()
    parent.mkdir(parents=True, exist_ok=True)
    fs_type = filesystem_of(parent).get("type")
    if fs_type in MEMORY_FILESYSTEMS:
        _log(f"WARNING: {parent} is on {fs_type}: no disk, no page cache to drop; these numbers "
             "say nothing about a disk. Pass --dir on a disk-backed filesystem.")
    library: dict[str, Any] = {}
    try:
        cp = import_ckpt_pipeline()
        library["version"] = getattr(cp, "__version__", None)
        library["path"] = str(Path(cp.__file__).parent)
        with contextlib.suppress(ImportError, AttributeError):
            from ckpt_pipeline._format import documents

            library["format_version"] = documents.FORMAT_VERSION
    except Exception:
        cp = None
        library["import_error"] = traceback.format_exc()
        _log(f"ckpt_pipeline does not import; its methods are left out:\n"
             f"{library['import_error']}")
    workdir = Path(tempfile.mkdtemp(prefix=".bench-format-cpu-", dir=parent))
    _log(f"writing under {workdir} ({fs_type})")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k != "case_list"}
    config["case_names"] = [c.name for c in args.case_list]
    config["command"] = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else None
    report: dict[str, Any] = {
        "benchmark": "format_cpu", "schema_version": 1, "config": config,
        "machine": machine_info(workdir), "library": library, "cache": CACHE_NOTE,
        "goals": GOALS, "notes": list(NOTES), "complete": False, "cases": {},
    }
    shuffler = random.Random(args.seed)
    started = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for case in args.case_list:
            run = CaseRun(case, args, workdir, cp, shuffler)
            try:
                record = run.run()
            except Exception:
                run.fail("case")
                record = run.record
            with contextlib.suppress(Exception):
                derive(record)
            report["cases"][case.name] = record
            gc.collect()
            report["wall_seconds"] = time.perf_counter() - started
            args.out.write_text(json.dumps(report, indent=2) + "\n")
            _log(f"{case.name}: done in {record.get('seconds', 0):.1f} s; wrote {args.out}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["complete"] = True
    report["wall_seconds"] = time.perf_counter() - started
    report["loadavg_at_end"] = os.getloadavg()
    failed = {name: sorted(r["errors"]) for name, r in report["cases"].items() if r["errors"]}
    report["errors"] = failed
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _log(f"wrote {args.out} ({report['wall_seconds']:.0f} s)")
    print(json.dumps(report, indent=2) if args.json else markdown(report, short=True))
    return 1 if failed or cp is None else 0


if __name__ == "__main__":
    sys.exit(main())
