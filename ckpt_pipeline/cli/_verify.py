"""``ckpt-pipeline verify``: read steps back and check every byte, as a restore would.

Every byte of tensor data of the newest valid step (or the step given, or every step) is read
and checked against its checksum, then the state tree and the TrainState are decoded. Every copy
of another rank's shard that the rank holds in those step directories (replication,
``replica-S-on-H.*``) is checked the same way, on its own: a bad copy fails the command as a bad
own shard does, and neither hides the other. A step that a running job prunes while it is read
is skipped, not failed. Nothing under the root is created, changed or removed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TextIO

import anyio

from .._format.filesets import FileSet
from .._format.header import ShardHeader
from .._format.names import commit_name, parse_rejected_dir, parse_rewound_dir
from .._format.scan import StepStatus, decode_contents, scan
from .._format.steps import readable_commit
from .._restore.read import LoadedShard, read_shard
from ..errors import CheckpointError, CheckpointIntegrityError
from ..storage import Storage
from ._ls import copies_by_dir
from ._output import Progress, human_bytes, print_json
from ._status import EXIT_FAILED, EXIT_OK, UsageError

__all__ = ("cmd_verify",)

_VERIFY_THREADS = 4
_PROGRESS_MIN_BYTES = 64 * 1024 * 1024
_PRUNED_WHILE_VERIFIED = ("removed while it was being verified (pruned by a running "
                          "job?)")


@dataclass(frozen=True, slots=True)
class _Verified:
    """The outcome of verifying one step for one rank: its own shard, or a copy it holds."""

    step: int
    result: str
    """ok, failed, or skipped (a step without this rank's commit record, under --all)."""
    reason: str | None
    bytes: int
    """Tensor bytes read and checked (up to the failure, for a step that failed)."""
    seconds: float
    save_id: str | None
    path: str
    source: int | None = None
    """For a copy: the rank whose shard it is (None: the rank's own shard)."""
    holder: int | None = None
    """For a copy: the rank that holds it."""
    shard: str | None = None
    """Path of the shard file."""


async def _read_shard(storage: Storage, status: StepStatus, rank: int,
                      progress: Callable[[int], None]) -> LoadedShard:
    limiter = anyio.CapacityLimiter(_VERIFY_THREADS)
    return await read_shard(storage, status, rank,
                                      threads=_VERIFY_THREADS, limiter=limiter,
                                      progress=progress)


def verify_step(storage: Storage, status: StepStatus, rank: int, *,
                 explicit: bool, bar_stream: TextIO | None) -> _Verified:
    """Read and check every byte of one step's shard (the rank's own, or the copy of another
    rank's that ``status.files`` names), then its state tree and TrainState."""
    files = status.files or FileSet(rank)
    copy = files.holder is not None
    source = files.source  # the rank whose shard it is: the header and records name it
    held = f"(copy held by rank {files.holder})"

    def outcome(result: str, reason: str | None, nbytes: int = 0,
                seconds: float = 0.0) -> _Verified:
        save_id = status.save_id
        if save_id is None:
            record = readable_commit(storage, status.dir_name, status.step, source, files)
            save_id = None if record is None else record.save_id
        if copy and reason is not None and held not in reason:
            reason = f"{reason} {held}"
        return _Verified(status.step, result, reason, nbytes, seconds, save_id, status.path,
                         source if copy else None, files.holder,
                         os.path.join(storage.root, status.dir_name, files.shard))

    if not status.complete:
        return outcome("failed" if explicit else "skipped", status.reason)
    if not status.valid or status.header is None:
        if _was_pruned(storage, status, rank):
            return outcome("skipped", _PRUNED_WHILE_VERIFIED)
        return outcome("failed", status.reason)
    total = sum(end - start for start, end, _ in status.header.checks())
    show = bar_stream if total > _PROGRESS_MIN_BYTES else None
    label = f"step {status.step}" + (f" copy of {source}" if copy else "")
    progress = Progress(total, label, show)
    started = time.perf_counter()
    try:
        shard = anyio.run(_read_shard, storage, status, source, progress)
        _check_contents(status, shard.header, source)
        del shard  # the whole data region: let it go before the next step is read
    except CheckpointError as exc:
        seconds = time.perf_counter() - started
        if _was_pruned(storage, status, rank):
            return outcome("skipped", _PRUNED_WHILE_VERIFIED, progress.done, seconds)
        return outcome("failed", str(exc), progress.done, seconds)
    finally:
        progress.close()
    return outcome("ok", None, total, time.perf_counter() - started)


def _check_contents(status: StepStatus, header: ShardHeader, rank: int) -> None:
    """The state tree decodes to a map whose tensor references all exist; the TrainState too."""
    decode_contents(status, rank)


def _was_pruned(storage: Storage, status: StepStatus, rank: int) -> bool:
    """Whether the commit record of the files verified (this rank's own, or the copy's)
    disappeared (a running job pruned the step)."""
    try:
        names = {e.name for e in storage.list_dir(status.dir_name)}
    except CheckpointError:
        return False
    commit = commit_name(rank) if status.files is None else status.files.commit
    return commit not in names


def _select(storage: Storage, rank: int, step: int | None,
            every: bool) -> tuple[list[StepStatus], bool]:
    """The steps to verify, newest first, and whether the user named them explicitly."""
    statuses = scan(storage, rank)
    if step is not None:
        match = [s for s in statuses if s.step == step]
        if not match:
            hint = ""
            if any((parse_rejected_dir(e.name) or parse_rewound_dir(e.name) or (None,))[0]
                   == step for e in storage.list_dir("")):
                hint = " (only a directory that recovery moved aside holds it)"
            raise UsageError(f"step {step} not found under {storage.root}{hint}")
        return match, True
    if not statuses:
        raise UsageError(f"no checkpoints under {storage.root}")
    if every:
        return statuses, False
    newest = [s for s in statuses if s.valid][:1] or [s for s in statuses if s.complete][:1]
    if not newest:
        raise CheckpointIntegrityError(
            f"no step under the root holds a commit record of rank {rank}", rank=rank,
            path=storage.root, hint="every save is incomplete; `ckpt-pipeline ls` shows them")
    return newest, False


def cmd_verify(storage: Storage, args: argparse.Namespace) -> int:
    """Verify the steps selected; exit status 1 when one failed."""
    rank: int = args.rank
    targets, explicit = _select(storage, rank, args.step, args.all)
    held = copies_by_dir(storage, rank)
    copies = {s.dir_name: held.get(s.dir_name, []) for s in targets}
    bar_stream = sys.stderr if sys.stderr.isatty() else None
    step_width = max(len("STEP"), *(len(str(s.step)) for s in targets))
    # A SHARD column (own, or copy of S) only when a step verified holds copies.
    shard_width = max([len(_shard_text(c.source)) for c in _flat(copies.values())], default=0)
    shard_column = f"{{:<{max(len('SHARD'), shard_width)}}}  " if shard_width else ""
    columns = (f"{{:>{step_width}}}  {shard_column}{{:<7}}  {{:>10}}  {{:>7}}  {{:>6}}  {{}}")

    def show(v: _Verified) -> None:
        if args.json:
            return
        read = v.seconds > 0
        rate = f"{v.bytes / v.seconds / 1e9:.2f}" if read and v.result == "ok" else "-"
        cells = [v.step, *([_shard_text(v.source)] if shard_width else []), v.result.upper(),
                 human_bytes(v.bytes) if read else "-", f"{v.seconds:.2f}" if read else "-",
                 rate, v.reason or ""]
        print(columns.format(*cells).rstrip(), flush=True)

    if not args.json:
        heading = ["STEP", *(["SHARD"] if shard_width else []), "RESULT", "READ", "SECONDS",
                   "GB/S", "REASON"]
        print(columns.format(*heading).rstrip(), flush=True)
    results: list[tuple[_Verified, list[_Verified]]] = []
    for status in targets:
        v = verify_step(storage, status, rank, explicit=explicit, bar_stream=bar_stream)
        show(v)
        checked: list[_Verified] = []
        for copy in copies[status.dir_name]:
            checked.append(verify_step(storage, copy, rank, explicit=explicit,
                                        bar_stream=bar_stream))
            show(checked[-1])
        results.append((v, checked))
    rows = [v for own, held_copies in results for v in (own, *held_copies)]
    failed = sum(v.result == "failed" for v in rows)
    if args.json:
        print_json({
            "root": str(storage.root),
            "rank": rank,
            "results": [{
                "step": v.step,
                "ok": None if v.result == "skipped" else v.result == "ok",
                "result": v.result,
                "reason": v.reason,
                "bytes": v.bytes,
                "seconds": round(v.seconds, 6),
                "save_id": v.save_id,
                "path": v.path,
                "copies": [{
                    "source": c.source,
                    "holder": c.holder,
                    "ok": None if c.result == "skipped" else c.result == "ok",
                    "result": c.result,
                    "reason": c.reason,
                    "bytes": c.bytes,
                    "seconds": round(c.seconds, 6),
                    "save_id": c.save_id,
                    "path": c.path,
                    "shard": c.shard,
                } for c in checked],
            } for v, checked in results],
        })
    elif len(rows) > 1:
        counts = {name: sum(v.result == name for v in rows)
                  for name in ("ok", "failed", "skipped")}
        print(", ".join(f"{n} {name}" for name, n in counts.items() if n))
    return EXIT_FAILED if failed else EXIT_OK


def _shard_text(source: int | None) -> str:
    """The SHARD cell: ``own``, or ``copy of S`` for a copy of rank S's shard."""
    return "own" if source is None else f"copy of {source}"


def _flat(groups: Iterable[list[StepStatus]]) -> list[StepStatus]:
    return [s for group in groups for s in group]
