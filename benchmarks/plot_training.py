"""Figures and tables of a ``bench_training.py`` result.

Prints markdown tables for ``docs/benchmarks.md`` (the variants, the floors, the targets) and,
with ``--out``, draws a bar chart of the training-time overhead of each variant (needs
matplotlib, which is not a dependency of the library).

    python benchmarks/plot_training.py benchmarks/results/training_gpu.json --out fig.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

GB = 1e9
OVERHEAD_TARGET = 1.02


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def variant_rows(report: dict[str, Any]) -> list[str]:
    """The keys of the variants in the order of the run, failed and skipped ones included."""
    order = [*report.get("config", {}).get("variant_list", []), "none_end"]
    seen = {**report.get("variants", {}), **report.get("errors", {}),
            **report.get("skipped", {})}
    keys = [k for k in order if k in seen]
    return keys + [k for k in report.get("variants", {}) if k not in keys]


def markdown(report: dict[str, Any]) -> str:
    cfg = report.get("config", {})
    machine = report.get("machine", {})
    gpu = machine.get("gpu", {})
    summary = report.get("summary", {})
    state = report.get("state", {})
    lines = [
        f"State: {cfg.get('layers')} x `nn.Linear({cfg.get('hidden')}, {cfg.get('hidden')})`, "
        f"AdamW (fused={cfg.get('fused')}), bf16 autocast {'on' if cfg.get('autocast') else 'off'}"
        f", batch {cfg.get('batch')}: {state.get('bytes', 0) / GB:.2f} GB in "
        f"{state.get('tensors')} tensors. {cfg.get('steps')} steps, a save every "
        f"{cfg.get('every')}. Machine: {gpu.get('name', 'CPU')} ({gpu.get('nvidia_smi', '')}), "
        f"{machine.get('cpu_count')} CPUs, torch {machine.get('torch')}, filesystem "
        f"{machine.get('filesystem', {}).get('type')}, {machine.get('date_utc')}, commit "
        f"`{machine.get('git_commit')}`{' (dirty)' if machine.get('git_dirty') else ''}.",
        "",
        "| variant | steps + saves, s | x no checkpoint | until last save durable, s "
        "| blocking per save, ms (median / max) | time to durable, s (median) | saves |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key in variant_rows(report):
        if key in report.get("errors", {}) and key not in report.get("variants", {}):
            lines.append(f"| `{key}` | failed (see `errors`) | | | | | |")
            continue
        if key in report.get("skipped", {}):
            lines.append(f"| `{key}` | skipped: {report['skipped'][key]} | | | | | |")
            continue
        s = summary.get(key, {})
        name = f"**`{key}`**" if key.startswith("ckpt_pipeline") else f"`{key}`"
        blocking = (f"{_f(s.get('blocking_median_ms'), '.1f')} / "
                    f"{_f(s.get('blocking_max_ms'), '.1f')}") if s.get("saves") else "-"
        lines.append(
            f"| {name} | {_f(s.get('total_s'), '.2f')} | {_f(s.get('overhead_ratio'), '.3f')} "
            f"| {_f(s.get('final_wait_s'), '.2f')} | {blocking} "
            f"| {_f(s.get('durable_median_s'), '.2f')} | {s.get('saves', '-')} |")
    floors = report.get("floors", {})
    if floors:
        lines += ["", "| floor (same run, same bytes) | best s | GB/s |", "|---|---:|---:|"]
        copy = floors.get("plain_copy")
        if copy:
            lines.append(f"| plain pinned device-to-host copy | {copy['best_s']:.4f} "
                         f"| {copy['gbps_best']:.1f} |")
        for key, w in floors.get("plain_write", {}).items():
            if key.startswith(("threads_", "direct_")):
                kind, n = key.split("_")
                how = f"{n} thread(s)" if kind == "threads" else f"O_DIRECT, {n} thread(s)"
                lines.append(f"| plain write + fsync, {how} "
                             f"| {w['best_s']:.3f} | {w['gbps_best']:.2f} |")
        read = floors.get("plain_read")
        if read:
            lines.append(f"| plain read ({read['threads']} threads, page cache dropped) + "
                         f"host-to-device | {read['best_s']:.3f} | {read['gbps_best']:.2f} |")
    targets = report.get("targets", {})
    if targets:
        lines += ["", "| target | value | limit | verdict |", "|---|---:|---:|---|"]
        for t in targets.values():
            verdict = {True: "PASS", False: "MISS", None: "n/a"}[t.get("pass")]
            lines.append(f"| {t['what']} | {_f(t.get('value'), '.3f')} | {t['op']} "
                         f"{t['limit']} | {verdict} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report.get("summary", {})
    keys = [k for k in variant_rows(report)
            if summary.get(k, {}).get("overhead_ratio") is not None]
    ratios = [summary[k]["overhead_ratio"] for k in keys]
    colors = ["tab:green" if k.startswith("ckpt_pipeline") else
              "tab:gray" if k.startswith("none") else "tab:blue" for k in keys]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(keys) + 1.8))
    bars = ax.barh(keys, ratios, color=colors)
    for bar, ratio in zip(bars, ratios):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {ratio:.3f}x",
                va="center", fontsize=9)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.axvline(OVERHEAD_TARGET, color="tab:red", linestyle="--",
               label=f"target {OVERHEAD_TARGET}x")
    ax.invert_yaxis()
    ax.set_xlim(0, max([*ratios, OVERHEAD_TARGET]) * 1.15)
    cfg = report.get("config", {})
    gpu = report.get("machine", {}).get("gpu", {}).get("name", "CPU")
    ax.set_xlabel("training time with checkpoints / without (same run)")
    ax.set_title(f"{report.get('state', {}).get('bytes', 0) / GB:.3g} GB state, a save every "
                 f"{cfg.get('every')} of {cfg.get('steps')} steps, {gpu}", fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="a result of bench_training.py")
    parser.add_argument("--out", type=Path, default=None, help="PNG bar chart of the overhead")
    args = parser.parse_args(argv)
    report = json.loads(args.json.read_text())
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
