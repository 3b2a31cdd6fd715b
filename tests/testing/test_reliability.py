"""Faults at every I/O call of a save, short writes, the failure policy, labelled crash points."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline import _crash
from ckpt_pipeline._crash import parse_crash_at
from ckpt_pipeline.cli import main as cli_main
from ckpt_pipeline.testing import CRASH_ENV, CRASH_POINTS, Fault, FaultyStorage
from tests._support.children import child_script, load_script, spawn_child

CHILD = child_script("crash_point_child.py")


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 1024), float(step)), "b": torch.arange(100) * step}


def _temporaries(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(".*tmp-*")]


def _restore(root: Path) -> tuple[int | None, dict[str, torch.Tensor]]:
    live = {"w": torch.zeros(64, 1024), "b": torch.zeros(100, dtype=torch.int64)}
    with cp.CheckpointPipeline(root, restore_rng=False) as pipe:
        result = pipe.restore_latest(live)
    return (None if result is None else result.step), live


def _calls_of_one_save(root: Path) -> dict[str, int]:
    storage = FaultyStorage(root / "probe")
    with cp.CheckpointPipeline(storage.root, storage=storage, keep_last=1,
                               chunk_bytes=64 * 1024) as pipe:
        pipe.save(1, _state(1)).result(30)
        storage.arm()
        pipe.save(2, _state(2)).result(30)
        pipe.wait(30)
        return storage.calls()


# Both codes are slow (2-3 s each, a save per I/O call): the fast suite keeps the single-fault
# tests of FaultyStorage; CI runs -m slow.
@pytest.mark.slow
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_fault_at_every_io_call_of_a_save_loses_nothing(tmp_path: Path, code: int) -> None:
    calls = _calls_of_one_save(tmp_path)
    assert calls["pwrite"] >= 4 and calls["fsync"] >= 3
    root = tmp_path / "ckpt"
    storage = FaultyStorage(root)
    step = 0
    with cp.CheckpointPipeline(root, storage=storage, keep_last=1, chunk_bytes=64 * 1024,
                               max_failures_in_row=10_000) as pipe:
        step += 1
        pipe.save(step, _state(step)).result(30)
        committed = step
        for call, count in sorted(calls.items()):
            for at in range(1, count + 1):
                step += 1
                storage.arm(Fault(call, at, code))
                handle = pipe.save(step, _state(step))
                pipe.wait_snapshot()
                failed = handle.exception(30) is not None
                with contextlib.suppress(cp.CheckpointError):
                    pipe.wait(30)
                storage.disarm()
                where = f"{call} #{at}"
                assert not _temporaries(root), where
                if failed:
                    assert not (root / f"step-{step:010d}").exists(), where
                else:
                    committed = step
                names = sorted(os.listdir(root))
                assert f"step-{committed:010d}" in names, (where, names)
    restored, live = _restore(root)
    assert restored == committed
    assert torch.equal(live["w"], _state(committed)["w"])


def test_a_short_write_fails_the_save_cleanly(root: Path) -> None:
    storage = FaultyStorage(root)
    with cp.CheckpointPipeline(root, storage=storage, chunk_bytes=64 * 1024) as pipe:
        pipe.save(1, _state(1)).result(30)
        storage.arm(Fault("pwrite", 2, errno.EIO, short_write=True))
        with pytest.raises(cp.StorageError, match="injected EIO"):
            pipe.save(2, _state(2)).result(30)
    assert not _temporaries(root)
    assert _restore(root)[0] == 1


def test_after_three_failures_in_a_row_the_next_save_raises(root: Path) -> None:
    storage = FaultyStorage(root)
    with cp.CheckpointPipeline(root, storage=storage) as pipe:
        pipe.save(1, _state(1)).result(30)
        for step in (2, 3, 4):
            storage.arm(Fault("fsync", 1, errno.EIO))
            handle = pipe.save(step, _state(step))  # training goes on after each failure
            assert handle.exception(30) is not None
        storage.disarm()
        with pytest.raises(cp.SaveError, match="3 saves in a row failed"):
            pipe.save(5, _state(5))
        pipe.save(6, _state(6)).result(30)  # the next one tries again, and works
    assert _restore(root)[0] == 6


def test_strict_mode_raises_at_the_next_save_after_any_failure(root: Path) -> None:
    storage = FaultyStorage(root)
    with cp.CheckpointPipeline(root, storage=storage, strict=True) as pipe:
        storage.arm(Fault("fsync", 1, errno.EIO))
        handle = pipe.save(1, _state(1))
        assert handle.exception(30) is not None
        storage.disarm()
        with pytest.raises(cp.SaveError, match="a previous save failed"):
            pipe.save(2, _state(2))
        pipe.save(3, _state(3)).result(30)


# ------------------------------------------------------------------ labelled crash points
#
# The crash matrix: every label of CRASH_POINTS, killed at its 1st, 2nd and 3rd hit in a child
# process (CKPT_PIPELINE_CRASH_AT=LABEL:N), the three children of a label running at once.


child = load_script(CHILD)
HITS = (1, 2, 3)
"""Each label is killed at these hits, each in a child of its own."""
CHILD_SAVES = len(HITS) + 1
"""Saves each child attempts: one more than the last hit, so a point that never fires shows."""
OWN_TEMP = re.compile(r"^\.rank-00000\.(shard|manifest|commit)\.tmp-")
LATE_LABELS = ("commit.record_published", "retain.commit_removed")
"""Labels reached once the save's commit record is durable: that step survives the kill."""


def test_the_crash_variable_takes_a_label_or_a_label_and_a_count() -> None:
    assert parse_crash_at("seal.done") == ("seal.done", 1)
    assert parse_crash_at("seal.done:1") == ("seal.done", 1)
    assert parse_crash_at("scrub.removed:12") == ("scrub.removed", 12)
    for bad in ("seal.don", "seal.done:0", "seal.done:-1", "seal.done:x", "seal.done:",
                ":3", "seal.done:2:3", "seal.done:1.5"):
        with pytest.raises(ValueError, match=CRASH_ENV) as info:
            parse_crash_at(bad)
        assert "'<label>:<N>'" in str(info.value) and "seal.done" in str(info.value), bad


def test_an_old_crash_label_still_arms_its_renamed_point_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="'write.done' was renamed 'seal.done'"):
        assert parse_crash_at("write.done:2") == ("seal.done", 2)
    with pytest.warns(DeprecationWarning, match="'write_data.done'"):
        assert parse_crash_at("serialize.data_written") == ("write_data.done", 1)


def test_a_crash_point_fires_at_the_nth_hit_of_its_label_counted_across_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kills: list[int] = []
    hits = {"n": 0}
    lock = threading.Lock()

    def count_hits() -> None:
        for _ in range(100):
            _crash.crash_point("seal.done")
            with lock:
                hits["n"] += 1

    monkeypatch.setattr(_crash, "_kill", lambda: kills.append(hits["n"]))
    _crash._reset_counts()
    try:
        monkeypatch.delenv(CRASH_ENV, raising=False)
        _crash.crash_point("seal.done")  # not armed: not counted
        monkeypatch.setenv(CRASH_ENV, "seal.done:300")
        for _ in range(5):
            _crash.crash_point("commit.voted")  # another label: not counted
        threads = [threading.Thread(target=count_hits) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(kills) == 1, kills  # exactly one of the 800 hits, in 8 threads, fired
        monkeypatch.setenv(CRASH_ENV, "commit.voted")  # a plain label: its first hit
        _crash.crash_point("seal.done")
        assert len(kills) == 1
        _crash.crash_point("commit.voted")
        assert len(kills) == 2
        monkeypatch.setenv(CRASH_ENV, "commit.vote:2")  # a typo raises, at any crash point
        with pytest.raises(ValueError, match=rf"{CRASH_ENV}='commit.vote:2' is not valid"):
            _crash.crash_point("save.requested")
        with pytest.raises(ValueError, match="'<label>' or '<label>:<N>'"):
            _crash.crash_point("commit.voted")
    finally:
        _crash._reset_counts()


def _spawn(root: Path, armed: str, *args: str) -> subprocess.Popen[str]:
    return spawn_child(CHILD, root, *args, env={CRASH_ENV: armed}, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str], what: str) -> None:
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, (
        f"{what}: the child was not killed there (exit {proc.returncode})\n{out[-3000:]}")


def _own_temporaries(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob(".*") if OWN_TEMP.match(p.name))


def _every_complete_step_verifies(root: Path, what: str) -> None:
    """``ckpt-pipeline verify --all``: every step with a commit record reads back whole."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["verify", str(root), "--all", "--json"])
    report = json.loads(out.getvalue())
    bad = [r for r in report["results"] if r["result"] not in ("ok", "skipped")]
    assert code == 0 and not bad, (what, bad)
    assert any(r["result"] == "ok" for r in report["results"]), (what, report)


def _restore_exactly(root: Path, at_least: int, what: str) -> int:
    """Open (scrub), restore, and check the step, its tensors and its TrainState exactly."""
    live = {"w": torch.zeros(64, 1024), "b": torch.zeros(100, dtype=torch.int64)}
    with cp.CheckpointPipeline(root, restore_rng=False) as pipe:
        result = pipe.restore_latest(live)
    assert result is not None, what
    step = result.step
    assert step >= at_least, (what, step, at_least)
    expected = child.state_for(step)
    assert torch.equal(live["w"], expected["w"]) and torch.equal(live["b"], expected["b"]), what
    ts, want = result.train_state, child.train_state_for(step)
    assert (ts.step, ts.consumed_train_samples, dict(ts.extra)) == (
        want.step, want.consumed_train_samples, dict(want.extra)), (what, ts)
    assert not _own_temporaries(root), (what, _own_temporaries(root))
    for step_dir in root.iterdir():  # rank 0's files only where its commit record is
        names = os.listdir(step_dir) if re.fullmatch(r"step-[0-9]+", step_dir.name) else []
        if "rank-00000.commit" not in names:
            assert not [n for n in names if n.startswith("rank-00000.")], (what, names)
    return step


def _save_first(root: Path, steps: Sequence[int]) -> None:
    with cp.CheckpointPipeline(root, keep_last=max(child.KEEP_LAST, len(steps))) as pipe:
        for step in steps:
            pipe.save(step, child.state_for(step), child.train_state_for(step)).result(30)


@pytest.mark.slow
@pytest.mark.parametrize("label", [p for p in CRASH_POINTS if p != "scrub.removed"
                                   and not p.startswith(("replicate.", "restore."))])
def test_a_crash_at_each_labelled_point_keeps_the_last_acknowledged_step(
        tmp_path: Path, label: str) -> None:
    """Killed at the 1st, 2nd and 3rd hit of the label: each a later save, on more history."""
    roots = {n: tmp_path / f"hit-{n}" for n in HITS}
    for root in roots.values():
        _save_first(root, [1])  # acknowledged before the child starts; pruned by its 1st save
    procs = {n: _spawn(root, f"{label}:{n}", "2", str(1 + CHILD_SAVES))
             for n, root in roots.items()}
    for n, proc in procs.items():
        _finish(proc, f"{label}:{n}")
    for n, root in roots.items():
        what = f"{label}:{n}"
        ack_file = Path(str(root) + ".ack")
        acked = [int(x) for x in ack_file.read_text().split()] if ack_file.exists() else []
        crashed_in = 1 + n  # the child's n-th save is step n + 1
        before = list(range(2, crashed_in))  # every save before the n-th was acknowledged
        if label == "retain.commit_removed":  # retention runs after result() returned
            assert acked in (before, [*before, crashed_in]), (what, acked)
        else:
            assert acked == before, (what, acked)
        _every_complete_step_verifies(root, what)
        restored = _restore_exactly(root, max([1, *acked]), what)
        assert restored == (crashed_in if label in LATE_LABELS else crashed_in - 1), what


LEFTOVERS = (
    "step-0000000001/.rank-00000.shard.tmp-a1a1a1a1a1a1",
    "step-0000000002/.rank-00000.manifest.tmp-b2b2b2b2b2b2",
    "step-0000000003/rank-00000.shard",
    "step-0000000003/rank-00000.manifest",
    "step-0000000003/.rank-00000.commit.tmp-c3c3c3c3c3c3",
)
"""Rank 0's temporaries and files of a step without its commit record: the scrub's work."""
FOREIGN = ("step-0000000003/rank-00001.shard", "step-0000000003/.rank-00001.shard.tmp-d4d4d4d4")
"""Another rank's: the scrub of rank 0 never touches them."""


@pytest.mark.slow
def test_a_crash_during_the_start_up_scrub_is_finished_by_the_next_start(tmp_path: Path) -> None:
    """Killed after the 1st, 2nd and 3rd of five removals; the next start removes the rest."""
    roots = {n: tmp_path / f"hit-{n}" for n in HITS}
    for root in roots.values():
        _save_first(root, [1, 2])
        (root / "step-0000000003").mkdir()
        for rel in (*LEFTOVERS, *FOREIGN):
            (root / rel).write_bytes(b"partial")
    procs = {n: _spawn(root, f"scrub.removed:{n}", "--open-only") for n, root in roots.items()}
    for n, proc in procs.items():
        _finish(proc, f"scrub.removed:{n}")
    for n, root in roots.items():
        what = f"scrub.removed:{n}"
        left = [rel for rel in LEFTOVERS if (root / rel).exists()]
        assert len(left) == len(LEFTOVERS) - n, (what, left)
        _every_complete_step_verifies(root, what)
        assert _restore_exactly(root, 2, what) == 2
        assert not [rel for rel in LEFTOVERS if (root / rel).exists()], what
        assert all((root / rel).exists() for rel in FOREIGN), what
