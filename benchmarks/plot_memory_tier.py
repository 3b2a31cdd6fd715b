"""Figure and table of a ``bench_memory_tier.py`` result (issue 24).

Prints a markdown table for ``docs/benchmarks.md`` (per end-of-loop sync mode and save interval:
x no checkpoint, blocking per save, first save, saves committed in memory and durable on disk,
write-throughs skipped; then the restore after SIGKILL) and, with ``--out``, draws the overhead
against the save interval, one line per variant and sync mode, ckpt_pipeline beside NVRx (needs
matplotlib, which is not a dependency of the library). Several JSONs (the parts of a split run)
are merged (later files win, except that a failed run never hides a result).

    python benchmarks/plot_memory_tier.py memory_tier.json --out fig.png
    python benchmarks/plot_memory_tier.py part1.json part2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

GB = 1e9
LABELS = {"none": "no checkpoint", "ckpt_pipeline": "ckpt_pipeline (disk)",
          "ckpt_pipeline_staged": "ckpt_pipeline (disk), device_staging=True",
          "ckpt_pipeline_memory": "memory tier (disk every 4th), fresh job",
          "ckpt_pipeline_memory_sized": "memory tier, buffers made at open (slot_bytes)",
          "ckpt_pipeline_memory_staged": "memory tier, made at open, device_staging=True",
          "ckpt_pipeline_memory_staged_fresh": "memory tier, fresh job, device_staging=True",
          "nvrx_local": "NVRx local checkpoints (async)"}
COLORS = {"none": "tab:gray", "ckpt_pipeline": "tab:olive", "ckpt_pipeline_staged": "tab:brown",
          "ckpt_pipeline_memory": "tab:green", "ckpt_pipeline_memory_sized": "tab:cyan",
          "ckpt_pipeline_memory_staged": "tab:red",
          "ckpt_pipeline_memory_staged_fresh": "tab:orange", "nvrx_local": "tab:blue"}
STYLES = {"device": "-", "stream": "--"}


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of several: results merged per (sync mode, interval, variant)."""
    out: dict[str, Any] = {"results": {}, "config": {}, "machine": {}, "state": {}}
    for report in reports:
        for mode, by_interval in report.get("results", {}).items():
            for interval, row in by_interval.items():
                merged = out["results"].setdefault(mode, {}).setdefault(interval, {})
                for name, r in row.items():  # a failed or skipped run never hides a result
                    if "error" not in r or "error" in merged.get(name, {"error": ""}):
                        merged[name] = r
        for key in ("config", "machine", "state"):
            out[key] = report.get(key) or out[key]
        if "restore_after_kill" in report:
            out["restore_after_kill"] = report["restore_after_kill"]
    return out


def _f(value: Any, fmt: str, scale: float | None = None) -> str:
    if value is None:
        return "-"
    return format(value if scale is None else value * scale, fmt)


def _n(value: Any) -> str:
    return "-" if value is None else str(value)


def markdown(report: dict[str, Any]) -> str:
    machine = report.get("machine", {})
    gpu = machine.get("gpu", {})
    cfg = report.get("config", {})
    state = report.get("state", {})
    lines = [
        f"State: {cfg.get('layers')} x `nn.Linear({cfg.get('hidden')}, {cfg.get('hidden')})`, "
        f"AdamW, {state.get('bytes', 0) / GB:.2f} GB. Steps per interval: "
        f"{cfg.get('steps_for')}. Machine: {gpu.get('name', 'CPU')}, torch "
        f"{machine.get('torch')}, filesystem {machine.get('filesystem', {}).get('type')}, "
        f"{machine.get('date_utc')}, commit `{machine.get('git_commit')}`"
        f"{' (dirty)' if machine.get('git_dirty') else ''}.",
        "",
        "| end sync | save every | variant | steps + saves, s | x no checkpoint "
        "| blocking per save, ms (median / max) | first save, s | saves | committed in memory "
        "| durable on disk | write-throughs skipped |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, by_interval in report.get("results", {}).items():
        for interval in sorted(by_interval, key=int):
            for name, r in by_interval[interval].items():
                label = f"**`{name}`**" if name.startswith("ckpt_pipeline") else f"`{name}`"
                if "error" in r:
                    lines.append(f"| {mode} | {interval} | {label} | {r['error']} "
                                 "| | | | | | | |")
                    continue
                blocking = (f"{_f(r.get('blocking_median_s'), '.1f', 1e3)} / "
                            f"{_f(r.get('blocking_max_s'), '.1f', 1e3)}"
                            if r.get("saves_attempted") else "-")
                lines.append(
                    f"| {mode} | {interval} | {label} | {_f(r.get('total_s'), '.2f')} "
                    f"| {_f(r.get('x_none'), '.3f')} | {blocking} "
                    f"| {_f(r.get('first_save_blocking_s'), '.2f')} "
                    f"| {_n(r.get('saves_attempted'))} | {_n(r.get('committed_memory'))} "
                    f"| {_n(r.get('durable_disk'))} | {_n(r.get('write_throughs_skipped'))} |")
    restore = report.get("restore_after_kill")
    if restore:
        memory, disk = restore.get("memory", {}), restore.get("disk", {})
        lines += [
            "",
            f"Restore after SIGKILL of a process that had committed step "
            f"{restore.get('child_step')} (a save every {restore.get('every')} steps, disk "
            f"every {restore.get('disk_every')}th):",
            "",
            "| restore from | step | open, s | restore_latest, s | open + restore, s |",
            "|---|---:|---:|---:|---:|",
        ]
        for label, r in (("memory (shm files of the killed process)", memory),
                         ("disk (shm directory moved away)", disk)):
            if r:
                lines.append(f"| {label} | {_n(r.get('step'))} | {_f(r.get('open_s'), '.3f')} "
                             f"| {_f(r.get('restore_s'), '.3f')} "
                             f"| {_f(r.get('open_and_restore_s'), '.3f')} |")
        lines.append(f"| memory / disk | | | {_f(restore.get('memory_over_disk'), '.3f')} "
                     f"| {_f(restore.get('memory_over_disk_with_open'), '.3f')} |")
        if "error" in restore:
            lines.append(f"\nThe restore failed: {restore['error'].strip().splitlines()[-1]}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6.4))
    drawn = 0
    top = 1.0
    for mode, by_interval in report.get("results", {}).items():
        names = [n for n in LABELS  # the variants of the sweep (an ad-hoc one: table only)
                 if n != "none" and any(n in row for row in by_interval.values())]
        for name in names:
            points = sorted((int(i), row[name]["x_none"]) for i, row in by_interval.items()
                            if row.get(name, {}).get("x_none") is not None)
            if not points:
                continue
            xs, ys = zip(*points)
            top = max(top, *ys)
            ax.plot(xs, ys, STYLES.get(mode, ":"), marker="o", color=COLORS.get(name, "black"),
                    label=f"{LABELS.get(name, name)}, end sync {mode}")
            drawn += 1
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    if top > 4:  # disk-bound saves at short intervals: several times slower
        from matplotlib.ticker import FormatStrFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    intervals = sorted({int(i) for by in report.get("results", {}).values() for i in by})
    ax.set_xticks(intervals)
    ax.set_xticklabels([str(i) for i in intervals])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    gpu = report.get("machine", {}).get("gpu", {}).get("name", "CPU")
    ax.set_xlabel("save interval, training steps")
    ax.set_ylabel("training time with checkpoints / without (same run)")
    ax.set_title(f"{report.get('state', {}).get('bytes', 0) / GB:.3g} GB state, {gpu}",
                 fontsize=10)
    if drawn:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("json", type=Path, nargs="+",
                        help="results of bench_memory_tier.py (the parts of a split run)")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG of the overhead against the save interval")
    args = parser.parse_args(argv)
    report = merge([json.loads(p.read_text()) for p in args.json])
    print(markdown(report))
    if args.out is None:
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: no chart written to {args.out} "
              "(pip install matplotlib)", file=sys.stderr)
        return 2
    plot(report, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
