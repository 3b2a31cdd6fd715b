"""How the per-save cost of the control plane (and of replication) grows with the number of ranks.

For each number of ranks and each number of replicas, ``bench_scale.py`` starts that many CPU
processes (``_scale_worker.py``), joined in a gloo job on this machine (env://, a fresh
MASTER_PORT per configuration), each with a root of its own (``<dir>/rank-<r>``) and a small
state (``--tensors`` float32 tensors, ``--state-kib`` in all, plus a TrainState). Every rank
opens a ``CheckpointPipeline`` (which coordinates over a gloo group of its own), saves
``--saves`` times waiting for each commit, restores the latest step once and closes. Ranks are
placed on ``ranks / --ranks-per-node`` pretend nodes (``node_name``), which is what replication
places copies by. The state is small so that the figures are those of the coordination, not of
the disk; ``--dir`` defaults to ``/dev/shm`` (tmpfs) for the same reason. ``--control`` chooses
the control plane: ``flat`` (``DistributedCoordinator``, one all-gather of every rank) and/or
``hier`` (``HierarchicalCoordinator``: the ranks get ``LOCAL_WORLD_SIZE=--ranks-per-node``, as
torchrun would set it, and the pipeline agrees per node first), each run in turn.

    python benchmarks/bench_scale.py                                     # 8..64 ranks, 0 and 1 replicas
    python benchmarks/bench_scale.py --ranks 8,16 --replicas 0 --saves 5 --out /tmp/scale.json
    python benchmarks/bench_scale.py --ranks 4 --replicas 0 --saves 3 --out /tmp/s.json   # smoke
    python benchmarks/bench_scale.py --ranks 8,16 --replicas 0 --ranks-per-node 4 \
        --control flat,hier --out /tmp/scale-hier.json           # flat against per node first

Per configuration the JSON holds, for every per-save figure, the median over the saves of each
rank (the first save, the warm-up, left out), then the max, median and min of those over the
ranks (the slowest rank decides when a step is committed); the once-per-run figures (open,
restore, close) the same way over ranks; cross-rank figures per save, from the ranks'
``time.monotonic()`` stamps (one host, one clock); each rank's medians; and memory (RSS, PSS).
A configuration that fails is recorded with its error and the run goes on; the exit status is 1
then. Progress goes to stderr, the table last to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import filesystem_of, machine_info

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_scale_worker.py"
DEFAULT_OUT = HERE / "results" / "scale.json"

PER_SAVE = ("blocking_s", "save_call_s", "seal_s", "commit_stage_s", "durable_s",
            "result_returned_s", "replicate_s")
ONCE = ("construct_s", "open_s", "restore_s", "close_s", "init_process_group_s",
        "ready_after_launch_s")
RSS_GUESS_MIB = 400.0
"""Resident memory assumed per rank before any has been measured (torch imported, gloo up)."""
KILL_GRACE_S = 10.0
"""After the first rank fails, how long the others get to report their own errors."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected e.g. 8,16,32")
    return values


def _controls(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("flat", "hier") for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected flat, hier or flat,hier")
    return values


def _meminfo_mib() -> dict[str, float]:
    out: dict[str, float] = {}
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(rest.split()[0]) / 1024
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"max_over_ranks": max(values), "median_over_ranks": statistics.median(values),
            "min_over_ranks": min(values)}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def default_dir() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def default_timeout(ranks: int, saves: int) -> float:
    """Generous: on a 2-core machine each rank's start (torch import, gloo mesh) is serialized."""
    return 120.0 + ranks * (3.0 + 0.5 * saves)


# --- one configuration ---------------------------------------------------------------------------


def run_config(args: argparse.Namespace, ranks: int, replicas: int, work: Path,
               keep_logs: Path | None, control: str = "flat") -> dict[str, Any]:
    """Start the ranks, wait for them (bounded), read what each wrote, aggregate."""
    timeout = args.timeout_s if args.timeout_s is not None else default_timeout(ranks, args.saves)
    sizes = _int_list(args.node_sizes) if args.node_sizes else None
    config: dict[str, Any] = {"ranks": ranks, "replicas": replicas, "control": control,
                              "nodes": len(sizes) if sizes else -(-ranks // args.ranks_per_node),
                              "node_sizes": sizes,
                              "timeout_s": timeout, "status": "failed"}
    if replicas > config["nodes"] - 1:
        config["status"] = "skipped"
        config["error"] = (f"{replicas} replica(s) need {replicas + 1} nodes; "
                           f"{ranks} ranks at {args.ranks_per_node} per node make "
                           f"{config['nodes']}")
        return config
    run_dir = Path(tempfile.mkdtemp(prefix=f".bench-scale-{ranks}r{replicas}-", dir=work))
    logs = run_dir / "logs"
    logs.mkdir()
    launched = time.monotonic()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(ranks), "SCALE_LAUNCHED_AT": repr(launched),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("LOCAL_WORLD_SIZE", None)
    if control == "hier" and not sizes:  # the pipeline makes a HierarchicalCoordinator itself
        env["LOCAL_WORLD_SIZE"] = str(args.ranks_per_node)
    common = ["--saves", str(args.saves), "--replicas", str(replicas),
              "--ranks-per-node", str(args.ranks_per_node), "--node-sizes", args.node_sizes,
              "--tensors", str(args.tensors),
              "--state-kib", str(args.state_kib), "--keep-last", str(args.keep_last),
              "--io-threads", str(args.io_threads),
              "--coordination-timeout-s", str(args.coordination_timeout_s),
              "--save-timeout-s", str(args.coordination_timeout_s * 2),
              "--max-seconds", str(timeout + 30.0)]
    if args.direct_io:
        common.append("--direct-io")
    procs: list[subprocess.Popen[bytes]] = []
    log_files = []
    mem_available_min = _meminfo_mib().get("MemAvailable")
    try:
        for rank in range(ranks):
            log = open(logs / f"rank-{rank}.log", "wb")  # noqa: SIM115 (closed below)
            log_files.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--root", str(run_dir / f"rank-{rank}"),
                 "--out", str(logs / f"rank-{rank}.json"), *common],
                env={**env, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT,
                cwd=HERE))
        deadline = launched + timeout
        failed_at: float | None = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + KILL_GRACE_S):
                why = (f"timed out after {timeout:.0f} s" if now > deadline else
                       f"a rank failed; the others killed after {KILL_GRACE_S:.0f} s")
                config["error"] = why
                running = [r for r, c in enumerate(codes) if c is None]
                config["killed_ranks"] = running
                _log(f"  {why}: killing {len(running)} rank(s)")
                break
            avail = _meminfo_mib().get("MemAvailable")
            if avail is not None and mem_available_min is not None:
                mem_available_min = min(mem_available_min, avail)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        for log in log_files:
            log.close()
    config["wall_s"] = time.monotonic() - launched
    config["exit_codes"] = [p.returncode for p in procs]

    results: dict[int, dict[str, Any]] = {}
    for rank in range(ranks):
        path = logs / f"rank-{rank}.json"
        if path.exists():
            with contextlib.suppress(ValueError):
                results[rank] = json.loads(path.read_text())
    errors = {r: res["error"] for r, res in results.items() if res.get("error")}
    if errors or len(results) < ranks or any(c != 0 for c in config["exit_codes"]):
        first = min(errors) if errors else next(
            (r for r, c in enumerate(config["exit_codes"]) if c != 0), None)
        config.setdefault("error", "a rank failed")
        config["rank_errors"] = {str(r): e for r, e in sorted(errors.items())[:8]}
        config["missing_results"] = [r for r in range(ranks) if r not in results]
        if first is not None:
            config["first_failed_rank"] = first
            tb = results.get(first, {}).get("traceback")
            log_tail = (logs / f"rank-{first}.log").read_text(errors="replace")[-4000:]
            config["first_failed_detail"] = tb or log_tail
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())[:3])
        if not detail and config.get("first_failed_detail"):  # died before writing its JSON
            lines = config["first_failed_detail"].strip().splitlines()
            detail = f"rank {first}: {lines[-1] if lines else '(empty log)'}"
        _log(f"  FAILED: {config['error']}; {detail}")
    else:
        config["status"] = "ok"
    if results:
        config["library"] = sorted({str(res.get("library")) for res in results.values()})
        config["coordinators"] = sorted({str(res.get("coordinator"))
                                         for res in results.values()})
        config.update(aggregate(results, args.skip_first))
        config["memory"]["mem_available_min_mib"] = mem_available_min
        if args.raw:
            config["raw"] = {str(r): res for r, res in sorted(results.items())}
    if keep_logs is not None:
        dest = keep_logs / f"ranks{ranks}-replicas{replicas}-{control}"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(logs, dest)
    shutil.rmtree(run_dir, ignore_errors=True)
    return config


def aggregate(results: dict[int, dict[str, Any]], skip_first: int) -> dict[str, Any]:
    """Per rank: the median of each per-save figure over the measured saves; then over ranks."""
    per_rank: list[dict[str, Any]] = []
    for rank, res in sorted(results.items()):
        saves = res.get("saves", [])
        measured = saves[skip_first:] if len(saves) > skip_first else saves
        row: dict[str, Any] = {"rank": rank, "saves_measured": len(measured)}
        for key in PER_SAVE:
            row[key] = _median([s.get(key) for s in measured])
        for key in ONCE:
            row[key] = res.get(key)
        row["first_save_durable_s"] = saves[0]["durable_s"] if saves else None
        row["restore_ok"] = res.get("restore_ok")
        row["memory"] = res.get("memory")
        per_rank.append(row)

    aggregates: dict[str, Any] = {}
    for key in (*PER_SAVE, *ONCE, "first_save_durable_s"):
        values = [r[key] for r in per_rank if r.get(key) is not None]
        if values:
            aggregates[key] = _spread(values)

    # Across ranks, per save (the same step on every rank), from the monotonic stamps.
    cross: dict[str, list[float]] = {"commit_after_last_shard_s": [],
                                     "written_spread_s": [], "committed_spread_s": [],
                                     "start_spread_s": [], "step_s": []}
    steps = sorted({s["step"] for res in results.values() for s in res.get("saves", [])})
    for step in steps[skip_first:] if len(steps) > skip_first else steps:
        rows = [s for res in results.values() for s in res.get("saves", []) if s["step"] == step]
        if len(rows) != len(results):
            continue
        written = [s["written_mono"] for s in rows if s.get("written_mono") is not None]
        committed = [s["committed_mono"] for s in rows if s.get("committed_mono") is not None]
        started = [s["start_mono"] for s in rows]
        if len(written) != len(rows) or len(committed) != len(rows):
            continue
        cross["commit_after_last_shard_s"].append(max(committed) - max(written))
        cross["written_spread_s"].append(max(written) - min(written))
        cross["committed_spread_s"].append(max(committed) - min(committed))
        cross["start_spread_s"].append(max(started) - min(started))
        cross["step_s"].append(max(committed) - min(started))
    cross_rank = {k: {"median": statistics.median(v), "max": max(v), "samples": len(v)}
                  for k, v in cross.items() if v}

    mems = [r["memory"] for r in per_rank if r.get("memory")]
    memory: dict[str, Any] = {}
    for key in ("rss_peak_mib", "pss_mib"):
        values = [m[key] for m in mems if m.get(key) is not None]
        if values:
            memory[f"{key}_max"] = max(values)
            memory[f"{key}_median"] = statistics.median(values)
            memory[f"{key}_sum"] = round(sum(values), 1)
    replicated = [c for res in results.values() for s in res.get("saves", [])
                  for c in s.get("replicated", [])]
    missing = sum(len(s.get("missing_replicas", [])) for res in results.values()
                  for s in res.get("saves", []))
    return {"aggregates": aggregates, "cross_rank": cross_rank, "memory": memory,
            "replication": {"copies_sent": len(replicated), "missing_reported": missing,
                            "bytes_sent": sum(c["bytes"] for c in replicated)},
            "restore_ok_all": all(r.get("restore_ok") is True for r in per_rank),
            "ranks_reported": len(per_rank), "per_rank": per_rank}


# --- memory check --------------------------------------------------------------------------------


def memory_warning(ranks: int, per_rank_mib: float, measured: bool) -> str | None:
    mem = _meminfo_mib()
    avail, total = mem.get("MemAvailable"), mem.get("MemTotal")
    if avail is None or total is None:
        return None
    need = ranks * per_rank_mib
    if need < 0.7 * avail:
        return None
    how = "measured" if measured else "assumed"
    return (f"{ranks} ranks x {per_rank_mib:.0f} MiB ({how} resident per rank) = "
            f"{need / 1024:.1f} GiB, close to or over the {avail / 1024:.1f} GiB available "
            f"({total / 1024:.1f} GiB total): the run may swap or be killed")


# --- report --------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-".rjust(8) if value is None else f"{value * 1e3:8.1f}"


def table(report: dict[str, Any]) -> str:
    head = (f"{'ranks':>5} {'repl':>4} {'status':>7} {'open':>8} {'block':>8} {'commit':>8} "
            f"{'vote':>8} {'durable':>8} {'replic':>8} {'restore':>8} {'wall s':>7} "
            f"{'control':>7}")
    lines = ["ms; per-save figures: median over saves 2..N of each rank, then the max over "
             "ranks;", "vote: last rank's commit after the last shard was written (median)",
             head]
    for c in report["configs"]:
        agg = c.get("aggregates", {})

        def mx(key: str, agg: dict[str, Any] = agg) -> float | None:
            value = agg.get(key, {}).get("max_over_ranks")
            return None if value is None else float(value)

        vote = c.get("cross_rank", {}).get("commit_after_last_shard_s", {}).get("median")
        lines.append(
            f"{c['ranks']:>5} {c['replicas']:>4} {c['status']:>7} {_ms(mx('open_s'))} "
            f"{_ms(mx('blocking_s'))} {_ms(mx('commit_stage_s'))} {_ms(vote)} "
            f"{_ms(mx('durable_s'))} {_ms(mx('replicate_s'))} {_ms(mx('restore_s'))} "
            f"{c.get('wall_s', 0.0):7.1f} {c.get('control', 'flat'):>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=_int_list, default=[8, 16, 32, 64],
                        help="numbers of ranks, comma-separated (default 8,16,32,64)")
    parser.add_argument("--replicas", type=_int_list, default=[0, 1],
                        help="numbers of replicas, comma-separated (default 0,1)")
    parser.add_argument("--saves", type=int, default=10,
                        help="saves per configuration, the first one a warm-up (default 10)")
    parser.add_argument("--ranks-per-node", type=int, default=2,
                        help="ranks per pretend node (node_name), default 2")
    parser.add_argument("--node-sizes", default="",
                        help="consecutive pretend nodes of these sizes, comma-separated (e.g. "
                             "8,1: a node of 8 beside a node of one); --ranks is then their "
                             "sum and --control hier (the workers make a "
                             "HierarchicalCoordinator(nodes=...)); default: --ranks-per-node")
    parser.add_argument("--control", type=_controls, default=["flat"],
                        help="control planes, comma-separated: flat (DistributedCoordinator), "
                             "hier (HierarchicalCoordinator, nodes of --ranks-per-node); "
                             "default flat")
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--state-kib", type=int, default=1024,
                        help="state size per rank in KiB (default 1024)")
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--io-threads", type=int, default=2,
                        help="PipelineConfig.io_threads per rank (default 2: many ranks share "
                             "the cores)")
    parser.add_argument("--direct-io", action="store_true",
                        help="PipelineConfig.direct_io (off by default: tmpfs refuses O_DIRECT)")
    parser.add_argument("--coordination-timeout-s", type=float, default=120.0)
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="wall-clock bound per configuration (default 120 + ranks * "
                             "(3 + 0.5 * saves) s)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the ranks' roots go (default /dev/shm, else the temp dir)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--raw", action="store_true",
                        help="also store every rank's raw per-save records in the JSON")
    parser.add_argument("--keep-logs", type=Path, default=None,
                        help="copy every rank's log and JSON into this directory")
    args = parser.parse_args(argv)
    if args.saves < 1 or args.ranks_per_node < 1 or min(args.ranks) < 1:
        parser.error("--saves, --ranks-per-node and every --ranks must be positive")
    args.skip_first = 1 if args.saves > 1 else 0
    if args.node_sizes:
        sizes = _int_list(args.node_sizes)
        if min(sizes) < 1 or args.ranks != [sum(sizes)] or args.control != ["hier"]:
            parser.error("--node-sizes needs --ranks equal to their sum and --control hier")
    work = args.dir if args.dir is not None else default_dir()
    work.mkdir(parents=True, exist_ok=True)
    fs = filesystem_of(work)

    notes: list[str] = []
    if fs.get("type") == "tmpfs":
        notes.append(f"roots on tmpfs ({work}): fsync is a no-op, no disk time is measured")
    else:
        notes.append(f"roots on {fs.get('type', 'an unknown file system')} ({work}): disk "
                     f"time is part of the figures")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores is not None and max(args.ranks) > cores:
        notes.append(f"up to {max(args.ranks)} ranks on {cores} usable cores: ranks wait for a "
                     f"core, which the figures include")
    for note in notes:
        _log(f"note: {note}")

    report: dict[str, Any] = {
        "benchmark": "scale",
        "machine": machine_info(work),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "dir": str(work), "notes": notes, "configs": []}
    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
    rss_per_rank: float | None = None
    started = time.monotonic()
    plans = [(replicas, ranks, control) for replicas in args.replicas for ranks in args.ranks
             for control in args.control]
    for replicas, ranks, control in plans:
        estimate = rss_per_rank if rss_per_rank is not None else RSS_GUESS_MIB
        warning = memory_warning(ranks, estimate, rss_per_rank is not None)
        if warning:
            _log(f"warning: {warning}")
        _log(f"ranks={ranks} replicas={replicas} control={control}: starting")
        try:
            config = run_config(args, ranks, replicas, work, args.keep_logs, control)
        except Exception as exc:  # the harness itself: record it, go on
            config = {"ranks": ranks, "replicas": replicas, "control": control,
                      "status": "failed",
                      "error": f"harness: {type(exc).__name__}: {exc}"}
        if warning:
            config.setdefault("warnings", []).append(warning)
        pss = config.get("memory", {}).get("pss_mib_max")
        if pss is not None:  # PSS: what N ranks add up to (shared pages counted once)
            rss_per_rank = max(rss_per_rank or 0.0, float(pss))
        report["configs"].append(config)
        agg = config.get("aggregates", {})
        _log(f"ranks={ranks} replicas={replicas} control={control}: {config['status']} in "
             f"{config.get('wall_s', 0.0):.1f} s; commit stage max "
             f"{_ms(agg.get('commit_stage_s', {}).get('max_over_ranks')).strip()} ms")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report["total_wall_s"] = time.monotonic() - started
        report["machine"]["loadavg_at_end"] = os.getloadavg()
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # after every config
    libraries = sorted({lib for c in report["configs"] for lib in c.get("library", [])})
    repo = HERE.parent
    foreign = [lib for lib in libraries if not Path(lib).resolve().is_relative_to(repo)]
    if foreign:  # machine.git_commit is the checkout's, not that of the library that ran
        note = (f"ckpt_pipeline imported from {', '.join(foreign)}, not from this checkout "
                f"({repo}): machine.git_commit does not describe it")
        report["notes"].append(note)
        _log(f"note: {note}")
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    _log(f"wrote {args.out} ({report['total_wall_s']:.0f} s)")
    print(table(report))
    return 0 if all(c["status"] in ("ok", "skipped") for c in report["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
