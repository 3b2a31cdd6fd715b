"""The report of ``bench_training.py``: the summary per variant, the targets, the table."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ("TARGETS", "evaluate_targets", "format_table", "summarize")

GB = 1e9

TARGETS = {
    "overhead": ("training time ckpt_pipeline / none", "<=", 1.02),
    "blocking": ("blocking per save, median ms (save + wait_snapshot)", "<=", 10.0),
    "snapshot": ("snapshot speed / plain pinned copy speed", ">=", 0.90),
    "durable": ("time to durable, median / best plain write+fsync (O_DIRECT included)", "<=",
                1.20),
    "restore": ("restore / best plain read + H2D", "<=", 1.25),
    "memory": ("pinned pool flat across saves; VmRSS growth, MB", "<=", None),
}


# --- summary and targets ----------------------------------------------------------------------


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    variants = report["variants"]
    none_runs = [v["total_s"] for k, v in variants.items() if k.startswith("none")]
    none_stream = [v["total_stream_s"] for k, v in variants.items() if k.startswith("none")]
    base = min(none_runs) if none_runs else None
    base_stream = min(none_stream) if none_stream else None
    summary: dict[str, Any] = {"none_baseline_s": base, "none_runs_s": none_runs,
                               "none_baseline_stream_s": base_stream}
    for key, v in variants.items():
        saves = v.get("saves", [])
        blocking = [s["blocking_s"] for s in saves if s.get("blocking_s") is not None]
        durable = [s["durable_s"] for s in saves if s.get("durable_s") is not None]
        ends = v.get("step_end_s", [])
        steps_s = [b - a for a, b in zip([0.0, *ends[:-1]], ends)]
        total_final = v["total_s"] + v.get("final_wait_s", 0.0)
        summary[key] = {
            "total_s": v["total_s"],
            "final_wait_s": v.get("final_wait_s"),
            "total_with_final_wait_s": total_final,
            "overhead_ratio": v["total_s"] / base if base else None,
            "overhead_ratio_with_final_wait": total_final / base if base else None,
            "overhead_ratio_stream": v["total_stream_s"] / base_stream if base_stream else None,
            "saves": len(saves),
            "blocking_median_ms": _med(blocking) * 1e3 if blocking else None,
            "blocking_max_ms": max(blocking) * 1e3 if blocking else None,
            "blocking_total_s": sum(blocking),
            "durable_median_s": _med(durable),
            "durable_max_s": max(durable) if durable else None,
            "step_median_ms": _med(steps_s) * 1e3 if steps_s else None,
            "save_errors": [s["error"] for s in saves if s.get("error")],
        }
    return summary


def _verdict(key: str, value: float | None, detail: str,
             limit: float | None = None) -> dict[str, Any]:
    what, op, default = TARGETS[key]
    limit = default if limit is None else limit
    ok = None if value is None else (value <= limit if op == "<=" else value >= limit)
    return {"what": what, "value": value, "op": op, "limit": limit, "pass": ok,
            "detail": detail}


def evaluate_targets(report: dict[str, Any], key: str = "ckpt_pipeline") -> dict[str, Any]:
    """The verdicts of the issue's targets for one ckpt_pipeline variant of the run."""
    s = report["summary"].get(key, {})
    v = report["variants"].get(key, {})
    floors = report["floors"]
    out: dict[str, Any] = {}
    out["overhead"] = _verdict("overhead", s.get("overhead_ratio"),
                               f"{s.get('total_s')} s over none {report['summary'].get('none_baseline_s')} s")
    out["blocking"] = _verdict("blocking", s.get("blocking_median_ms"),
                               f"max {s.get('blocking_max_ms')} ms over {s.get('saves')} saves "
                               "(the untimed first save excluded)")
    copy = floors.get("plain_copy", {})
    iso_save = v.get("isolated_save", {})
    iso = iso_save.get("stages", {})
    snap = iso.get("snapshot_s")
    snap_bytes = iso.get("bytes")
    wall = iso_save.get("blocking_s")
    loop_snaps = [x.get("stages", {}).get("snapshot_s") for x in v.get("saves", [])]
    loop_snaps = [x for x in loop_snaps if x is not None]
    value = None
    on_gpu = str(report.get("config", {}).get("device", "")).startswith("cuda")
    if on_gpu and snap and snap_bytes and copy.get("best_s"):  # CPU tensors copy in save()
        value = (snap_bytes / snap) / (copy["bytes"] / copy["best_s"])
    wall_ratio = None
    if on_gpu and wall and snap_bytes and copy.get("best_s"):
        wall_ratio = (snap_bytes / wall) / (copy["bytes"] / copy["best_s"])
    out["snapshot"] = _verdict(
        "snapshot", value,
        f"isolated save, SnapshotTaken {snap} s for {snap_bytes} B; plain copy best "
        f"{copy.get('best_s')} s for {copy.get('bytes')} B. From save() to copies done "
        f"(wait_snapshot(block_cpu=True)) {wall} s: ratio {wall_ratio}. In-loop "
        f"SnapshotTaken median {_med(loop_snaps)} s (includes the queued training step)")
    out["snapshot"]["ratio_from_save_call"] = wall_ratio
    write_best = floors.get("plain_write", {}).get("best_s")
    durable = s.get("durable_median_s")
    buffered = floors.get("plain_write", {}).get("best_buffered_s")
    iso_durable = v.get("isolated_save", {}).get("durable_s")
    out["durable"] = _verdict("durable", durable / write_best if durable and write_best else None,
                              f"median {durable} s in the loop; best plain write {write_best} s "
                              f"(best buffered {buffered} s); isolated save {iso_durable} s")
    out["durable"]["ratio_to_buffered"] = durable / buffered if durable and buffered else None
    out["durable"]["isolated_ratio"] = (iso_durable / write_best
                                        if iso_durable and write_best else None)
    check = v.get("restore_check", {})
    read_best = floors.get("plain_read", {}).get("best_s")
    restore = check.get("restore_s")
    verdict = _verdict("restore", restore / read_best if restore and read_best else None,
                       f"restore {restore} s (ok={check.get('ok')}); best plain read + H2D "
                       f"{read_best} s")
    if check and not check.get("ok"):
        verdict["pass"] = False
        verdict["detail"] += "; the restored state did not match or could not train"
    out["restore"] = verdict
    first = v.get("memory_after_first_save", {})
    ends = [v.get("memory_after_timed_saves", {}), v.get("memory_at_end", {})]
    pools = [first.get("host_memory_bytes")] + [e.get("host_memory_bytes") for e in ends]
    rss0 = first.get("rss", {}).get("VmRSS")
    rss1 = ends[-1].get("rss", {}).get("VmRSS")
    state_bytes = report.get("state", {}).get("bytes")
    value = None
    flat = None
    # VmRSS may move a little for reasons of its own: allow 5% of the state, at least 64 MB.
    limit = max(64.0, 0.05 * (state_bytes or 0) / 1e6)
    if None not in pools and rss0 is not None and rss1 is not None:
        value = (rss1 - rss0) / 1e6
        flat = len(set(pools)) == 1
    verdict = _verdict("memory", value,
                       f"pool bytes after first save, after timed saves, at end: {pools}; "
                       f"VmRSS {rss0} -> {rss1} B (after the first save -> at the end); "
                       f"limit max(64 MB, 5% of the state)", limit=limit)
    if flat is False:
        verdict["pass"] = False
        verdict["detail"] += "; the pool changed size"
    out["memory"] = verdict
    return out


# --- output -----------------------------------------------------------------------------------


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(report: dict[str, Any]) -> str:
    cfg = report["config"]
    summary = report["summary"]
    gpu = report["machine"].get("gpu", {}).get("name") or "CPU"
    lines = [
        f"{cfg['layers']} x Linear({cfg['hidden']}, {cfg['hidden']}), batch {cfg['batch']}, "
        f"autocast bf16 {'on' if cfg['autocast'] else 'off'}, AdamW fused={cfg['fused']}, "
        f"on {gpu}; state {report.get('state', {}).get('bytes', 0) / GB:.2f} GB; "
        f"{cfg['steps']} steps, a save every {cfg['every']}",
    ]
    rows = [("variant", "loop s", "x none", "final wait s", "blocking ms med/max",
             "durable s med", "saves")]
    order = [*cfg.get("variant_list", []), "none_end"]
    keys = [k for k in order if k in report["variants"] or k in report["errors"]
            or k in report["skipped"]]
    keys += [k for k in report["variants"] if k not in keys]
    for key in keys:
        if key in report["errors"] and key not in report["variants"]:
            rows.append((key, "ERROR", "", "", "", "", ""))
            continue
        if key in report["skipped"]:
            rows.append((key, "skipped", "", "", "", "", ""))
            continue
        s = summary.get(key, {})
        rows.append((
            key,
            _f(s.get("total_s"), ".3f"),
            _f(s.get("overhead_ratio"), ".3f"),
            _f(s.get("final_wait_s"), ".3f"),
            f"{_f(s.get('blocking_median_ms'), '.1f')} / {_f(s.get('blocking_max_ms'), '.1f')}"
            if s.get("saves") else "-",
            _f(s.get("durable_median_s"), ".3f"),
            str(s.get("saves", "-")),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    table.insert(1, "  ".join("-" * w for w in widths))
    lines += table
    floors = report["floors"]
    if "plain_copy" in floors:
        c = floors["plain_copy"]
        lines.append(f"floors: plain copy {c['best_s']:.4f} s ({c['gbps_best']:.1f} GB/s)")
    if "plain_write" in floors:
        w = floors["plain_write"]
        lines.append("        write+fsync " + ", ".join(
            f"{_write_label(k)} {v['best_s']:.3f} s ({v['gbps_best']:.2f} GB/s)"
            for k, v in w.items() if k.startswith(("threads_", "direct_"))) + " (best)")
    if "plain_read" in floors:
        r = floors["plain_read"]
        lines.append(f"        read+H2D {r['best_s']:.3f} s ({r['gbps_best']:.2f} GB/s, "
                     f"{r['threads']} threads, page cache dropped)")
    v = report["variants"].get("ckpt_pipeline", {})
    if v:
        first = v.get("first_save", {})
        iso = v.get("isolated_save", {})
        check = v.get("restore_check", {})
        lines.append(
            f"ckpt_pipeline: first save {_f(first.get('blocking_s'), '.3f')} s blocking, "
            f"{_f(first.get('durable_s'), '.3f')} s to durable (excluded); snapshot with the "
            f"GPU idle {_f(iso.get('stages', {}).get('snapshot_s'), '.4f')} s; restore "
            f"{_f(check.get('restore_s'), '.3f')} s (ok={check.get('ok')})")
    lines.append("targets (ckpt_pipeline, default configuration):")
    for t in report.get("targets", {}).values():
        mark = {True: "PASS", False: "MISS", None: "n/a "}[t["pass"]]
        lines.append(f"  {mark}  {t['what']}: {_f(t['value'], '.3f')} {t['op']} {t['limit']}")
    for key, targets in report.get("targets_by_variant", {}).items():
        if key == "ckpt_pipeline":
            continue
        marks = ", ".join(
            f"{name} {_f(t['value'], '.3f')} "
            f"{ {True: 'PASS', False: 'MISS', None: 'n/a'}[t['pass']] }"
            for name, t in targets.items())
        lines.append(f"  {key}: {marks}")
    for key, text in report["errors"].items():
        last = [line for line in str(text).strip().splitlines() if line.strip()][-1:]
        lines.append(f"ERROR in {key}: {last[0].strip()[:300] if last else '?'} "
                     "(traceback under 'errors' in the JSON)")
    return "\n".join(lines)


def _write_label(key: str) -> str:
    """'threads_8' -> '8 thread(s)', 'direct_8' -> 'O_DIRECT 8 thread(s)'."""
    kind, n = key.split("_")
    return f"{n} thread(s)" if kind == "threads" else f"O_DIRECT {n} thread(s)"
