"""What a ``bench_format_cpu.py`` result says: ratios and goals, tables, a figure.

``derive`` turns a case's samples into ratios, per-tensor costs, the cache check and the goals
(the benchmark calls it, and this script again, so that an older result gets today's goals).
Prints markdown tables for ``docs/benchmarks.md`` (size and save, restore cold and warm, the
count sweep per tensor, aliasing, the goals) and, with ``--out``, draws a figure of three
panels: (a) save and restore time per tensor against the tensor count, ckpt_pipeline against
torch.save/torch.load; (b) restore time over the plain read of the shard against the state
size, cold and warm; (c) shard size over the unique bytes of the state, per case. The figure
needs matplotlib, which is not a dependency of the library (``pip install matplotlib``).

    python benchmarks/plot_format.py benchmarks/results/format_cpu.json --out docs/format_cpu.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ("CACHES", "GOALS", "READ_METHODS", "derive", "markdown", "plot")

MiB = 1 << 20
READ_METHODS = ("plain_read_threads", "plain_read_fresh", "torch_load", "ckpt_restore")
CACHES = ("cold", "warm")
GOALS: dict[str, dict[str, Any]] = {
    "restore_cold_vs_fresh_read": {
        "ratio": "restore_cold_over_plain_read_fresh", "limit": 1.1,
        "what": "ckpt restore / plain threaded read of the shard into new memory, cold"},
    "restore_warm_vs_fresh_read": {
        "ratio": "restore_warm_over_plain_read_fresh", "limit": 1.1,
        "what": "ckpt restore / plain threaded read of the shard into new memory, warm"},
    "restore_cold_vs_read_floor": {
        "ratio": "restore_cold_over_plain_read", "limit": 1.1,
        "what": "ckpt restore / plain threaded read of the shard into touched memory, cold"},
    "restore_warm_vs_read_floor": {
        "ratio": "restore_warm_over_plain_read", "limit": 1.1,
        "what": "ckpt restore / plain threaded read of the shard into touched memory, warm"},
    "restore_cold_vs_torch_load": {
        "ratio": "restore_cold_over_torch_load", "limit": 1.0,
        "what": "ckpt restore / torch.load, cold"},
    "restore_warm_vs_torch_load": {
        "ratio": "restore_warm_over_torch_load", "limit": 1.0,
        "what": "ckpt restore / torch.load, warm"},
    "restore_cold_vs_torch_load_copy": {
        "ratio": "restore_cold_over_torch_load_copy", "limit": 1.0,
        "what": "ckpt restore / (torch.load + copy into the live state), cold"},
    "restore_warm_vs_torch_load_copy": {
        "ratio": "restore_warm_over_torch_load_copy", "limit": 1.0,
        "what": "ckpt restore / (torch.load + copy into the live state), warm"},
    "shard_vs_unique": {
        "ratio": "shard_less_header_over_unique", "limit": 1.05,
        "what": "(shard - header) / unique bytes of the state"},
}
"""What ``bench_format_cpu.py`` aims for; a ratio at or under its limit passes."""


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _x(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _med(case: dict[str, Any], name: str) -> float | None:
    result = case.get("results", {}).get(name)
    return None if result is None else float(result["median_s"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def derive(record: dict[str, Any]) -> None:
    """Ratios, per-tensor costs, the cache check and the goals of one measured case."""
    results = record.get("results", {})
    floor = _med(record, "plain_write_fsync")
    for name, result in results.items():
        if name.startswith(("ckpt_save", "torch_save", "plain_write")):
            result["ratio_to_plain_write"] = _ratio(result["median_s"], floor)
    med = {name: _med(record, name) for name in results}
    sizes = record.get("sizes", {})
    unique, shard = sizes.get("unique_bytes"), sizes.get("shard_bytes")
    header = sizes.get("header_bytes")
    ratios: dict[str, float | None] = {
        "shard_over_unique": _ratio(shard, unique),
        "shard_less_header_over_unique": _ratio(shard - header, unique)
        if shard is not None and header is not None else None,
        "torch_file_over_unique": _ratio(sizes.get("torch_file_bytes"), unique),
        "commit_over_plain_write": _ratio(med.get("ckpt_save_commit"), floor),
        "commit_over_direct_write": _ratio(med.get("ckpt_save_commit"),
                                           med.get("direct_write_threads")),
        "torch_save_over_direct_write": _ratio(med.get("torch_save"),
                                               med.get("direct_write_threads")),
        "torch_save_over_plain_write": _ratio(med.get("torch_save"), floor),
    }
    for cache in CACHES:
        restore = med.get(f"ckpt_restore_{cache}")
        ratios[f"restore_{cache}_over_plain_read"] = _ratio(
            restore, med.get(f"plain_read_threads_{cache}"))
        ratios[f"restore_{cache}_over_plain_read_fresh"] = _ratio(
            restore, med.get(f"plain_read_fresh_{cache}"))
        ratios[f"restore_{cache}_over_torch_load"] = _ratio(restore, med.get(f"torch_load_{cache}"))
        ratios[f"restore_{cache}_over_torch_load_copy"] = _ratio(
            restore, med.get(f"torch_load_copy_{cache}"))
    record["ratios"] = ratios
    n = record.get("state", {}).get("tensors") or 0
    per_tensor: dict[str, float | None] = {
        "header_bytes": header / n if n and header is not None else None,
        "shard_bytes": shard / n if n and shard is not None else None,
    }
    for name in ("ckpt_save_commit", "ckpt_save_blocking", "ckpt_restore_cold",
                 "ckpt_restore_warm", "torch_save", "torch_load_cold", "torch_load_warm",
                 "torch_load_copy_cold", "torch_load_copy_warm"):
        value = med.get(name)
        per_tensor[f"{name}_us"] = value / n * 1e6 if n and value is not None else None
    record["per_tensor"] = per_tensor
    resident = record.get("resident_before", {})
    record["cache_check"] = {
        method: {
            "cold_over_warm": _ratio(med.get(f"{method}_cold"), med.get(f"{method}_warm")),
            "cold_resident_max": max((f for f in resident.get(f"{method}_cold", [])
                                      if f is not None), default=None),
            "warm_resident_min": min((f for f in resident.get(f"{method}_warm", [])
                                      if f is not None), default=None),
        }
        for method in READ_METHODS
    }
    goals = {}
    for key, goal in GOALS.items():
        value = ratios.get(goal["ratio"])
        goals[key] = {"value": value, "limit": goal["limit"],
                      "pass": None if value is None else value <= goal["limit"]}
    record["goals"] = goals


# --- tables ----------------------------------------------------------------------------------


def _measured(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, c) for name, c in report.get("cases", {}).items() if "results" in c]


def _table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    return ["| " + " | ".join(header) + " |",
            "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def _intro(report: dict[str, Any]) -> str:
    machine = report.get("machine", {})
    cfg = report.get("config", {})
    fs = machine.get("filesystem", {})
    lib = report.get("library", {})
    return (f"{machine.get('cpu_model', '?')}, {machine.get('cpu_count')} CPUs, "
            f"{machine.get('mem_total_gb')} GB, {fs.get('type', '?')} at "
            f"{fs.get('mount_point', '?')}; torch {machine.get('torch')}, ckpt_pipeline "
            f"format {lib.get('format_version', '?')}, commit `{machine.get('git_commit')}`"
            f"{' (dirty)' if machine.get('git_dirty') else ''}, {machine.get('date_utc')}. "
            f"Median of {cfg.get('repeats')} round(s) (cases marked * ran one); cold = page cache "
            f"dropped (fadvise DONTNEED), warm = file just read. "
            f"{'Incomplete run. ' if not report.get('complete') else ''}"
            f"{_f(report.get('wall_seconds'), '.0f')} s in all.")


def _name(name: str, case: dict[str, Any]) -> str:
    return f"`{name}`" + ("*" if case.get("repeats_capped_from") else "")


def save_table(report: dict[str, Any]) -> list[str]:
    rows = []
    for name, c in _measured(report):
        state, sizes, ratios = c.get("state", {}), c.get("sizes", {}), c.get("ratios", {})
        first = c.get("first_save") or {}
        rows.append([
            _name(name, c), str(state.get("tensors")),
            _f(state.get("unique_bytes", 0) / MiB, ".3g"),
            _x(ratios.get("shard_over_unique")),
            _f(None if sizes.get("header_bytes") is None else sizes["header_bytes"] / 1024,
               ".1f"),
            _x(ratios.get("torch_file_over_unique")),
            _f(_med(c, "ckpt_save_blocking"), ".3f"),
            _f(_med(c, "ckpt_save_commit"), ".3f"),
            _x(ratios.get("commit_over_direct_write")),
            _f(first.get("durable_s"), ".3f"),
            _f(_med(c, "torch_save"), ".3f"),
            _x(ratios.get("torch_save_over_direct_write")),
            _f(_med(c, "direct_write_threads"), ".3f"),
            _f(_med(c, "plain_write_fsync"), ".3f"),
        ])
    return _table(["case", "tensors", "unique MiB", "shard / unique", "header KiB",
                   "torch file / unique", "save blocking s", "save to commit s",
                   "x O_DIRECT write", "first save s", "torch.save s", "x O_DIRECT write",
                   "O_DIRECT write s", "buffered write s"], rows, "lrrrrrrrrrrrrr")


def restore_table(report: dict[str, Any]) -> list[str]:
    rows = []
    for name, c in _measured(report):
        ratios = c.get("ratios", {})
        for cache in ("cold", "warm"):
            rows.append([
                _name(name, c), cache, _f(_med(c, f"ckpt_restore_{cache}"), ".3f"),
                _x(ratios.get(f"restore_{cache}_over_plain_read_fresh")),
                _x(ratios.get(f"restore_{cache}_over_plain_read")),
                _x(ratios.get(f"restore_{cache}_over_torch_load")),
                _x(ratios.get(f"restore_{cache}_over_torch_load_copy")),
                _f(_med(c, f"plain_read_fresh_{cache}"), ".3f"),
                _f(_med(c, f"plain_read_threads_{cache}"), ".3f"),
                _f(_med(c, f"torch_load_{cache}"), ".3f"),
                _f(_med(c, f"torch_load_copy_{cache}"), ".3f"),
            ])
    return _table(["case", "cache", "ckpt restore s", "x read, new memory",
                   "x read, touched memory", "x torch.load", "x torch.load + copy",
                   "read, new memory s", "read, touched memory s", "torch.load s",
                   "torch.load + copy s"], rows, "llrrrrrrrrr")


def count_table(report: dict[str, Any]) -> list[str]:
    rows = []
    for name, c in _measured(report):
        if c.get("kind") != "count":
            continue
        p = c.get("per_tensor", {})
        rows.append([
            _name(name, c), _f(p.get("header_bytes"), ".1f"), _f(p.get("shard_bytes"), ".0f"),
            _f(p.get("ckpt_save_blocking_us"), ".2f"), _f(p.get("ckpt_save_commit_us"), ".2f"),
            _f(p.get("ckpt_restore_cold_us"), ".2f"), _f(p.get("ckpt_restore_warm_us"), ".2f"),
            _f(p.get("torch_save_us"), ".2f"), _f(p.get("torch_load_copy_cold_us"), ".2f"),
            _f(p.get("torch_load_copy_warm_us"), ".2f"),
        ])
    if not rows:
        return []
    return _table(["case", "header B/tensor", "shard B/tensor", "save blocking µs/tensor",
                   "save to commit µs/tensor", "restore cold µs/tensor",
                   "restore warm µs/tensor", "torch.save µs/tensor",
                   "torch.load + copy cold µs/tensor", "torch.load + copy warm µs/tensor"],
                  rows, "lrrrrrrrrr")


def alias_table(report: dict[str, Any]) -> list[str]:
    rows = []
    for name, c in _measured(report):
        alias = c.get("alias")
        if not alias:
            continue
        first, second, _ = alias["pair"]
        for loader in ("ckpt_restore", "torch_load"):
            a = alias.get(loader)
            if a is None:
                rows.append([_name(name, c), f"`{first}`, `{second}`", loader, "failed", "", ""])
                continue
            rows.append([_name(name, c), f"`{first}`, `{second}`", loader,
                         str(a["storage_shared"]), str(a["aliased"]),
                         f"{a['first_storage_bytes']} ({a['first_bytes']})"])
    if not rows:
        return []
    return _table(["case", "tensors", "loaded by", "same storage", "aliased (a write shows)",
                   "first tensor's storage bytes (its own)"], rows, "llllll")


def goals_table(report: dict[str, Any]) -> list[str]:
    rows = []
    for key, goal in GOALS.items():
        verdicts: dict[Any, list[str]] = {True: [], False: [], None: []}
        worst: tuple[float, str] | None = None
        for name, c in _measured(report):
            g = c.get("goals", {}).get(key, {})
            verdicts[g.get("pass")].append(name)
            if g.get("value") is not None and (worst is None or g["value"] > worst[0]):
                worst = (g["value"], name)
        rows.append([goal["what"], f"<= {goal['limit']}", str(len(verdicts[True])),
                     ", ".join(f"`{n}`" for n in verdicts[False]) or "none",
                     "-" if worst is None else f"{worst[0]:.2f}x (`{worst[1]}`)"])
    return _table(["goal", "limit", "cases passing", "cases missing", "worst"], rows, "lrrll")


def short_table(report: dict[str, Any]) -> list[str]:
    def timed(name: str, *ratios: str) -> str:
        said = " / ".join(_x(r.get(ratio)) for ratio in ratios)
        return f"{_f(_med(c, name), '.3f')} ({said})"

    rows = []
    for name, c in _measured(report):
        r, p = c.get("ratios", {}), c.get("per_tensor", {})
        rows.append([
            _name(name, c), str(c.get("state", {}).get("tensors")),
            _f(c.get("state", {}).get("unique_bytes", 0) / MiB, ".3g"),
            _x(r.get("shard_over_unique")),
            timed("ckpt_save_commit", "commit_over_direct_write"),
            _f(_med(c, "ckpt_save_blocking"), ".3f"),
            timed("ckpt_restore_cold", "restore_cold_over_plain_read_fresh",
                  "restore_cold_over_torch_load_copy"),
            timed("ckpt_restore_warm", "restore_warm_over_plain_read_fresh",
                  "restore_warm_over_torch_load_copy"),
            f"{_f(p.get('ckpt_save_commit_us'), '.1f')} / "
            f"{_f(p.get('ckpt_restore_warm_us'), '.1f')}",
        ])
    return _table(["case", "tensors", "unique MiB", "shard / unique",
                   "save to commit s (x O_DIRECT write)", "save blocking s",
                   "restore cold s (x read into new memory / x torch.load+copy)",
                   "restore warm s (x read into new memory / x torch.load+copy)",
                   "µs/tensor save / restore warm"], rows, "lrrrrrrrr")


def markdown(report: dict[str, Any], *, short: bool = False) -> str:
    """The tables; ``short``: one table and the notable lines (what the benchmark prints)."""
    lines = [_intro(report), ""]
    if short:
        lines += short_table(report)
    else:
        for table in (save_table, restore_table, count_table, alias_table, goals_table):
            part = table(report)
            if part:
                lines += [*part, ""]
    for name, c in report.get("cases", {}).items():
        alias = c.get("alias", {})
        if short and alias:
            said = "; ".join(f"{loader}: aliased {alias[loader]['aliased']} (same storage "
                             f"{alias[loader]['storage_shared']})"
                             for loader in ("ckpt_restore", "torch_load") if loader in alias)
            lines.append(f"`{name}` restored into empty containers: {said}")
        if c.get("skipped"):
            lines.append(f"`{name}` skipped: {c['skipped']}")
        for what in c.get("errors", {}):
            lines.append(f"`{name}`: {what} failed (see `errors` in the JSON)")
        check = c.get("cache_check", {})
        for method, v in check.items():
            held = v.get("cold_resident_max")
            if held is not None and held > 0.05:
                lines.append(f"`{name}`: {method} cold still had {held:.0%} of its file in the "
                             "page cache")
        for what, ok in c.get("restore_check", {}).items():
            if not ok:
                lines.append(f"`{name}`: {what} restored different values")
    if report.get("library", {}).get("import_error"):
        lines.append("ckpt_pipeline did not import: its methods are missing")
    return "\n".join(lines).rstrip()


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _measured(report)
    fig, (ax_a, ax_b, ax_c) = plt.subplots(1, 3, figsize=(17, 5.2))
    counts = sorted(((c["state"]["tensors"], c) for _, c in cases if c.get("kind") == "count"),
                    key=lambda item: item[0])
    series = (("ckpt_save_commit_us", "ckpt save (to commit)", "tab:green", "-"),
              ("ckpt_restore_warm_us", "ckpt restore, warm", "tab:green", "--"),
              ("ckpt_restore_cold_us", "ckpt restore, cold", "tab:green", ":"),
              ("torch_save_us", "torch.save", "tab:blue", "-"),
              ("torch_load_copy_warm_us", "torch.load + copy, warm", "tab:blue", "--"),
              ("torch_load_copy_cold_us", "torch.load + copy, cold", "tab:blue", ":"))
    for key, label, color, style in series:
        points = [(n, c["per_tensor"][key]) for n, c in counts
                  if c.get("per_tensor", {}).get(key) is not None]
        if points:
            ax_a.plot(*zip(*points), style, color=color, marker="o", label=label)
    ax_a.set(xscale="log", yscale="log", xlabel="tensors of 16 float32 in the state",
             ylabel="µs per tensor (median)", title="(a) per-tensor cost against tensor count")
    ax_a.legend(fontsize=8)
    sized = sorted(((c["state"]["unique_bytes"], c) for _, c in cases
                    if c.get("kind") in ("size", "one_tensor")), key=lambda item: item[0])
    for method, label, color in (("ckpt_restore", "ckpt restore", "tab:green"),
                                 ("torch_load", "torch.load", "tab:blue"),
                                 ("torch_load_copy", "torch.load + copy", "tab:cyan")):
        for cache, style in (("cold", "-"), ("warm", "--")):
            points = []
            for nbytes, c in sized:
                value, floor = _med(c, f"{method}_{cache}"), _med(c, f"plain_read_fresh_{cache}")
                if value is not None and floor:
                    points.append((nbytes / MiB, value / floor))
            if points:
                ax_b.plot(*zip(*points), style, color=color, marker="o", label=f"{label}, {cache}")
    ax_b.axhline(1.0, color="black", linewidth=0.8)
    ax_b.axhline(GOALS["restore_cold_vs_fresh_read"]["limit"], color="tab:red", linestyle="--",
                 linewidth=0.8, label="goal for ckpt restore")
    ax_b.set(xscale="log", yscale="log", xlabel="state size, MiB (unique bytes)",
             ylabel="time / plain threaded read of the shard into new memory",
             title="(b) restore against the read floor")
    ax_b.legend(fontsize=8)
    sized_cases = [(name, c["ratios"]) for name, c in cases
                   if c.get("ratios", {}).get("shard_over_unique")]
    names = [name for name, _ in sized_cases]
    shard = [r["shard_over_unique"] for _, r in sized_cases]
    torch_file = [r.get("torch_file_over_unique") or 0 for _, r in sized_cases]
    rows = range(len(names))
    ax_c.barh([r - 0.2 for r in rows], shard, height=0.4, color="tab:green", label="ckpt shard")
    ax_c.barh([r + 0.2 for r in rows], torch_file, height=0.4, color="tab:blue",
              label="torch.save file")
    ax_c.set_yticks(list(rows), names, fontsize=8)
    ax_c.invert_yaxis()
    ax_c.axvline(1.0, color="black", linewidth=0.8)
    ax_c.axvline(GOALS["shard_vs_unique"]["limit"], color="tab:red", linestyle="--",
                 linewidth=0.8, label="goal (plus header)")
    ax_c.set(xscale="log", xlabel="file size / unique bytes of the state",
             title="(c) size on disk")
    ax_c.legend(fontsize=8)
    machine = report.get("machine", {})
    fig.suptitle(f"On-disk format on a CPU: {machine.get('cpu_count')} CPUs, "
                 f"{machine.get('filesystem', {}).get('type', '?')}, ckpt_pipeline format "
                 f"{report.get('library', {}).get('format_version', '?')}, commit "
                 f"{machine.get('git_commit')}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="a result of bench_format_cpu.py")
    parser.add_argument("--out", type=Path, default=None, help="PNG figure (needs matplotlib)")
    parser.add_argument("--short", action="store_true",
                        help="only the one table that the benchmark prints")
    args = parser.parse_args(argv)
    report = json.loads(args.json.read_text())
    for case in report.get("cases", {}).values():
        if "results" in case:
            derive(case)
    print(markdown(report, short=args.short))
    if args.out is None:
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: no figure written to {args.out} "
              "(pip install matplotlib)", file=sys.stderr)
        return 2
    plot(report, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
