"""``ckpt-pipeline ls URL`` and ``verify URL``: the persistent tier.

``ls`` lists the step prefixes under the URL, complete (a commit object) or not, with what
the commit object records. ``verify`` downloads each rank's files of the selected complete
steps into a temporary directory, checking every part against the commit object, and then
checks them as ``verify`` checks a local root (every byte against the shard's checksums, the
state tree and the TrainState). Nothing under the URL is created, changed or removed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from .._format.filesets import FileSet
from .._format.names import parse_step_dir, step_dir_name
from .._format.scan import scan_files
from .._tiers.persistent.layout import STEP_COMMIT, StepRecord
from .._tiers.persistent.promote import download_rank, read_step_record
from .._tiers.persistent.remote import Remote
from .._tiers.persistent.urls import open_remote
from ..errors import CheckpointError
from ..storage import LocalStorage
from ._output import human_bytes, print_json
from ._status import EXIT_FAILED, EXIT_OK, UsageError
from ._verify import verify_step

__all__ = ("cmd_ls_remote", "cmd_verify_remote", "parse_options")


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """``--option KEY=VALUE`` pairs: the store's settings (``endpoint=...`` for S3); a dotted
    key sets an entry of a nested group (``client_options.timeout=60s``)."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--option {pair!r} is not KEY=VALUE")
        group, dot, name = key.partition(".")
        if key in _GROUPS:
            raise UsageError(f"--option {key}= sets a group of settings: give each one as "
                             f"--option {key}.NAME=VALUE (for example {key}.timeout=60s)")
        if not dot:
            if isinstance(out.get(key), dict):
                raise UsageError(f"--option {key}= given both as a group and as one value")
            out[key] = value
            continue
        if not group or not name or "." in name:
            raise UsageError(f"--option {pair!r}: give GROUP.NAME=VALUE, one level deep")
        nested = out.setdefault(group, {})
        if not isinstance(nested, dict):
            raise UsageError(f"--option {group}= given both as one value and as a group")
        nested[name] = value
    return out


_GROUPS = ("client_options",)
"""The settings that are groups of their own (obstore's S3 ``client_options``)."""


def _open(url: str, args: argparse.Namespace) -> Remote:
    return open_remote(url, options=parse_options(args.option), retries=2)


def _steps(remote: Remote) -> list[tuple[int, dict[str, int]]]:
    out = []
    for name in remote.list_steps():
        step = parse_step_dir(name)
        if step is not None:
            out.append((step, remote.list_dir(name)))
    return sorted(out, reverse=True)


def cmd_ls_remote(url: str, args: argparse.Namespace) -> int:
    remote = _open(url, args)
    try:
        rows: list[dict[str, Any]] = []
        for step, objects in _steps(remote):
            record: StepRecord | None = None
            reason = None
            if STEP_COMMIT in objects:
                try:
                    record = read_step_record(remote, step)
                except CheckpointError as exc:
                    reason = exc.message
            else:
                reason = "no commit object (an unfinished promotion)"
            rows.append({
                "step": step,
                "complete": record is not None,
                "world_size": None if record is None else record.world_size,
                "save_id": None if record is None else record.save_id,
                "bytes": sum(objects.values()),
                "objects": len(objects),
                "created_unix": None if record is None else record.created_unix,
                "reason": reason,
            })
    finally:
        remote.close()
    if args.json:
        print_json({"url": remote.url, "steps": rows})
        return EXIT_OK
    if not rows:
        print(f"no steps under {remote.url}")
        return EXIT_OK
    width = max(len("STEP"), *(len(str(r["step"])) for r in rows))
    columns = f"{{:>{width}}}  {{:<10}}  {{:>5}}  {{:>10}}  {{:<26}}  {{}}"
    print(columns.format("STEP", "STATE", "RANKS", "SIZE", "SAVE ID", "REASON").rstrip())
    for r in rows:
        print(columns.format(r["step"], "complete" if r["complete"] else "incomplete",
                             r["world_size"] or "-", human_bytes(r["bytes"]),
                             r["save_id"] or "-", r["reason"] or "").rstrip())
    return EXIT_OK


def _select(remote: Remote, step: int | None, every: bool) -> list[int]:
    steps = _steps(remote)
    complete = [s for s, objects in steps if STEP_COMMIT in objects]
    if step is not None:
        if step not in {s for s, _ in steps}:
            raise UsageError(f"step {step} not found under {remote.url}")
        return [step]
    if not steps:
        raise UsageError(f"no steps under {remote.url}")
    if every:
        return [s for s, _ in steps]
    if not complete:
        raise UsageError(f"no complete step under {remote.url} (no commit object)")
    return complete[:1]


def cmd_verify_remote(url: str, args: argparse.Namespace) -> int:
    """Download and verify the steps selected (every rank, or ``--rank``)."""
    remote = _open(url, args)
    results: list[dict[str, Any]] = []
    try:
        for step in _select(remote, args.step, args.all):
            results.extend(_verify_remote_step(remote, step, args.rank))
    finally:
        remote.close()
    if args.json:
        print_json({"url": remote.url, "results": results})
    else:
        width = max(len("STEP"), *(len(str(r["step"])) for r in results))
        columns = f"{{:>{width}}}  {{:>5}}  {{:<7}}  {{:>10}}  {{:>7}}  {{}}"
        print(columns.format("STEP", "RANK", "RESULT", "READ", "SECONDS", "REASON").rstrip())
        for r in results:
            print(columns.format(r["step"], "-" if r["rank"] is None else r["rank"],
                                 r["result"].upper(), human_bytes(r["bytes"]),
                                 f"{r['seconds']:.2f}", r["reason"] or "").rstrip())
    return EXIT_FAILED if any(r["result"] == "failed" for r in results) else EXIT_OK


def _verify_remote_step(remote: Remote, step: int, only: int | None) -> list[dict[str, Any]]:
    def failed(rank: int | None, reason: str, nbytes: int = 0,
               seconds: float = 0.0) -> dict[str, Any]:
        return {"step": step, "rank": rank, "ok": False, "result": "failed", "reason": reason,
                "bytes": nbytes, "seconds": round(seconds, 6)}

    try:
        record = read_step_record(remote, step)
    except CheckpointError as exc:
        return [failed(None, exc.message)]
    if record is None:
        return [failed(None, f"{step_dir_name(step)} has no commit object (an unfinished "
                             "promotion)")]
    ranks = range(record.world_size) if only is None else [only]
    out = []
    for rank in ranks:
        if not 0 <= rank < record.world_size:
            raise UsageError(f"step {step} was saved by {record.world_size} rank(s), there "
                              f"is no rank {rank}")
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="ckpt-verify-") as tmp:
            storage = LocalStorage(tmp)
            try:
                download_rank(remote, storage, record, rank)
            except CheckpointError as exc:
                out.append(failed(rank, exc.message, seconds=time.perf_counter() - started))
                continue
            status = scan_files(storage, FileSet(rank), step,
                                          step_dir_name(step))
            v = verify_step(storage, status, rank, explicit=True,
                             bar_stream=sys.stderr if sys.stderr.isatty() else None)
        out.append({"step": step, "rank": rank, "ok": v.result == "ok", "result": v.result,
                    "reason": v.reason, "bytes": _sizes(record, rank),
                    "seconds": round(time.perf_counter() - started, 6)})
    return out


def _sizes(record: StepRecord, rank: int) -> int:
    sums: Mapping[str, Any] = record.rank_objects(rank)
    return sum(s.size for s in sums.values())
