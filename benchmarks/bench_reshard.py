"""Restore onto another world size (issue 26): ckpt_pipeline's reshard against its same-size
restore and against DCP's resharded load, on CPU ranks of one host, in one run.

The state (``_reshard_worker.layout``, about ``--total-mib``): 16 float32 DTensors
``Shard(0)`` on a 1-D CPU mesh, most with row counts that divide by neither 2 nor 4, and an
FSDP2 model of four ``Linear`` layers (a quarter of the bytes). It is saved once on 2 and once
on 4 gloo ranks (``_reshard_worker.py save``), by ckpt_pipeline (``CheckpointPipeline``) into a
root the ranks share and by ``dcp.save`` into a directory, both under ``--root`` (on disk).

Each case (``4to2``, ``2to4``, and the same-size baselines ``2to2`` and ``4to4``) restores the
saved state into a freshly built, zeroed live state of the target world size, by each library:
``restore_latest`` (in a fresh hard-linked copy of the saved root, so that no run sees what an
earlier one wrote there) and DCP's recipe for FSDP2 (``get_model_state_dict``, ``dcp.load``,
``set_model_state_dict``). Every restore
is a fresh job, its ranks forked from this process once the imports are done (so that each
rank's peak memory is its own, and a job starts in a second): each rank times the call
between barriers, and the case's time is the slowest rank's. Every element restored is checked
against the values the state was built from; a restore that reads wrong bytes fails the run.
``--repeats`` rounds of every (case, library), the libraries' order alternating by round.

The files are in the page cache for both libraries alike (each file read through before each
restore; ``resident`` in the JSON): the figures are the libraries' costs, not the disk's.
``--cold`` drops each file's pages first (``posix_fadvise``, no root needed) and
``--drop-caches`` the whole cache (root; it slows everything else on the machine).

    python benchmarks/bench_reshard.py            # 1 GiB, 3 rounds -> results/reshard_cpu.json
    python benchmarks/bench_reshard.py --total-mib 64 --repeats 1 --out /tmp/reshard.json  # smoke
    python benchmarks/bench_reshard.py --cases 4to2,2to2 --json

The JSON holds, per case and library, every round's slowest-rank seconds, the median, each
rank's seconds and peak memory (the rise of VmHWM during the call over the RSS before it,
against the rank's share of the state), and the ratios against the issue's goals: a reshard at
most 1.3x the same-size restore of the target world size, and DCP's resharded load at least
1.5x ckpt_pipeline's reshard. Progress goes to stderr, the table last to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import _reshard_worker as worker  # noqa: E402
import torch  # noqa: E402
from _baselines import drop_page_cache_tree, resident_fraction, warm_page_cache  # noqa: E402
from _machine import filesystem_of, machine_info  # noqa: E402

DEFAULT_OUT = HERE / "results" / "reshard_cpu.json"
LIBS = ("ckpt_pipeline", "dcp")
CASES = {"4to2": (4, 2), "2to4": (2, 4), "2to2": (2, 2), "4to4": (4, 4)}
BASELINE = {"4to2": "2to2", "2to4": "4to4"}  # a reshard against the same-size restore of its M
GOAL_VS_SAME_SIZE = 1.3
GOAL_DCP_OVER_OURS = 1.5
PARTS = ("open_s", "dcp_state_dict_s", "dcp_load_s", "dcp_set_s", "build_s", "check_s")
"""A rank's figures besides the timed call, each reported as its max over the ranks."""
MiB = 1 << 20
PAGE_CACHE_NOTE = (
    "the checkpoint files were in the page cache for both libraries alike: each was read "
    "through just before each restore (resident: the fraction held then, by mincore); the "
    "figures are the libraries' costs reading from memory, not a disk's")


class JobFailed(RuntimeError):
    """A job of ranks failed or ran out of time; the message holds the first log's tail."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fork_rank(argv: list[str], env: dict[str, str], log: Path) -> int:
    """Fork one rank running ``_reshard_worker.main(argv)``, its output into ``log``; its pid.
    No thread runs in this process and torch has computed nothing here, so the child starts
    clean; it leaves with ``os._exit``."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(env)
        torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a process started afresh
        worker.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def memory_speed(mib: int = 256) -> dict[str, Any]:
    """GiB/s of writing ``mib`` MiB into memory this process never touched (a fresh
    allocation: the kernel's first-touch page faults, and on a virtual machine whatever its
    host does then) and into the same memory again (a copy into pages already there). A
    restore that allocates what it reads into pays the first rate, one into live memory the
    second."""
    size = mib * MiB
    source = torch.ones(size, dtype=torch.uint8)
    started = time.perf_counter()
    fresh = source.clone()
    fresh_s = time.perf_counter() - started
    started = time.perf_counter()
    fresh.copy_(source)
    again_s = time.perf_counter() - started
    return {"mib": mib, "fresh_gib_s": round(size / fresh_s / (1 << 30), 2),
            "touched_gib_s": round(size / again_s / (1 << 30), 2)}


def run_job(world: int, args: list[str], logs: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Run ``world`` ranks of the worker with ``args`` as one gloo job; what each wrote."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    outs = [logs / f"rank-{r}.json" for r in range(world)]
    pids = [_fork_rank([*args, "--out", str(outs[r])],
                       {**env, "RANK": str(r), "LOCAL_RANK": str(r)}, logs / f"rank-{r}.log")
            for r in range(world)]
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    try:
        while len(codes) < world:
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            now = time.monotonic()
            if failed_at is None and any(c != 0 for c in codes.values()):
                failed_at = now  # the others get a moment to report their own errors
            if now > deadline or (failed_at is not None and now > failed_at + 5.0):
                break
            time.sleep(0.05)
    finally:
        for pid in pids:
            if pid not in codes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    exit_codes = [codes[pid] for pid in pids]
    if any(exit_codes) or not all(o.exists() for o in outs):
        first = next((r for r, c in enumerate(exit_codes) if c != 0), 0)
        tail = (logs / f"rank-{first}.log").read_text(errors="replace")[-3000:]
        raise JobFailed(f"{world} ranks {args[0]}: exit codes {exit_codes}"
                        + (" (timed out)" if time.monotonic() > deadline else "")
                        + f"; rank {first}:\n{tail}")
    return [json.loads(o.read_text()) for o in outs]


def _link_shards(src: str, dst: str) -> None:
    """copytree's copy: a shard file hard-linked (its pages shared with the saved one), every
    other file copied (the pipeline refuses a lock file with two links)."""
    if src.endswith(".shard"):
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _du(root: Path) -> int:
    return sum(p.stat().st_size for p in _files(root))


def prepare_cache(root: Path, mode: str) -> float | None:
    """Warm or drop the page cache for ``root``'s files; the fraction resident after."""
    if mode == "drop":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    elif mode == "cold":
        drop_page_cache_tree(root)
    else:
        for path in _files(root):
            warm_page_cache(path)
    sizes = {p: p.stat().st_size for p in _files(root)}
    total = sum(sizes.values())
    fractions = [(resident_fraction(p), n) for p, n in sizes.items()]
    if total == 0 or any(f is None for f, _ in fractions):
        return None
    return sum(f * n for f, n in fractions if f is not None) / total


def restore_once(case: str, lib: str, args: argparse.Namespace, work: Path,
                 run: int) -> dict[str, Any]:
    """One restore job of ``case`` by ``lib``: the slowest rank's seconds and each rank's
    figures; ``problems`` lists any element that came back wrong."""
    saved, live = CASES[case]
    if lib == "ckpt_pipeline":
        source = work / f"ckpt-{saved}"
        root = work / f"run-{run}"
        shutil.copytree(source, root, copy_function=_link_shards)
    else:
        source = root = work / f"dcp-{saved}"
    try:
        resident = prepare_cache(source, args.cache)
        launched = time.monotonic()
        ranks = run_job(live, ["restore", "--lib", lib, "--root", str(root),
                               "--saved-world", str(saved), "--total-bytes",
                               str(args.total_bytes), "--timeout-s", str(args.timeout_s)],
                        work / "logs" / f"{run:03d}-{case}-{lib}", args.timeout_s)
    finally:
        if root != source:
            shutil.rmtree(root, ignore_errors=True)
    problems = [f"rank {r['rank']}: {p}" for r in ranks for p in r["problems"]]
    if lib == "ckpt_pipeline":
        want = None if saved == live else saved
        problems += [f"rank {r['rank']}: resharded_from {r.get('resharded_from')}, expected "
                     f"{want}" for r in ranks if r.get("resharded_from") != want]
        problems += [f"rank {r['rank']}: restored step {r.get('restored_step')}"
                     for r in ranks if r.get("restored_step") != 1]
    peaks = [_peak_rise(r) for r in ranks]
    return {"seconds": max(r["restore_s"] for r in ranks), "resident": resident,
            "job_wall_s": time.monotonic() - launched,
            "per_rank_s": [r["restore_s"] for r in ranks],
            "parts_max_s": {key: max(r[key] for r in ranks) for key in PARTS
                            if all(key in r for r in ranks)},
            "bytes_read": [r["bytes_read"] for r in ranks] if lib == "ckpt_pipeline" else None,
            "share_bytes": [r["share_bytes"] for r in ranks],
            "peak_rise_bytes": peaks,
            "peak_rise_over_share": max(p / r["share_bytes"] for p, r in zip(peaks, ranks)),
            "peak_reset": all(r["peak_reset"] for r in ranks),
            "rss_before_bytes": [r["rss_before_kib"] * 1024 for r in ranks],
            "problems": problems,
            **({"phases": [r["phases"] for r in ranks]} if all("phases" in r for r in ranks)
               else {})}


def _peak_rise(rank: dict[str, Any]) -> int:
    """VmHWM after the call over VmRSS before it, in bytes (with the reset, the call's own
    peak; without, the process's peak so far, which is an upper bound)."""
    rise: int = max(0, rank["hwm_after_kib"] - rank["rss_before_kib"]) * 1024
    return rise


def summarize(samples: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians over the rounds (a restore that read wrong bytes left out) and the ratios."""
    medians: dict[str, dict[str, float]] = {}
    peaks: dict[str, dict[str, float]] = {}
    for case, libs in samples.items():
        for lib, runs in libs.items():
            good = [s for s in runs if not s["problems"]]
            if good:
                medians.setdefault(case, {})[lib] = statistics.median(s["seconds"] for s in good)
                peaks.setdefault(case, {})[lib] = statistics.median(
                    s["peak_rise_over_share"] for s in good)
    ratios: dict[str, Any] = {}
    for case, base in BASELINE.items():
        ours, same = medians.get(case, {}).get("ckpt_pipeline"), medians.get(base, {}).get(
            "ckpt_pipeline")
        dcp = medians.get(case, {}).get("dcp")
        if ours is not None and same is not None:
            value = ours / same
            ratios[f"ckpt_pipeline_{case}_over_{base}"] = {
                "value": value, "goal": f"<= {GOAL_VS_SAME_SIZE}",
                "pass": value <= GOAL_VS_SAME_SIZE}
        if ours is not None and dcp is not None:
            value = dcp / ours
            ratios[f"dcp_over_ckpt_pipeline_{case}"] = {
                "value": value, "goal": f">= {GOAL_DCP_OVER_OURS}",
                "pass": value >= GOAL_DCP_OVER_OURS}
    for case, times in medians.items():
        if "ckpt_pipeline" in times and "dcp" in times and case not in BASELINE:
            ratios[f"dcp_over_ckpt_pipeline_{case}"] = {"value": times["dcp"] /
                                                        times["ckpt_pipeline"]}
    return {"median_s": medians, "median_peak_rise_over_share": peaks, "ratios": ratios}


def table(report: dict[str, Any]) -> str:
    gib = report["state"]["total_bytes"] / (1 << 30)
    lines = [f"{gib:.3f} GiB state; page cache: {report['page_cache']['mode']}; "
             f"max over ranks, median of {report['config']['repeats']}",
             "memory: {fresh_gib_s} GiB/s into fresh pages, {touched_gib_s} GiB/s into "
             "touched ones".format(**report["machine"].get(
                 "memory_speed", {"fresh_gib_s": "?", "touched_gib_s": "?"})),
             f"{'case':<6} {'library':<14} {'median s':>9} {'GB/s':>6} {'peak/share':>10}"
             "  samples s"]
    for case, libs in report["samples"].items():
        for lib, runs in libs.items():
            median = report["median_s"].get(case, {}).get(lib)
            peak = report["median_peak_rise_over_share"].get(case, {}).get(lib, float("nan"))
            rate = report["state"]["total_bytes"] / median / 1e9 if median else float("nan")
            shown = "-" if median is None else f"{median:.3f}"
            bad = " WRONG BYTES" if any(s["problems"] for s in runs) else ""
            lines.append(f"{case:<6} {lib:<14} {shown:>9} {rate:6.2f} {peak:10.2f}  "
                         + " ".join(f"{s['seconds']:.3f}" for s in runs) + bad)
    for name, ratio in report["ratios"].items():
        verdict = "" if "pass" not in ratio else (
            f" (goal {ratio['goal']}: {'met' if ratio['pass'] else 'NOT met'})")
        lines.append(f"{name}: {ratio['value']:.2f}{verdict}")
    return "\n".join(lines)


def _default_root() -> Path:
    """The temp directory, or /var/tmp where that is tmpfs."""
    for base in (tempfile.gettempdir(), "/var/tmp"):
        if os.path.isdir(base) and filesystem_of(Path(base)).get("type") != "tmpfs":
            return Path(base)
    return Path(tempfile.gettempdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=float, default=1024.0,
                        help="the state's size over every rank (default 1024)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--root", type=Path, default=None,
                        help="where the checkpoints go: a fresh directory is made there and "
                             "removed at the end (default /var/tmp or the temp directory; "
                             "not tmpfs)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--cold", action="store_true",
                       help="drop each checkpoint file's pages before each restore "
                            "(posix_fadvise; no root needed)")
    if os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK):
        cache.add_argument("--drop-caches", action="store_true",
                           help="drop the whole page cache before each restore (root)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per job of ranks")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and logs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or args.repeats < 1:
        parser.error(f"unknown case(s) {unknown}" if unknown else "--repeats must be >= 1")
    args.cache = ("drop" if getattr(args, "drop_caches", False) else
                  "cold" if args.cold else "warm")
    args.total_bytes = int(args.total_mib * MiB)
    base = args.root or _default_root()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-reshard-", dir=base))
    fs = filesystem_of(work)
    if fs.get("type") == "tmpfs":
        _log(f"warning: {work} is on tmpfs: no disk and no page cache behind the files")
    specs = worker.layout(args.total_bytes)
    report: dict[str, Any] = {
        "benchmark": "reshard_cpu", "command": " ".join([sys.executable, *sys.argv]),
        "machine": {**machine_info(work), "memory_speed": memory_speed()},
        "ckpt_pipeline_from": worker.LIBRARY_FILE,
        "config": {"cases": cases, "repeats": args.repeats, "root": str(work),
                   "timeout_s": args.timeout_s, "omp_num_threads": 1,
                   "ckpt_pipeline": "CheckpointPipeline defaults (restore_latest timed, the "
                                    "pipeline opened before the timer: open_s)",
                   "bench_env": {k: v for k, v in os.environ.items()
                                 if k.startswith("CKPT_BENCH_") and k != "CKPT_BENCH_COMMIT"},
                   "dcp": "dcp.save / dcp.load defaults (FileSystemWriter/Reader); the timed "
                          "call is DCP's recipe for FSDP2: get_model_state_dict, dcp.load, "
                          "set_model_state_dict (each also apart: dcp_*_s)"},
        "state": {"total_bytes": sum(s.nbytes for s in specs), "tensors": len(specs),
                  "layout": [{"group": s.group, "name": s.name, "shape": list(s.shape)}
                             for s in specs]},
        "page_cache": {"mode": args.cache, "note": PAGE_CACHE_NOTE if args.cache == "warm" else
                       "each checkpoint file's pages dropped before each restore"
                       + (" (the whole cache, drop_caches)" if args.cache == "drop" else
                          " (posix_fadvise DONTNEED)")},
        "memory": {"how": "per rank: VmHWM after the restore call minus VmRSS before it, the "
                          "peak reset through /proc/self/clear_refs (5) just before the call "
                          "(peak_reset false: not allowed, the figure is then an upper bound)"},
        "goals": {"reshard_over_same_size": f"<= {GOAL_VS_SAME_SIZE}",
                  "dcp_reshard_over_ckpt_pipeline_reshard": f">= {GOAL_DCP_OVER_OURS}"},
        "saves": {}, "samples": {}, "errors": [],
    }
    started = time.monotonic()
    try:
        for world in sorted({CASES[c][0] for c in cases}):
            _log(f"saving {report['state']['total_bytes'] / MiB:.0f} MiB on {world} ranks")
            ranks = run_job(world, ["save", "--total-bytes", str(args.total_bytes),
                                    "--ckpt-root", str(work / f"ckpt-{world}"),
                                    "--dcp-root", str(work / f"dcp-{world}"),
                                    "--timeout-s", str(args.timeout_s)],
                            work / "logs" / f"save-{world}", args.timeout_s)
            report["saves"][str(world)] = {
                "ckpt_pipeline_s": max(r["ckpt_pipeline_save_s"] for r in ranks),
                "dcp_s": max(r["dcp_save_s"] for r in ranks),
                "ckpt_pipeline_bytes": _du(work / f"ckpt-{world}"),
                "dcp_bytes": _du(work / f"dcp-{world}")}
        run = 0
        for round_ in range(args.repeats):
            order = LIBS if round_ % 2 == 0 else LIBS[::-1]
            for case in cases:
                for lib in order:
                    run += 1
                    try:
                        sample = restore_once(case, lib, args, work, run)
                    except JobFailed as exc:
                        report["errors"].append({"case": case, "lib": lib, "round": round_,
                                                 "error": str(exc)})
                        _log(f"  {case} {lib}: FAILED\n{exc}")
                        continue
                    report["samples"].setdefault(case, {}).setdefault(lib, []).append(sample)
                    if sample["problems"]:
                        report["errors"].append({"case": case, "lib": lib, "round": round_,
                                                 "error": "wrong bytes",
                                                 "problems": sample["problems"][:20]})
                    _log(f"  round {round_ + 1} {case} {lib}: {sample['seconds']:.3f} s"
                         + (" WRONG BYTES" if sample["problems"] else ""))
    except JobFailed as exc:  # a save failed: nothing to restore
        report["errors"].append({"save": True, "error": str(exc)})
        _log(f"FAILED: {exc}")
    finally:
        report["wall_s"] = time.monotonic() - started
        report["machine"]["loadavg_at_end"] = os.getloadavg()
        if args.keep:
            _log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report.update(summarize(report["samples"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    _log(f"wrote {args.out} ({report['wall_s']:.0f} s)")
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
