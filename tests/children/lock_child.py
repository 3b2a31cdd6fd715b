"""The other process of ``tests/pipeline/test_root_lock.py``: it opens, holds or forks a root's
lock.

Usage (the script is ``tests/children/lock_child.py``)::

    python lock_child.py open ROOT        # try to open a CheckpointPipeline; report; exit
    python lock_child.py acquire ROOT RANK  # try RootLock.acquire; report; release; exit
    python lock_child.py hold ROOT        # open a CheckpointPipeline; report; hold it
    python lock_child.py fork-hold ROOT   # acquire rank 0, fork a child; report; hold

Every mode writes one JSON line on stdout: ``{"ok": true, "pid": ...}`` on success, else
``{"ok": false, "error": class name, "message": str(error), "rank": ..., "path": ...}``. The
holding modes then block reading stdin until it ends (or until they are killed), so that the
test knows from the line alone that the lock is held; no sleeping is needed on either side.
``fork-hold`` forks after taking the lock (as a DataLoader forks its workers); the forked
grandchild reports whether it still has a descriptor of the lock file (``"child_fds"``), then
blocks on stdin too, and outlives its parent when the test SIGKILLs the parent.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import structlog

# This process is the application: it may configure logging (the library never does). Log
# lines go to stderr: stdout carries the one JSON line the test reads.
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    logger_factory=structlog.PrintLoggerFactory(sys.stderr),
)

import ckpt_pipeline as cp  # noqa: E402 (after the logging setup)
from ckpt_pipeline._pipeline.rootlock import RootLock  # noqa: E402
from ckpt_pipeline.errors import CheckpointError  # noqa: E402


def report(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def report_error(error: CheckpointError) -> None:
    report(ok=False, pid=os.getpid(), error=type(error).__name__, message=str(error),
           rank=error.rank, path=error.path)


def wait_for_stdin_end() -> None:
    while sys.stdin.buffer.read(4096):
        pass


def fds_to(path: Path) -> int:
    """How many of this process's descriptors are open on ``path`` (Linux /proc)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == str(path):
                count += 1
        except OSError:
            pass  # the descriptor of the listing itself, gone by now
    return count


def main(argv: list[str]) -> int:
    mode, root = argv[0], Path(argv[1])
    if mode == "open":
        try:
            with cp.CheckpointPipeline(root):
                pass
        except CheckpointError as error:
            report_error(error)
            return 0
        report(ok=True, pid=os.getpid())
        return 0
    if mode == "acquire":
        try:
            lock = RootLock.acquire(root, int(argv[2]))
        except CheckpointError as error:
            report_error(error)
            return 0
        lock.release()
        report(ok=True, pid=os.getpid())
        return 0
    if mode == "hold":
        try:
            pipe = cp.CheckpointPipeline(root)
            pipe.open()
        except CheckpointError as error:
            report_error(error)
            return 0
        report(ok=True, pid=os.getpid())
        wait_for_stdin_end()
        pipe.close()
        return 0
    if mode == "fork-hold":
        lock = RootLock.acquire(root, 0)
        lock_path = (root / ".lock-rank-00000").resolve()
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # the grandchild: say what it inherited, then wait to be killed
            os.close(read_end)
            os.write(write_end, f"{fds_to(lock_path)}\n".encode())
            os.close(write_end)
            wait_for_stdin_end()
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as pipe_in:
            child_fds = int(pipe_in.readline())
        report(ok=True, pid=os.getpid(), child_pid=child, child_fds=child_fds,
               parent_fds=fds_to(lock_path))
        wait_for_stdin_end()
        lock.release()
        return 0
    print(f"unknown mode {mode!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
