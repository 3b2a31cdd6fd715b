"""Shutdown with saves in flight: every way a training process ends, in real child processes.

Each child (``tests/children/shutdown_child.py``) commits step ``ACKED``, then saves step
``IN_FLIGHT`` on a disk whose shard fsync is slow (a real fsync after a sleep), and ends while
that save is in its fsync: leaving the ``with`` block, raising in it, exiting without
``close()``, SIGINT once, SIGINT twice, SIGTERM, SIGKILL, or (async) a cancellation. Then the
test opens a fresh pipeline on the root and restores: the step must be the one the semantics
promise, with exactly that step's tensors and TrainState; nothing may have looked complete that
was not (no rejected step, no commit record without its data), and no temporary survives the
open.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import GatedStorage, capture_logs
from tests._support.children import child_script, load_script, spawn_child

CHILD_SCRIPT = child_script("shutdown_child.py")
DEADLINE_S = 60.0
SLOW_S = 1.0
"""fsync delay where the save must finish: close() visibly waits for it."""
STUCK_S = 10.0
"""fsync delay where the child must end first: the save is abandoned mid-fsync."""
PROMPT_S = 5.0
"""A second Ctrl-C stops close()'s wait within this; a cancelled aclose() returns within
this after the I/O call in progress."""

COMMITTED_FILES = ["rank-00000.commit", "rank-00000.manifest", "rank-00000.shard"]
STEP_DIR = re.compile(r"step-[0-9]{10,}")
TEMP_FILE = re.compile(r"\.rank-00000\.(shard|manifest|commit)\.tmp-[0-9a-f]+")


child = load_script(CHILD_SCRIPT)
ACKED, IN_FLIGHT = child.ACKED, child.IN_FLIGHT


class _ChildFailed(Exception):
    pass


class _Child:
    """One child process, started with its orders (it imports torch first)."""

    def __init__(self, name: str, base: Path, orders: dict[str, Any]) -> None:
        self.root = Path(orders["root"])
        self.out_path, self.err_path = base / f"{name}.out", base / f"{name}.err"
        self.process = spawn_child(CHILD_SCRIPT, json.dumps(orders), unbuffered=True,
                                   stdin=subprocess.DEVNULL, stdout=self.out_path,
                                   stderr=self.err_path)

    def lines(self) -> list[str]:
        return self.out_path.read_text(errors="replace").splitlines()

    def log(self, event: str) -> list[dict[str, Any]]:
        """The library's log lines (JSON on stderr) of one event."""
        out = []
        for line in self.err_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and (entry := json.loads(line)).get("event") == event:
                out.append(entry)
        return out

    def output(self) -> str:
        return (f"--- stdout\n{self.out_path.read_text(errors='replace')}--- stderr\n"
                f"{self.err_path.read_text(errors='replace')}")

    def _poll(self, found: Callable[[], list[str] | None], what: str) -> list[str]:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            if (words := found()) is not None:
                return words
            if self.process.poll() is not None:
                raise _ChildFailed(f"the child exited ({self.process.returncode}) before "
                                   f"{what}")
            time.sleep(0.005)
        raise _ChildFailed(f"no {what} from the child within {DEADLINE_S} s")

    def wait_for(self, word: str) -> list[str]:
        """The words of the first stdout line that starts with ``word`` (polled)."""
        def found() -> list[str] | None:
            for line in self.lines():
                if line.split()[:1] == [word]:
                    return line.split()
            return None

        return self._poll(found, word)

    def wait_for_log(self, event: str) -> None:
        self._poll(lambda: [] if f'"{event}"' in self.err_path.read_text(errors="replace")
                   else None, event)

    def exit_code(self) -> int:
        try:
            return self.process.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise _ChildFailed(f"the child did not exit within {DEADLINE_S} s") from None


def _layout(root: Path) -> dict[str, list[str]]:
    """Every step directory (or stray entry) under the root and the names in it."""
    out: dict[str, list[str]] = {}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith(".lock-"):  # the pipeline's lock file (one job per root)
            continue
        is_dir = entry.is_dir(follow_symlinks=False)
        out[entry.name] = sorted(os.listdir(entry.path)) if is_dir else ["<not a directory>"]
    return out


def _committed_only(root: Path) -> list[str]:
    """Anything under the root other than step directories holding exactly a committed set."""
    return [f"{name} holds {names}" for name, names in _layout(root).items()
            if not STEP_DIR.fullmatch(name) or names != COMMITTED_FILES]


def _check_leftovers(root: Path, where: str) -> list[str]:
    """What the ended child left besides committed steps; never a commit record of a step
    whose data is missing, nothing outside the in-flight step's directory."""
    leftovers = []
    for name, names in _layout(root).items():
        if names == COMMITTED_FILES:
            continue
        assert name == f"step-{IN_FLIGHT:010d}", f"{where}: {name} holds {names}"
        assert "rank-00000.commit" not in names, f"{where}: a commit record in {names}"
        for entry in names:
            assert TEMP_FILE.fullmatch(entry) or entry in COMMITTED_FILES, (
                f"{where}: unexpected {entry} in {name}")
        leftovers += [f"{name}/{entry}" for entry in names]
    return leftovers


def _restore_and_check(root: Path, expected: int, where: str) -> list[cp.Event]:
    """Open a fresh pipeline, restore, check the step is exactly ``expected``; return events."""
    events: list[cp.Event] = []
    state = child.make_state()
    pipe = cp.CheckpointPipeline(root, keep_last=child.KEEP_LAST, restore_rng=False)
    pipe.subscribe(events.append)
    with pipe:
        restored = pipe.restore_latest(state)
    assert restored is not None, f"{where}: nothing restored"
    assert restored.step == expected, f"{where}: restored step {restored.step}"
    assert restored.rejected == (), f"{where}: a step looked complete but was not: " \
                                    f"{restored.rejected}"
    assert child.mismatches(state, expected) == [], where
    ts = restored.train_state
    assert (ts.step, ts.consumed_train_samples, dict(ts.extra)) == (
        expected, expected * child.SAMPLES_PER_STEP, {"tag": f"s{expected}"}), where
    assert _committed_only(root) == [], f"{where}: left after the open: {_layout(root)}"
    return events


@dataclass(frozen=True)
class Case:
    """How a child ends, and what the semantics promise after it."""

    case: str
    fsync_delay: float
    exit_codes: tuple[int, ...]
    finishes: bool
    """True: the in-flight save must be committed. False: it is abandoned (or killed)."""
    signals: tuple[tuple[int, str], ...] = ()
    """(signal, when): sent once the child printed the word (TRAINING: it trains, the save
    in its fsync) or logged the event (ckpt.close.waiting: close() waits for the save)."""
    orders: dict[str, Any] = field(default_factory=dict)
    waiting_reason: str | None = None
    """close() logs that it waits for the steps in flight, with this in its reason."""
    in_flight: tuple[int, ...] = (IN_FLIGHT,)
    """The steps in flight when the child began to end (the newest is restored if they
    finish)."""


INT = -signal.SIGINT  # an unhandled KeyboardInterrupt ends Python by SIGINT (130 in a shell)
TERM = -signal.SIGTERM
TRAINING, CLOSING = "TRAINING", "ckpt.close.waiting"
CASES = {
    "with-block-left": Case("normal", SLOW_S, (0,), True, waiting_reason="close"),
    "exception-in-with": Case("raise", SLOW_S, (1,), True, waiting_reason="RuntimeError"),
    "exit-without-close": Case("exit", SLOW_S, (0,), True,
                               waiting_reason="interpreter exit"),
    "exit-without-close-timeout": Case("exit", STUCK_S, (0,), False,
                                       orders={"exit_timeout": 0.5},
                                       waiting_reason="interpreter exit"),
    "exit-then-sigint": Case("exit", STUCK_S, (0,), False, ((signal.SIGINT, CLOSING),),
                             waiting_reason="interpreter exit"),
    "sigint": Case("sigint", SLOW_S, (INT, 130), True, ((signal.SIGINT, TRAINING),),
                   waiting_reason="KeyboardInterrupt"),
    "sigint-inside-save": Case("sigint_in_save", SLOW_S, (INT, 130), True,
                               waiting_reason="KeyboardInterrupt"),
    "sigint-twice": Case("sigint", STUCK_S, (INT, 130), False,
                         ((signal.SIGINT, TRAINING), (signal.SIGINT, CLOSING)),
                         waiting_reason="KeyboardInterrupt"),
    # SIGTERM (what schedulers send) in the with block: the saves in flight finish within
    # exit_timeout_s, then the process ends by SIGTERM as the signal asked.
    "sigterm": Case("sigterm", SLOW_S, (TERM,), True, ((signal.SIGTERM, TRAINING),),
                    waiting_reason="SystemExit"),
    "sigterm-timeout": Case("sigterm", STUCK_S, (TERM,), False, ((signal.SIGTERM, TRAINING),),
                            orders={"exit_timeout": 0.5}, waiting_reason="SystemExit"),
    "sigterm-twice": Case("sigterm", STUCK_S, (TERM,), False,
                          ((signal.SIGTERM, TRAINING), (signal.SIGTERM, CLOSING)),
                          waiting_reason="SystemExit"),
    "sigterm-inside-save": Case("sigterm_in_save", SLOW_S, (TERM,), True,
                                waiting_reason="SystemExit"),
    "sigterm-inside-save-with-handler": Case("sigterm_in_save", SLOW_S,
                                             (128 + signal.SIGTERM,), True,
                                             orders={"sigterm_handler": True},
                                             waiting_reason="SystemExit"),
    "sigterm-flag-saves-on-preemption": Case("sigterm_flag", SLOW_S, (TERM,), True,
                                             ((signal.SIGTERM, TRAINING),),
                                             orders={"sigterm": "flag"},
                                             waiting_reason="SIGTERM",
                                             in_flight=(IN_FLIGHT, IN_FLIGHT + 1)),
    "sigterm-off": Case("sigterm", STUCK_S, (TERM,), False, ((signal.SIGTERM, TRAINING),),
                        orders={"sigterm": "off"}),
    "sigkill": Case("sigterm", STUCK_S, (-signal.SIGKILL,), False,
                    ((signal.SIGKILL, TRAINING),)),
    "sigterm-with-handler": Case("sigterm", SLOW_S, (128 + signal.SIGTERM,), True,
                                 ((signal.SIGTERM, TRAINING),),
                                 orders={"sigterm_handler": True}, waiting_reason="SystemExit"),
}


@dataclass
class Ended:
    """What the test saw of one child, from start to exit."""

    proc: _Child
    code: int | None = None
    writing_at: float | None = None
    """Wall-clock time the in-flight shard's slow fsync began (the child says)."""
    last_signal_at: float | None = None
    ended_at: float | None = None
    error: str | None = None


def _drive(spec: Case | None, proc: _Child) -> Ended:
    """Send the case's signals at their moments; wait for the exit. Runs in a thread."""
    seen = Ended(proc)
    try:
        if spec is not None and spec.case not in ("sigint_in_save", "sigterm_in_save"):
            seen.writing_at = float(proc.wait_for("WRITING")[2])
        for signum, when in () if spec is None else spec.signals:
            if when.startswith("ckpt."):
                proc.wait_for_log(when)
            else:
                proc.wait_for(when)
            proc.process.send_signal(signum)
            seen.last_signal_at = time.time()
        seen.code = proc.exit_code()
        seen.ended_at = time.time()
    except _ChildFailed as exc:
        seen.error = str(exc)
        proc.process.kill()
        proc.process.wait()
    return seen


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ended]:
    """Every case at once, one child each (they overlap: a start costs ~2 s of CPU)."""
    base = tmp_path_factory.mktemp("shutdown")
    specs: dict[str, Case | None] = {**CASES, "async": None}
    procs = {}
    for name, spec in specs.items():
        orders = ({"case": "async", "fsync_delay": SLOW_S} if spec is None else
                  {"case": spec.case, "fsync_delay": spec.fsync_delay, **spec.orders})
        procs[name] = _Child(name, base, {**orders, "root": str(base / name)})
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        futures = {name: pool.submit(_drive, specs[name], proc) for name, proc in procs.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_process_ending_with_a_save_in_flight(name: str, ended: dict[str, Ended]) -> None:
    spec, seen = CASES[name], ended[name]
    proc, root = seen.proc, seen.proc.root
    where = f"case {name} (child log: {proc.err_path})"
    assert seen.error is None, f"{where}: {seen.error}\n{proc.output()}"
    assert seen.code in spec.exit_codes, f"{where}: exit code {seen.code}:\n{proc.output()}"
    assert seen.ended_at is not None
    if spec.case == "raise":  # the user's exception, unchanged, is what ended the child
        assert proc.err_path.read_text().rstrip().endswith(
            "RuntimeError: boom in the training loop"), proc.output()

    if spec.waiting_reason is not None:
        waiting = proc.log("ckpt.close.waiting")
        assert [w["steps"] for w in waiting] == [list(spec.in_flight)], f"{where}: {waiting}"
        assert spec.waiting_reason in waiting[0]["reason"], f"{where}: {waiting}"
    leftovers = _check_leftovers(root, where)
    if spec.finishes:
        assert leftovers == [], f"{where}: a finished close left {leftovers}"
        assert [d["committed"] for d in proc.log("ckpt.close.done")] == [
            list(spec.in_flight)], where
        if spec.case == "normal":
            assert proc.wait_for("CLOSED")[2] == f"SaveHandle(step={IN_FLIGHT},", where
        expected = spec.in_flight[-1]
    else:
        # Abandoned or killed in its fsync: the previous step, or (had the fsync finished
        # first) the in-flight one, complete. The fsync sleeps STUCK_S: when the child
        # ended well within that after the fsync began, the in-flight step cannot be
        # committed, and its temporary shard must be there for the scrub.
        assert seen.writing_at is not None
        certain = seen.ended_at - seen.writing_at < STUCK_S - 1.0
        expected = ACKED if certain or leftovers else IN_FLIGHT
        if certain:
            assert any(TEMP_FILE.search(item) for item in leftovers), (
                f"{where}: killed in its fsync, but no temporary shard: {_layout(root)}")
        if spec.waiting_reason is not None:  # the wait was abandoned, and said so
            abandoned = proc.log("ckpt.close.abandoned")
            assert [a["steps"] for a in abandoned] == [[IN_FLIGHT]], f"{where}: {abandoned}"
            assert abandoned[0]["latest_committed"] == ACKED, where
    if spec.signals and spec.signals[-1][1] == CLOSING:  # a Ctrl-C stopped the wait at once
        assert seen.last_signal_at is not None
        took = proc.log("ckpt.close.abandoned")[0]["unix"] - seen.last_signal_at
        assert took < PROMPT_S, f"{where}: the second Ctrl-C took {took:.2f} s to stop it"
        assert seen.writing_at is not None and seen.ended_at - seen.writing_at < STUCK_S - 1
    if spec.case == "exit" and not spec.finishes:
        assert seen.writing_at is not None
        assert seen.ended_at - seen.writing_at < STUCK_S - 1.0, (
            f"{where}: exit_timeout_s not honoured")

    events = _restore_and_check(root, expected, where)
    scrubbed = [e for e in events if isinstance(e, cp.TemporariesScrubbed)]
    assert len(scrubbed) == len(leftovers), where
    waited = [d["seconds"] for d in proc.log("ckpt.close.done")]
    ended_after = "" if seen.last_signal_at is None else (
        f"; ended {seen.ended_at - seen.last_signal_at:.2f} s after the last signal")
    print(f"{name}: exit code {seen.code}; close() waited {waited} s; restored step "
          f"{expected}; files scrubbed at the next open: {len(scrubbed)}{ended_after}")


@pytest.mark.slow
def test_async_pipeline_cancelled_with_a_save_in_flight(ended: dict[str, Ended]) -> None:
    """Cancellation abandons the pending saves: aclose() returns once the I/O call in
    progress returns, removes the abandoned save's files itself, and fails its handle;
    waiting for them in a shielded ``finally`` is how to finish them instead."""
    seen = ended["async"]
    proc, root = seen.proc, seen.proc.root
    assert seen.error is None and seen.code == 0, f"{seen.error}\n{proc.output()}"
    results = json.loads(" ".join(proc.wait_for("RESULT")[1:]))
    assert sorted(results) == sorted(child.ASYNC_KINDS)
    for kind, result in results.items():
        where = f"async {kind} (child log: {proc.err_path})"
        finished = kind == "shielded"
        assert result["handles"] == {
            str(ACKED): "committed",
            str(IN_FLIGHT): "committed" if finished else "PipelineClosedError"}, where
        # Bounded: the fsync in progress (SLOW_S) at most, never the whole save again.
        assert result["seconds_to_exit"] < SLOW_S + PROMPT_S, where
        # aclose() itself removed what the abandoned save had written.
        assert _committed_only(root / kind) == [], f"{where}: {result['files']}"
        dirs = sorted({name.split("/")[0] for name in result["files"]})
        assert dirs == [f"step-{ACKED:010d}"] + ([f"step-{IN_FLIGHT:010d}"] if finished
                                                 else []), where
        _restore_and_check(root / kind, IN_FLIGHT if finished else ACKED, where)
    assert results["asyncio"]["raised"] == "CancelledError"
    assert results["early"]["seconds_to_exit"] < PROMPT_S
    cancelled = proc.log("ckpt.close.cancelled")
    assert [c["steps"] for c in cancelled] == [[IN_FLIGHT]] * 3, cancelled


# ---------------------------------------------------------------- in-process checks


class _RecordingStorage(cp.LocalStorage):
    """Records the order of the durability calls of every file."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []
        self._names: dict[int, str] = {}
        self._lock = threading.Lock()

    def _record(self, what: str, name: str) -> None:
        with self._lock:
            self.calls.append((what, name))

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        fd, name = super().create_temp(rel_dir, final_name)
        self._names[fd] = f"{rel_dir}/{final_name}"
        return fd, name

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        self._record("fsync", self._names.get(fd, "?"))

    def publish(self, rel_dir: str, temp_name: str, final_name: str) -> None:
        super().publish(rel_dir, temp_name, final_name)
        self._record("publish", f"{rel_dir}/{final_name}")

    def fsync_dir(self, rel: str) -> None:
        super().fsync_dir(rel)
        self._record("fsync_dir", rel)


def test_commit_record_is_published_only_after_the_data_are_durable(root: Path) -> None:
    """The invariant every interrupted case relies on, call by call."""
    storage = _RecordingStorage(root)
    with cp.CheckpointPipeline(root, storage=storage) as pipe:
        for step in (1, 2):
            pipe.save(step, {"x": torch.full((300_000,), float(step))}).result(30)
    for step in (1, 2):
        d = f"step-{step:010d}"
        calls = storage.calls
        commit_at = calls.index(("publish", f"{d}/rank-00000.commit"))
        before = calls[:commit_at]
        shard_synced = before.index(("fsync", f"{d}/rank-00000.shard"))
        shard_published = before.index(("publish", f"{d}/rank-00000.shard"))
        manifest_published = before.index(("publish", f"{d}/rank-00000.manifest"))
        assert shard_synced < shard_published < manifest_published
        assert ("fsync", f"{d}/rank-00000.manifest") in before
        assert ("fsync", f"{d}/rank-00000.commit") in before  # the record's own data
        # the directory entries of shard and manifest are durable before the record exists
        assert any(c == ("fsync_dir", d) for c in before[manifest_published:]), before
        assert calls[commit_at + 1] == ("fsync_dir", d)


def _failing_close(pipe: cp.AsyncCheckpointPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the close itself fail, after the saves in flight were finished."""
    real = pipe.runner._clean_up_abandoned

    async def failing(why: str) -> None:
        await real(why)
        raise cp.StorageError("injected close failure")

    monkeypatch.setattr(pipe.runner, "_clean_up_abandoned", failing)


def test_close_error_does_not_mask_the_exception_of_the_with_block(
    root: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipe = cp.CheckpointPipeline(root)
    with capture_logs() as logs, pytest.raises(ValueError, match="mine"), \
            pipe:
        _failing_close(pipe._pipe, monkeypatch)
        raise ValueError("mine")
    assert [entry["event"] for entry in logs if entry["log_level"] == "error"] == [
        "ckpt.close.failed"]
    other = cp.CheckpointPipeline(root / "other")
    with pytest.raises(cp.StorageError, match="injected close failure"), other:
        _failing_close(other._pipe, monkeypatch)


@pytest.mark.asyncio
async def test_async_close_error_does_not_mask_the_exception_of_the_block(
    root: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipe = cp.AsyncCheckpointPipeline(root)
    with pytest.raises(ValueError, match="mine"):
        async with pipe:
            _failing_close(pipe, monkeypatch)
            handle = await pipe.save(1, {"x": torch.ones(10)})
            raise ValueError("mine")
    assert handle.result(0).step == 1  # the save still finished


def test_close_timeout_abandons_the_save_and_leaves_nothing(root: Path) -> None:
    storage = GatedStorage(root)  # holds the shard write until the gate opens
    pipe = cp.CheckpointPipeline(root, storage=storage)
    with pipe:
        storage.gate.set()
        pipe.save(1, {"x": torch.ones(10)}).result(30)
        storage.gate.clear()
        storage.entered.clear()
        handle = pipe.save(2, {"x": torch.ones(10) * 2})
        assert storage.entered.wait(30)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"steps \[2\] were abandoned"):
            pipe.close(timeout=0.2)
        assert time.monotonic() - started < 5
    storage.gate.set()  # the I/O call in progress returns; the loop then abandons the save
    with pytest.raises(cp.PipelineClosedError, match="abandoned"):
        handle.result(30)
    assert pipe._loop.thread is not None
    pipe._loop.thread.join(30)
    assert _committed_only(root) == [] and list(_layout(root)) == [f"step-{1:010d}"]


def test_atexit_hook_lives_from_open_to_close(root: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[Any] = []
    unregistered: list[Any] = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", unregistered.append)
    pipe = cp.CheckpointPipeline(root)
    pipe.open()
    assert len(registered) == 1 and unregistered == []
    pipe.close()
    assert unregistered == registered
    registered[0]()  # run at exit after all: a closed pipeline is left alone
    with pytest.raises(cp.ConfigError):
        cp.CheckpointPipeline(root, exit_timeout_s=0)


def test_cancelled_while_a_file_is_created_leaves_no_temporary(root: Path) -> None:
    """The cancellation lands while ``create_temp`` runs in its worker thread: the file
    appears after the cancellation; aclose() still removes it and fails the handle."""
    storage = GatedStorage(root)
    outcome: dict[str, Any] = {}
    events: list[cp.Event] = []

    async def main() -> None:
        with anyio.CancelScope() as scope:
            async with cp.AsyncCheckpointPipeline(root, storage=storage) as pipe:
                pipe.subscribe(events.append)
                storage.gate.set()
                first = await pipe.save(1, {"x": torch.ones(10)})
                await pipe.wait(30)
                storage.gate.clear()
                storage.entered.clear()
                outcome["handle"] = await pipe.save(2, {"x": torch.ones(10)})
                await anyio.to_thread.run_sync(storage.entered.wait, 30)
                scope.cancel()
                threading.Timer(0.3, storage.gate.set).start()  # the call in progress returns
                await anyio.sleep(30)
        outcome["first"] = first

    started = time.monotonic()
    anyio.run(main)
    assert time.monotonic() - started < 10
    failed = [e for e in events if isinstance(e, cp.SaveFailed)]
    assert [(e.step, e.stage) for e in failed] == [(2, "close")], failed
    assert outcome["first"].result(0).step == 1
    with pytest.raises(cp.PipelineClosedError):
        outcome["handle"].result(0)
    assert _committed_only(root) == [] and list(_layout(root)) == [f"step-{1:010d}"]
