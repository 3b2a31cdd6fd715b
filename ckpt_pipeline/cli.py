"""The ``ckpt-pipeline`` command: list the checkpoints under a root, and verify them.

``ls`` takes a cheap look (names, sizes, commit records, manifests, shard headers); ``verify``
reads every byte of tensor data and checks it against its checksum, as a restore would. Both
only read: nothing under the root is created, changed or removed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

import anyio

from ._format.codec import (
    CommitRecord,
    ShardHeader,
    commit_name,
    decode_commit,
    manifest_name,
    parse_rank_file,
    parse_rejected_dir,
    shard_name,
)
from ._restore import scan as _recovery
from ._save.retain import read_markers
from .errors import CheckpointError, CheckpointIntegrityError
from .storage import LocalStorage, Storage

__all__ = ("main",)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_PROG = "ckpt-pipeline"
_SMALL_FILE_MAX = 1024 * 1024
_VERIFY_THREADS = 4
_PROGRESS_MIN_BYTES = 64 * 1024 * 1024
_PROGRESS_WIDTH = 30
_PROGRESS_INTERVAL_S = 0.1
_PRUNED_WHILE_VERIFIED = ("removed while it was being verified (pruned by a running "
                          "job?)")


class _UsageError(Exception):
    """The command line names something that is not there (exit status 2)."""


# --------------------------------------------------------------------------- ls


@dataclass(frozen=True, slots=True)
class _Listing:
    """One row of ``ls``: a step directory as seen by one rank."""

    step: int
    dir_name: str
    path: str
    status: str
    """complete, incomplete, corrupt or rejected."""
    reason: str | None
    bytes: int
    """Size of this rank's files in the directory."""
    committed_unix: float | None
    mtime_unix: float | None
    save_id: str | None
    world_size: int | None
    ranks_committed: tuple[int, ...]
    ranks_present: tuple[int, ...]
    retention_failed: str | None = None
    """Why a running job's retention could not remove this step (its marker in the root)."""

    def age_seconds(self, now: float) -> float | None:
        when = self.committed_unix if self.committed_unix is not None else self.mtime_unix
        return None if when is None else max(0.0, now - when)


def _list_steps(storage: Storage, rank: int) -> list[_Listing]:
    """Every step directory, and every one that recovery moved aside, newest first."""
    rows = [_listing(storage, rank, s.step, s.dir_name, s) for s in _recovery.scan(storage, rank)]
    for entry in storage.list_dir(""):
        parsed = parse_rejected_dir(entry.name)
        step = None if parsed is None else parsed[0]
        if step is not None and entry.is_dir and not entry.is_symlink:
            rows.append(_listing(storage, rank, step, entry.name, None))
    failed = read_markers(storage, rank)
    rows = [replace(r, retention_failed=failed[r.step],
                    reason=r.reason or f"retention could not remove it: {failed[r.step]}")
            if r.step in failed and r.status != "rejected" else r for r in rows]
    rows.sort(key=lambda r: (r.step, r.status != "rejected", r.dir_name), reverse=True)
    return rows


def _listing(storage: Storage, rank: int, step: int, dir_name: str,
             status: _recovery.StepStatus | None) -> _Listing:
    """Describe one directory; ``status`` is None for a directory that recovery moved aside."""
    entries = storage.list_dir(dir_name)
    own = {shard_name(rank), manifest_name(rank), commit_name(rank)}
    size = sum(e.size for e in entries if e.is_file and e.name in own)
    committed: set[int] = set()
    present: set[int] = set()
    for entry in entries:
        parsed = parse_rank_file(entry.name)
        if parsed is None or not entry.is_file:
            continue
        present.add(parsed[0])
        if parsed[1] == "commit":
            committed.add(parsed[0])
    path = os.path.join(storage.root, dir_name)
    try:
        mtime: float | None = os.lstat(path).st_mtime
    except OSError:
        mtime = None
    if status is not None and status.valid:
        return _Listing(step, dir_name, path, "complete", None, size, status.committed_unix,
                        mtime, status.save_id, status.world_size, tuple(sorted(committed)),
                        tuple(sorted(present)))
    reason: str | None
    if status is None:
        state, reason = "rejected", "moved aside by recovery"
    elif not status.complete:
        state, reason = "incomplete", status.reason
    elif commit_name(rank) not in {e.name for e in entries}:
        # Complete when scanned, its commit record gone now: a running job pruned the step
        # (the commit record goes first) between the scan's reads. Not corruption.
        state, reason = "incomplete", ("its commit record was removed while it was being "
                                       "listed (pruned by a running job?)")
    else:
        state, reason = "corrupt", status.reason
    record = _commit_record(storage, dir_name, step, rank)
    return _Listing(step, dir_name, path, state, reason, size,
                    None if record is None else record.committed_unix, mtime,
                    None if record is None else record.save_id,
                    None if record is None else record.world_size,
                    tuple(sorted(committed)), tuple(sorted(present)))


def _commit_record(storage: Storage, dir_name: str, step: int, rank: int) -> CommitRecord | None:
    """This rank's commit record of the step, or None where it is missing or unreadable."""
    rel = os.path.join(dir_name, commit_name(rank))
    try:
        fd, size = storage.open_read(rel)
        try:
            if size > _SMALL_FILE_MAX:
                return None
            buf = bytearray(size)
            storage.pread_into(fd, memoryview(buf), 0)
        finally:
            storage.close(fd)
        record = decode_commit(bytes(buf), os.path.join(storage.root, rel))
    except CheckpointError:
        return None
    return record if (record.step, record.rank) == (step, rank) else None


def _cmd_ls(args: argparse.Namespace) -> int:
    storage = _open_root(args.root)
    rank: int = args.rank
    rows = _list_steps(storage, rank)
    now = time.time()
    if args.json:
        _print_json({
            "root": str(storage.root),
            "rank": rank,
            "steps": [{
                "step": r.step,
                "dir": r.dir_name,
                "path": r.path,
                "status": r.status,
                "reason": r.reason,
                "bytes": r.bytes,
                "age_seconds": _rounded(r.age_seconds(now)),
                "committed_unix": r.committed_unix,
                "mtime_unix": r.mtime_unix,
                "save_id": r.save_id,
                "world_size": r.world_size,
                "ranks_committed": list(r.ranks_committed),
                "ranks_present": list(r.ranks_present),
                "retention_failed": r.retention_failed,
            } for r in rows],
        })
        return EXIT_OK
    if not rows:
        print(f"no checkpoints under {storage.root}")
        return EXIT_OK
    headers = ["STEP", "STATUS", "SIZE", "AGE", "RANKS", "SAVE ID"]
    table = [[str(r.step), r.status, _human_bytes(r.bytes), _human_age(r.age_seconds(now)),
              _ranks_text(r.ranks_committed, r.world_size), r.save_id or "-"] for r in rows]
    if any(r.reason for r in rows):
        headers.append("REASON")
        for cells, r in zip(table, rows):
            cells.append(r.reason or "")
    for line in _table(headers, table, right={0, 2, 3}):
        print(line)
    return EXIT_OK


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True, slots=True)
class _Verified:
    """The outcome of verifying one step for one rank."""

    step: int
    result: str
    """ok, failed, or skipped (a step without this rank's commit record, under --all)."""
    reason: str | None
    bytes: int
    """Tensor bytes read and checked (up to the failure, for a step that failed)."""
    seconds: float
    save_id: str | None
    path: str


class _Progress:
    """Counts the bytes checked; on a terminal, draws ``[#####.....] 45% 1.2/2.7 GiB``.

    ``read_shard`` calls it from several worker threads at once.
    """

    def __init__(self, total: int, label: str, stream: TextIO | None) -> None:
        self.total = total
        self.done = 0
        self._label = label
        self._stream = stream
        self._lock = threading.Lock()
        self._drawn_at = 0.0

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self._stream is None:
                return
            now = time.monotonic()
            if now - self._drawn_at >= _PROGRESS_INTERVAL_S or self.done >= self.total:
                self._drawn_at = now
                self._draw(f"\r{self._label} {_progress_text(self.done, self.total)}")

    def _draw(self, text: str) -> None:
        """Best-effort: a terminal that went away stops the bar, never the verification."""
        if self._stream is None:
            return
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            self._stream = None

    def close(self) -> None:
        """Erase the bar, so that the result line takes its place."""
        with self._lock:
            if self._stream is not None and self._drawn_at:
                width = len(self._label) + 1 + len(_progress_text(self.total, self.total))
                self._draw("\r" + " " * width + "\r")
            self._stream = None


def _progress_text(done: int, total: int, width: int = _PROGRESS_WIDTH) -> str:
    """``[#####.....] 45% 1.2/2.7 GiB``: the fraction done, in the unit of the total."""
    fraction = min(1.0, done / total) if total > 0 else 1.0
    filled = int(fraction * width)
    unit, scale = _unit_for(total)
    return (f"[{'#' * filled}{'.' * (width - filled)}] {int(fraction * 100):3d}% "
            f"{done / scale:.1f}/{total / scale:.1f} {unit}")


async def _read_shard(storage: Storage, status: _recovery.StepStatus, rank: int,
                      progress: Callable[[int], None]) -> _recovery.LoadedShard:
    limiter = anyio.CapacityLimiter(_VERIFY_THREADS)
    return await _recovery.read_shard(storage, status, rank,
                                      threads=_VERIFY_THREADS, limiter=limiter,
                                      progress=progress)


def _verify_step(storage: Storage, status: _recovery.StepStatus, rank: int, *,
                 explicit: bool, bar_stream: TextIO | None) -> _Verified:
    """Read and check every byte of one step, then its state tree and TrainState."""

    def outcome(result: str, reason: str | None, nbytes: int = 0,
                seconds: float = 0.0) -> _Verified:
        save_id = status.save_id
        if save_id is None:
            record = _commit_record(storage, status.dir_name, status.step, rank)
            save_id = None if record is None else record.save_id
        return _Verified(status.step, result, reason, nbytes, seconds, save_id, status.path)

    if not status.complete:
        return outcome("failed" if explicit else "skipped", status.reason)
    if not status.valid or status.header is None:
        if _was_pruned(storage, status, rank):
            return outcome("skipped", _PRUNED_WHILE_VERIFIED)
        return outcome("failed", status.reason)
    total = sum(r.nbytes for r in status.header.tensors)
    show = bar_stream if total > _PROGRESS_MIN_BYTES else None
    progress = _Progress(total, f"step {status.step}", show)
    started = time.perf_counter()
    try:
        shard = anyio.run(_read_shard, storage, status, rank, progress)
        _check_contents(status, shard.header, rank)
        del shard  # the whole data region: let it go before the next step is read
    except CheckpointError as exc:
        seconds = time.perf_counter() - started
        if _was_pruned(storage, status, rank):
            return outcome("skipped", _PRUNED_WHILE_VERIFIED, progress.done, seconds)
        return outcome("failed", str(exc), progress.done, seconds)
    finally:
        progress.close()
    return outcome("ok", None, total, time.perf_counter() - started)


def _check_contents(status: _recovery.StepStatus, header: ShardHeader, rank: int) -> None:
    """The state tree decodes to a map whose tensor references all exist; the TrainState too."""
    _recovery.decode_contents(status, rank)


def _was_pruned(storage: Storage, status: _recovery.StepStatus, rank: int) -> bool:
    """Whether this rank's commit record disappeared (a running job pruned the step)."""
    try:
        names = {e.name for e in storage.list_dir(status.dir_name)}
    except CheckpointError:
        return False
    return commit_name(rank) not in names


def _select(storage: Storage, rank: int, step: int | None,
            every: bool) -> tuple[list[_recovery.StepStatus], bool]:
    """The steps to verify, newest first, and whether the user named them explicitly."""
    statuses = _recovery.scan(storage, rank)
    if step is not None:
        match = [s for s in statuses if s.step == step]
        if not match:
            hint = ""
            if any((parse_rejected_dir(e.name) or (None,))[0] == step
                   for e in storage.list_dir("")):
                hint = " (only a directory that recovery moved aside holds it)"
            raise _UsageError(f"step {step} not found under {storage.root}{hint}")
        return match, True
    if not statuses:
        raise _UsageError(f"no checkpoints under {storage.root}")
    if every:
        return statuses, False
    newest = [s for s in statuses if s.valid][:1] or [s for s in statuses if s.complete][:1]
    if not newest:
        raise CheckpointIntegrityError(
            f"no step under the root holds a commit record of rank {rank}", rank=rank,
            path=storage.root, hint="every save is incomplete; `ckpt-pipeline ls` shows them")
    return newest, False


def _cmd_verify(args: argparse.Namespace) -> int:
    storage = _open_root(args.root)
    rank: int = args.rank
    targets, explicit = _select(storage, rank, args.step, args.all)
    bar_stream = sys.stderr if sys.stderr.isatty() else None
    step_width = max(len("STEP"), *(len(str(s.step)) for s in targets))
    columns = f"{{:>{step_width}}}  {{:<7}}  {{:>10}}  {{:>7}}  {{:>6}}  {{}}"
    if not args.json:
        print(columns.format("STEP", "RESULT", "READ", "SECONDS", "GB/S", "REASON").rstrip(),
              flush=True)
    results: list[_Verified] = []
    for status in targets:
        v = _verify_step(storage, status, rank, explicit=explicit, bar_stream=bar_stream)
        results.append(v)
        if not args.json:
            read = v.seconds > 0
            rate = f"{v.bytes / v.seconds / 1e9:.2f}" if read and v.result == "ok" else "-"
            print(columns.format(v.step, v.result.upper(),
                                 _human_bytes(v.bytes) if read else "-",
                                 f"{v.seconds:.2f}" if read else "-", rate,
                                 v.reason or "").rstrip(), flush=True)
    failed = sum(v.result == "failed" for v in results)
    if args.json:
        _print_json({
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
            } for v in results],
        })
    elif len(results) > 1:
        counts = {name: sum(v.result == name for v in results)
                  for name in ("ok", "failed", "skipped")}
        print(", ".join(f"{n} {name}" for name, n in counts.items() if n))
    return EXIT_FAILED if failed else EXIT_OK


# --------------------------------------------------------------------------- formatting


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], *,
           right: set[int]) -> list[str]:
    """Lines of an aligned table; columns in ``right`` are right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = []
    for cells in [headers, *rows]:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(cells, widths))]
        lines.append("  ".join(parts).rstrip())
    return lines


_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def _unit_for(nbytes: int) -> tuple[str, int]:
    """The largest binary unit in which ``nbytes`` is at least 1."""
    unit, scale = "B", 1
    for name in _UNITS:
        if nbytes < scale * 1024:
            break
        unit, scale = name, scale * 1024
    return unit, scale


def _human_bytes(nbytes: int) -> str:
    """``96 B``, ``411.1 KiB``, ``1.2 GiB``."""
    unit, scale = _unit_for(nbytes)
    return f"{nbytes} B" if scale == 1 else f"{nbytes / scale:.1f} {unit}"


def _human_age(seconds: float | None) -> str:
    """``42s``, ``5m``, ``3h``, ``2d``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _ranks_text(ranks: Sequence[int], world_size: int | None) -> str:
    """Ranks as ranges (``0-3``, ``0,2,5-7``); ``of N`` when some of the job's are missing."""
    if not ranks:
        return "-"
    spans: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    text = ",".join(spans)
    if world_size is not None and list(ranks) != list(range(world_size)):
        text += f" of {world_size}"
    return text


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _print_json(data: dict[str, Any]) -> None:
    print(json.dumps(data, indent=2))


# --------------------------------------------------------------------------- entry point


def _open_root(root: str) -> LocalStorage:
    path = os.path.abspath(root)
    if not os.path.exists(path):
        raise _UsageError(f"no checkpoint root at {path}")
    if not os.path.isdir(path):
        raise _UsageError(f"{path} is not a directory")
    return LocalStorage(path)


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG, description="Inspect and verify ckpt_pipeline checkpoints (read-only).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ls = commands.add_parser("ls", help="list the steps under a checkpoint root",
                             description="List every step directory under ROOT, newest "
                                         "first, as one rank sees it.")
    ls.set_defaults(handler=_cmd_ls)

    verify = commands.add_parser(
        "verify", help="read a step back and check every checksum",
        description="Read every byte of tensor data of the newest valid step (or the step "
                    "given) and check it against its checksum; decode the state tree and the "
                    "TrainState. Exit status 0 when every step verified, 1 when one failed.")
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--step", type=_nonneg_int, metavar="N", help="verify step N")
    which.add_argument("--all", action="store_true", help="verify every step")
    verify.set_defaults(handler=_cmd_verify)

    for sub in (ls, verify):
        sub.add_argument("root", metavar="ROOT", help="the checkpoint root directory")
        sub.add_argument("--rank", type=_nonneg_int, default=0, metavar="R",
                         help="look at the files of rank R (default 0)")
        sub.add_argument("--json", action="store_true", help="print JSON for scripts")
    return parser


def _error(message: str) -> None:
    print(f"{_PROG}: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit status (0 ok, 1 a check failed, 2 usage error)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except _UsageError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except CheckpointError as exc:
        _error(str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (``| head``): silence the flush at exit too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
