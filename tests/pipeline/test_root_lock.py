"""One job per checkpoint root and rank: the lock a pipeline takes at open (``_rootlock``).

The other process of each test is ``tests/children/lock_child.py``; it reports on one JSON line
of stdout once it holds (or failed to take) the lock, so no test sleeps to synchronise. Every
wait on a child is bounded (``CHILD_TIMEOUT_S``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.names import (
    TEMP_FILE,
    parse_rank_file,
    parse_rejected_dir,
    parse_step_dir,
)
from ckpt_pipeline._pipeline import rootlock as _rootlock
from ckpt_pipeline._pipeline.rootlock import RootLock
from ckpt_pipeline.errors import RootInUseError, UnsafeRootError
from tests._support.children import child_script, spawn_child
from tests._support.children import run_child as run_script

CHILD_SCRIPT = child_script("lock_child.py")
CHILD_TIMEOUT_S = 120.0  # a child imports torch first: seconds on a loaded machine
LOCK0 = ".lock-rank-00000"


def run_child(*args: str) -> dict[str, Any]:
    """Run a child that reports and exits; return its report."""
    done = run_script(CHILD_SCRIPT, *args, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    lines = done.stdout.decode().splitlines()
    assert len(lines) == 1, (lines, done.stderr.decode(errors="replace"))
    report: dict[str, Any] = json.loads(lines[0])
    return report


class Holder:
    """A child that holds the lock until its stdin is closed or it is killed."""

    def __init__(self, *args: str, stderr_path: Path) -> None:
        self.process = spawn_child(CHILD_SCRIPT, *args, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=stderr_path)
        self.stderr_path = stderr_path

    def report(self) -> dict[str, Any]:
        """The child's JSON line, waited for at most CHILD_TIMEOUT_S."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        data = b""
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            if not ready:
                raise AssertionError(f"no report from the child within {CHILD_TIMEOUT_S} s: "
                                     f"{self.stderr_path.read_text(errors='replace')}")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(f"the child ended without a report (status "
                                     f"{self.process.wait(CHILD_TIMEOUT_S)}): "
                                     f"{self.stderr_path.read_text(errors='replace')}")
            data += chunk
        report: dict[str, Any] = json.loads(data)
        return report

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=CHILD_TIMEOUT_S)

    def finish(self) -> None:
        """End it: close its stdin (it releases and exits), or kill it if it does not."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            try:
                self.process.stdin.close()
                self.process.wait(timeout=CHILD_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=CHILD_TIMEOUT_S)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None and not stream.closed:
                stream.close()


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.finish()


def tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root``: relative path -> (inode, size, mtime ns)."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(root))] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def holder_record(root: Path, name: str = LOCK0) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((root / name).read_text())
    return record


def alive(pid: int) -> bool:
    """Running (not a zombie); Linux /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


# ---------------------------------------------------------------------- the behaviours


@pytest.mark.slow
def test_second_process_is_refused_at_open_and_the_first_is_unaffected(root: Path) -> None:
    state = {"x": torch.zeros(4)}
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"x": torch.ones(4)}).result(30)
        before = tree(root)

        report = run_child("open", str(root))

        assert report["ok"] is False
        assert report["error"] == "RootInUseError"
        assert f"pid {os.getpid()} on host {socket.gethostname()!r}" in report["message"]
        assert report["rank"] == 0
        assert report["path"] == str(root / LOCK0)
        assert tree(root) == before  # refused before its scrub: nothing created or removed
        pipe.save(2, {"x": torch.full((4,), 2.0)}).result(30)
        restored = pipe.restore_latest(state)
    assert restored is not None and restored.step == 2
    assert torch.equal(state["x"], torch.full((4,), 2.0))
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-0000000001", "step-0000000002"]


def test_second_pipeline_in_the_same_process_is_refused_until_the_first_closes(
        root: Path) -> None:
    with cp.CheckpointPipeline(root) as first:
        first.save(1, {"x": torch.ones(4)}).result(30)
        second = cp.CheckpointPipeline(root)
        with pytest.raises(RootInUseError) as info:
            second.open()
        assert f"pid {os.getpid()}" in str(info.value)
        assert "this process" in str(info.value)
        assert info.value.rank == 0 and info.value.path == str(root / LOCK0)
        assert info.value.hint and "another checkpoint root" in info.value.hint
    with cp.CheckpointPipeline(root) as third:
        assert third.latest_step() == 1
        assert holder_record(root)["pid"] == os.getpid()


@pytest.mark.slow
def test_lock_left_by_a_sigkilled_process_is_taken_over(
        root: Path, tmp_path: Path, holders: list[Holder],
        caplog: pytest.LogCaptureFixture) -> None:
    holder = Holder("hold", str(root), stderr_path=tmp_path / "hold.err")
    holders.append(holder)
    report = holder.report()
    assert report["ok"] is True
    assert holder_record(root)["pid"] == report["pid"]
    holder.process.send_signal(signal.SIGKILL)
    assert holder.process.wait(timeout=CHILD_TIMEOUT_S) == -signal.SIGKILL

    with caplog.at_level(logging.INFO, logger="ckpt_pipeline"), cp.CheckpointPipeline(root):
        record = holder_record(root)
        assert record["pid"] == os.getpid()
        assert record["host"] == socket.gethostname()
        assert record["rank"] == 0 and record["root"] == str(root)
    taken = [r for r in caplog.records
             if getattr(r, "ckpt_event", None) == "ckpt.lock.taken_over"]
    assert len(taken) == 1
    assert f"pid {report['pid']} on host" in taken[0].ckpt_fields["previous_holder"]


@pytest.mark.slow
def test_ranks_sharing_a_root_do_not_block_each_other(root: Path) -> None:
    root.mkdir()
    rank0 = RootLock.acquire(root, 0)
    rank1 = RootLock.acquire(root, 1)
    try:
        assert holder_record(root, ".lock-rank-00000")["rank"] == 0
        assert holder_record(root, ".lock-rank-00001")["rank"] == 1
        again0 = run_child("acquire", str(root), "0")
        assert again0["ok"] is False and again0["error"] == "RootInUseError"
        assert again0["rank"] == 0 and f"pid {os.getpid()}" in again0["message"]
        rank2 = run_child("acquire", str(root), "2")
        assert rank2["ok"] is True
    finally:
        rank0.release()
        rank1.release()


@pytest.mark.skipif(not hasattr(os, "fork") or not Path("/proc/self/fd").is_dir(),
                    reason="needs fork() and /proc")
@pytest.mark.slow
def test_forked_child_does_not_keep_the_lock_after_its_parent_dies(
        root: Path, tmp_path: Path, holders: list[Holder]) -> None:
    root.mkdir()
    parent = Holder("fork-hold", str(root), stderr_path=tmp_path / "fork.err")
    holders.append(parent)
    report = parent.report()
    grandchild = report["child_pid"]
    try:
        assert report["ok"] is True
        assert report["parent_fds"] == 1 and report["child_fds"] == 0
        # Closing the grandchild's copy did not release the parent's lock.
        with pytest.raises(RootInUseError):
            RootLock.acquire(root, 0)
        parent.kill()
        assert alive(grandchild)
        lock = RootLock.acquire(root, 0)  # the grandchild, still alive, does not hold it
        assert alive(grandchild)
        lock.release()
    finally:
        os.kill(grandchild, signal.SIGKILL)


@pytest.mark.parametrize("target_exists", [True, False], ids=["to-a-file", "dangling"])
def test_symlinked_lock_file_is_refused(root: Path, tmp_path: Path,
                                        target_exists: bool) -> None:
    root.mkdir()
    target = tmp_path / "precious"
    if target_exists:
        target.write_text("do not truncate me")
    (root / LOCK0).symlink_to(target)
    with pytest.raises(UnsafeRootError) as info:
        RootLock.acquire(root, 0)
    assert "symlink" in str(info.value) and info.value.path == str(root / LOCK0)
    with pytest.raises(UnsafeRootError):
        cp.CheckpointPipeline(root).open()
    assert (root / LOCK0).is_symlink()
    if target_exists:
        assert target.read_text() == "do not truncate me"
    else:
        assert not target.exists()


# ---------------------------------------------------------------------- details


def test_lock_file_name_matches_no_checkpoint_name() -> None:
    for rank in (0, 1, 99_999, 123_456):
        name = _rootlock.lock_file_name(rank)
        assert name.startswith(".lock-rank-")
        assert parse_step_dir(name) is None and parse_rank_file(name) is None
        assert parse_rejected_dir(name) is None and TEMP_FILE.match(name) is None


def test_unreadable_holder_record_still_refuses_with_holder_unknown(root: Path) -> None:
    root.mkdir()
    lock = RootLock.acquire(root, 0)
    try:
        (root / LOCK0).write_bytes(b"\x00garbage{")
        with pytest.raises(RootInUseError, match="holder unknown"):
            RootLock.acquire(root, 0)
    finally:
        lock.release()


def test_release_is_idempotent_and_leaves_the_file_emptied(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    root.mkdir()
    lock = RootLock.acquire(root, 3)
    assert (root / ".lock-rank-00003").stat().st_mode & 0o777 == 0o600
    lock.release()
    lock.release()
    assert (root / ".lock-rank-00003").read_bytes() == b""  # released, not left by a death
    with caplog.at_level(logging.INFO, logger="ckpt_pipeline"):
        RootLock.acquire(root, 3).release()
    assert not [r for r in caplog.records if getattr(r, "ckpt_event", None)]


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL])
def test_file_system_without_flock_opens_unprotected_with_a_warning(
        root: Path, code: int, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def refuse(fd: int, operation: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(_rootlock.fcntl, "flock", refuse)
    with caplog.at_level(logging.WARNING, logger="ckpt_pipeline"), \
            cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"x": torch.ones(4)}).result(30)
    warned = [r for r in caplog.records
              if getattr(r, "ckpt_event", None) == "ckpt.lock.unprotected"]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert warned[0].ckpt_fields["rank"] == 0
    assert os.strerror(code) in warned[0].ckpt_fields["reason"]
