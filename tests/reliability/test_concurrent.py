"""Several processes on one shared root at once: writer ranks pruning, readers scanning.

The writers are the ranks of a real gloo world (``tests/children/concurrent_child.py writer``):
their commit votes and confirmations go between the processes, and each prunes its own files of the
shared step directories with ``keep_last=1`` (or 2) while the other rank prunes, saves or
scrubs. The readers (``concurrent_child.py reader``) scan the same root all along, with the
recovery functions and with ``ckpt-pipeline ls --json`` / ``verify --json``, and check at every
observation that a complete set survives (the exact rules: ``Reader.observe``'s docstring).
Real processes, real files, fsync: nothing is faked. A writer that must stop in the middle of
pruning does so in a storage that waits for a file, after the real unlink.

The last two tests replay, in one process and made certain, the race the readers meet now and
then: a step pruned between the scan's read of its commit record and of its manifest.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

import ckpt_pipeline as cp
from ckpt_pipeline import cli
from ckpt_pipeline.cli import main as cli_main
from ckpt_pipeline.testing import CRASH_ENV
from tests._support.children import child_script, load_script, spawn_child

CHILD = child_script("concurrent_child.py")
DEADLINE_S = 100.0
WORLD = 2
TEMP_FILE = re.compile(r"^\.rank-[0-9]{5,}\.(shard|manifest|commit)\.tmp-")


child = load_script(CHILD)


class Processes:
    """The children of one test, each with its log; killed if the test ends first."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "ckpt"
        self.ctl = tmp_path / "ctl"
        self.ctl.mkdir()
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started = time.monotonic()

    def start(self, role: str, name: str, *args: str,
              env: dict[str, str] | None = None) -> None:
        self.procs[name] = spawn_child(
            CHILD, role, "--root", self.root, "--ctl", self.ctl, "--name", name,
            "--world", WORLD, *args, env=env, stdout=self.logs / f"{name}.log",
            stderr=subprocess.STDOUT)

    def writer(self, name: str, rank: int, init: str, first: int, last: int,
               *args: str, env: dict[str, str] | None = None) -> None:
        self.start("writer", name, "--rank", str(rank), "--init", str(self.ctl / init),
                   "--first", str(first), "--last", str(last), *args, env=env)

    def wait_files(self, *names: str) -> None:
        while not all((self.ctl / n).exists() for n in names):
            self._check_time(f"waiting for {names}")
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if any(code not in (0, -signal.SIGKILL) for code in dead.values()):
                pytest.fail(f"a child failed while waiting for {names}: {dead}\n{self.tails()}")
            time.sleep(0.01)

    def wait(self, name: str) -> int:
        proc = self.procs[name]
        while proc.poll() is None:
            self._check_time(f"waiting for {name} to exit")
            time.sleep(0.01)
        return proc.returncode

    def out(self, name: str) -> dict[str, Any]:
        path = self.ctl / f"out-{name}.json"
        assert path.exists(), f"{name} wrote no output\n{self.tails()}"
        data: dict[str, Any] = json.loads(path.read_text())
        assert "error" not in data, f"{name} failed:\n{data['error']}\n{self.tails()}"
        return data

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(self.logs.iterdir()))

    def _check_time(self, what: str) -> None:
        if time.monotonic() - self.started > DEADLINE_S:
            pytest.fail(f"deadline passed {what}\n{self.tails()}")

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _readers_ok(procs: Processes, names: Sequence[str]) -> list[dict[str, Any]]:
    """Every reader ran, breached no rule, and saw commits and pruning happen under it."""
    stats = []
    for name in names:
        assert procs.wait(name) == 0, procs.tails()
        out = procs.out(name)
        assert out["violations"] == [], (name, json.dumps(out["violations"][:5], indent=1))
        s = out["stats"]
        # It observed the root all along the saves: many steps seen as the newest complete
        # set, observations with no confirmation during them (rule 1 applied) and some with.
        assert len(s["steps_found"]) >= 10 and s["stable"] >= 10, (name, s)
        assert s["progress_during"] >= 3 and s["tools_rounds"] >= 10, (name, s)
        # A prune takes the commit record first, so the tools never blame it on corruption.
        assert s["ls_corrupt_raced_prune"] == s["verify_failed_raced_prune"] == 0, (name, s)
        stats.append(s)
    print(json.dumps({"readers": stats}))
    return stats


def _final_disk_ok(root: Path, newest: int, keep_last: int) -> None:
    """No temporaries; each rank keeps exactly its last ``keep_last`` steps, all verifying."""
    assert not [p for p in root.rglob(".*") if TEMP_FILE.match(p.name)]
    for rank in range(WORLD):
        out = io.StringIO()
        with redirect_stdout(out):
            code = cli_main(["verify", str(root), "--all", "--rank", str(rank), "--json"])
        results = json.loads(out.getvalue())["results"]
        assert code == 0, results
        assert [(r["step"], r["result"]) for r in results] == [
            (newest - k, "ok") for k in range(keep_last)], (rank, results)


def _final_restore_ok(out: dict[str, Any], newest: int) -> None:
    final = out["final"]
    assert final is not None and final["step"] == newest, final
    assert final["mismatches"] == [] and final["train_state_ok"], final


@pytest.mark.slow
def test_two_ranks_prune_with_keep_last_1_while_readers_scan(tmp_path: Path) -> None:
    """Two writer ranks save 60 steps with keep_last=1 while two readers scan and verify."""
    last = 60
    procs = Processes(tmp_path)
    try:
        for name in ("reader-a", "reader-b"):
            procs.start("reader", name)
        for rank in range(WORLD):
            procs.writer(f"writer-{rank}", rank, "init-1", 1, last, "--keep-last", "1",
                         "--final-restore")
        procs.wait_files(*(f"ready-{n}" for n in procs.procs))
        (procs.ctl / "go").touch()
        writers = []
        for rank in range(WORLD):
            assert procs.wait(f"writer-{rank}") == 0, procs.tails()
            writers.append(procs.out(f"writer-{rank}"))
        (procs.ctl / "stop").touch()
        _readers_ok(procs, ["reader-a", "reader-b"])
    finally:
        procs.kill_all()
    for out in writers:
        assert out["acked"] == list(range(1, last + 1))
        _final_restore_ok(out, last)
    _final_disk_ok(procs.root, last, keep_last=1)


@pytest.mark.slow
def test_a_restarted_rank_scrubs_while_the_other_rank_is_in_the_middle_of_pruning(
        tmp_path: Path) -> None:
    """A job restarts after rank 1 died pruning, while the old rank 0 is still pruning.

    First job (``a-0``, ``a-1``): steps 1..20, keep_last=1. Rank 1 is SIGKILLed at its 19th
    ``retain.commit_removed``: in the retain stage of step 20, its commit record of step 19
    gone, its manifest and shard not. Rank 0 removed its own commit record of step 19 too and
    stays there (alive, mid-prune). The restarted job (``b-0``, ``b-1``) starts meanwhile:
    ``b-1``'s start-up scrub removes rank 1's leftovers of step 19 while the old rank 0 is
    mid-prune; ``b-0`` is refused by the root's lock (the old rank 0 still holds it) and
    retries, as a requeued job waiting for its old copy. Only then is the old rank 0 released:
    it finishes its prune and exits, ``b-0`` opens, and the new job restores step 20 and saves
    21..40 with keep_last=2. Two readers scan throughout, the gap between the jobs included.

    Why the old rank 0 is still alive: a rank prunes only after a commit confirmation that
    every rank took part in, and a rank's start-up scrub runs before its first vote, so within
    one job a scrub never overlaps another rank's pruning. It does when a process of the
    previous job is still finishing its retain stage as the new job starts, which is what this
    builds (rank 0 is held there by ``OrderedStorage``, after the real unlink). The lock keeps
    the new rank 0 from scrubbing under the old rank 0's feet.
    """
    first_job, last = 20, 40
    procs = Processes(tmp_path)
    try:
        for name in ("reader-a", "reader-b"):
            procs.start("reader", name)
        procs.writer("a-0", 0, "init-a", 1, first_job, "--keep-last", "1", "--hold-prune",
                     str(first_job - 1), "--release", "refused-b-0,scrubbed-b-1")
        procs.writer("a-1", 1, "init-a", 1, first_job, "--keep-last", "1",
                     env={CRASH_ENV: f"retain.commit_removed:{first_job - 1}"})
        for rank in range(WORLD):
            procs.writer(f"b-{rank}", rank, "init-b", first_job + 1, last, "--keep-last", "2",
                         "--go", "go-b", "--opened", "--restore-first", "--final-restore",
                         "--retry-locked")
        procs.wait_files(*(f"ready-{n}" for n in procs.procs))
        (procs.ctl / "go").touch()
        procs.wait_files("held-a-0")
        assert procs.wait("a-1") == -signal.SIGKILL, procs.tails()
        step19 = procs.root / f"step-{first_job - 1:010d}"
        assert sorted(os.listdir(step19)) == [
            "rank-00000.manifest", "rank-00000.shard", "rank-00001.manifest",
            "rank-00001.shard"], "both ranks stopped after removing their commit record"
        (procs.ctl / "go-b").touch()
        for name in ("a-0", "b-0", "b-1"):
            assert procs.wait(name) == 0, procs.tails()
        old0, new0, new1 = (procs.out(n) for n in ("a-0", "b-0", "b-1"))
        (procs.ctl / "stop").touch()
        _readers_ok(procs, ["reader-a", "reader-b"])
    finally:
        procs.kill_all()
    acked_1 = [int(x) for x in (procs.ctl / "ack-1").read_text().split()]
    assert old0["acked"] == list(range(1, first_job + 1))
    assert acked_1[:first_job - 1] == list(range(1, first_job))
    hold = old0["holds"]
    assert len(hold) == 1 and hold[0]["released"], hold
    # The new rank 0 was refused while the old one lived (the refusal names its holder); the
    # old one then finished its own prune, so the new rank 0 found nothing to scrub. The new
    # rank 1 scrubbed its rank's leftovers of step 19 while the old rank 0 held.
    assert new0["refused"] and all("lock is held by pid" in r for r in new0["refused"])
    assert new1["refused"] == []
    assert new0["scrubbed"] == []
    assert sorted(new1["scrubbed"]) == [
        f"{step19.name}/rank-00001.manifest", f"{step19.name}/rank-00001.shard"]
    for out in (new0, new1):
        restored = out["restored"]
        assert restored["step"] == first_job and restored["mismatches"] == [], restored
        assert restored["train_state_ok"]
        assert out["acked"] == list(range(first_job + 1, last + 1))
        _final_restore_ok(out, last)
    assert not step19.exists()
    _final_disk_ok(procs.root, last, keep_last=2)


@pytest.mark.slow
def test_no_rank_saves_before_every_rank_has_scrubbed(tmp_path: Path) -> None:
    """Regression (found by this suite): a rank's start-up scrub of a shared root removed the
    empty step directory another rank had just created for its first save, failing that save
    on every rank. open() now agrees on the run id only after the scrub, which makes the
    agreement a barrier: no rank saves before every rank has scrubbed.

    Rank 1's scrub waits for ``step-0000000001`` to appear, up to 3 s; rank 0 saves step 1
    right after open(). The directory can only appear once rank 1's scrub has ended, so that
    wait must time out, and both saves must commit.
    """
    procs = Processes(tmp_path)
    env = {"CKPT_TEST_HOLD_MAX_S": "3"}
    try:
        procs.writer("w-0", 0, "init", 1, 2, "--pause-ms", "0", "--tolerate-failures",
                     "--hold-create-temp", "1", "--release", "opened-w-1", env=env)
        procs.writer("w-1", 1, "init", 1, 2, "--pause-ms", "0", "--tolerate-failures",
                     "--opened", "--scrub-after-dir", "1", env=env)
        procs.wait_files("ready-w-0", "ready-w-1")
        (procs.ctl / "go").touch()
        for name in ("w-0", "w-1"):
            if procs.wait(name) != 0:
                raise RuntimeError(procs.tails())
        outs = [procs.out("w-0"), procs.out("w-1")]
    finally:
        procs.kill_all()
    assert [[h["what"] for h in out["holds"]] for out in outs] == [["create_temp"], ["scrub"]]
    scrub_hold = outs[1]["holds"][0]
    assert not scrub_hold["released"], f"a step directory appeared during a scrub: {outs}"
    assert [out["failed"] for out in outs] == [[], []]
    assert [out["acked"] for out in outs] == [[1, 2], [1, 2]]


# ---------------------------------------------------------------- the tools racing a prune


class PrunedWhileScanned(cp.LocalStorage):
    """Prunes rank 0's step 1 the way retention does (commit record first) at one moment.

    Right before a scan opens that step's manifest, i.e. after it read the commit record: the
    interleaving the readers above meet now and then, made certain.
    """

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fired = False

    def open_read(self, rel: str, expected_size: int | None = None) -> tuple[int, int]:
        if rel == os.path.join("step-0000000001", "rank-00000.manifest") and not self.fired:
            self.fired = True
            for name in ("rank-00000.commit", "rank-00000.manifest", "rank-00000.shard"):
                os.unlink(self.root / "step-0000000001" / name)
        return super().open_read(rel, expected_size)


def _two_steps(root: Path) -> None:
    with cp.CheckpointPipeline(root, keep_last=2) as pipe:
        for step in (1, 2):
            pipe.save(step, child.expected(step, 0), child.train_state(step)).result(30)


def _run_cli(monkeypatch: pytest.MonkeyPatch, root: Path, *argv: str) -> tuple[int, Any]:
    storage = PrunedWhileScanned(root)
    monkeypatch.setattr(cli, "_open_root", lambda _root: storage)
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli_main([*argv, str(root), "--json"])
    assert storage.fired
    return code, json.loads(out.getvalue())


def test_ls_does_not_call_a_step_pruned_while_it_is_listed_corrupt(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _two_steps(root)
    code, report = _run_cli(monkeypatch, root, "ls")
    rows = {r["step"]: (r["status"], r["reason"]) for r in report["steps"]}
    assert code == 0
    assert rows[2] == ("complete", None)
    assert rows[1][0] == "incomplete" and "pruned by a running job" in rows[1][1], rows


def test_verify_all_skips_a_step_pruned_while_it_is_scanned(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _two_steps(root)
    code, report = _run_cli(monkeypatch, root, "verify", "--all")
    results = {r["step"]: (r["result"], r["reason"]) for r in report["results"]}
    assert code == 0, results
    assert results[2] == ("ok", None)
    assert results[1][0] == "skipped" and "pruned by a running job" in results[1][1], results
