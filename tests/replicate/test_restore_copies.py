"""Restore with copies on other nodes, when a node comes back with another run's root and when
a replaced node comes back empty: real gloo process groups, one process per rank
(``tests/children/replica_worker.py``, through ``tests._support.replicas.launch``).

Every value a rank saves is a function of (step, rank, run): another run (``--variant 1``)
saves the same step numbers with other values, so a restore is checked bit-exact against the
run it must come from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests._support.cli import run_cli
from tests._support.replicas import assert_restored, launch, step_dir


def _copy_root(source: Path, target: Path) -> None:
    shutil.copytree(source, target, symlinks=True)
    for lock in target.rglob(".lock-*"):
        lock.unlink()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, Path, dict[int, Any], dict[int, Any]]:
    """Two runs of 4 ranks on 4 nodes (rank r's copy on rank r+1 mod 4), replicas=1, steps
    10 and 20 each: this run's roots and another run's, saved with other values."""
    base = tmp_path_factory.mktemp("two-runs")
    ours = launch("save", base / "ours", base / "logs-ours", nodes=4)
    theirs = launch("save", base / "theirs", base / "logs-theirs", nodes=4,
                    args=("--variant", "1"))
    for results in (ours, theirs):
        for rank, out in results.items():
            assert all(out["saves"][s]["ok"] for s in ("10", "20")), (rank, out["saves"])
    return base / "ours", base / "theirs", ours, theirs


def _with_foreign(runs: tuple[Path, Path, dict[int, Any], dict[int, Any]], tmp_path: Path,
                  ranks: tuple[int, ...]) -> Path:
    """This run's roots, with the roots of ``ranks`` replaced by the other run's."""
    root = tmp_path / "root"
    _copy_root(runs[0], root)
    for rank in ranks:
        shutil.rmtree(root / f"rank-{rank}")
        _copy_root(runs[1] / f"rank-{rank}", root / f"rank-{rank}")
    return root


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_root_of_another_run_is_set_aside_and_its_shard_comes_from_a_copy(
        two_runs: tuple[Path, Path, dict[int, Any], dict[int, Any]], tmp_path: Path) -> None:
    """Rank 3's node comes back with the other run's root (steps 10 and 20, other save ids):
    this run's step 20 is whole from rank 0's copy of rank 3's shard. Every rank restores
    this run's values; rank 3's files of the other save are set aside (its own shard and the
    copy of rank 2's it held), and rank 2 sends that copy again."""
    root = _with_foreign(two_runs, tmp_path, (3,))
    theirs = (step_dir(root, 3, 20) / "rank-00003.shard").read_bytes()
    results = launch("restore", root, tmp_path / "logs", nodes=4, args=("--wait-copies",))
    assert_restored(results, two_runs[2], 20, fetched={3: 0})
    save_ids = {out["restore"]["save_id"] for out in results.values()}
    assert len(save_ids) == 1
    for rank, out in results.items():
        restore = out["restore"]
        assert list(restore["foreign"]) == ["3"], (rank, restore)
        assert restore["foreign"]["3"] != list(save_ids), restore
        assert restore["resending"] == {"3": [2]}, (rank, restore)
    set_aside = [e for e in results[3]["restore_events"] if e["type"] == "ForeignFilesSetAside"]
    assert len(set_aside) == 1 and set_aside[0]["step"] == 20, set_aside
    moved = Path(set_aside[0]["path"])
    assert moved.parent == root / "rank-3" and moved.name.startswith(
        "step-0000000020.foreign-r00003-")
    assert sorted(p.name for p in moved.iterdir()) == sorted(
        [f"rank-00003.{k}" for k in ("commit", "manifest", "shard")]
        + [f"replica-00002-on-00003.{k}" for k in ("commit", "manifest", "shard")])
    assert (moved / "rank-00003.shard").read_bytes() == theirs  # kept as it was
    listed = json.loads(run_cli("ls", root / "rank-3", "--rank", 3, "--json").stdout)
    aside = [s for s in listed["steps"] if s["dir"] == moved.name]
    assert len(aside) == 1 and "of another save" in aside[0]["reason"], listed
    assert aside[0]["save_id"] == restore["foreign"]["3"][0]
    # Rank 3 holds this run's shard again, fetched from rank 0, and rank 2's copy, sent again.
    assert (step_dir(root, 3, 20) / "rank-00003.shard").read_bytes() == (
        step_dir(root, 0, 20) / "replica-00003-on-00000.shard").read_bytes()
    assert results[2]["copies_settled"], results[2]
    restored = [e for e in results[2]["restore_events"] if e["type"] == "ReplicaRestored"]
    assert [(e["step"], e["holder"]) for e in restored] == [(20, 3)], results[2]
    assert (step_dir(root, 3, 20) / "replica-00002-on-00003.shard").read_bytes() == (
        step_dir(root, 2, 20) / "rank-00002.shard").read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_save_whole_is_a_restore_error_naming_each_saves_shards(
        two_runs: tuple[Path, Path, dict[int, Any], dict[int, Any]], tmp_path: Path) -> None:
    """Ranks 2 and 3 come back with the other run's roots: this run's shards of rank 2 are on
    rank 2 and its copy on rank 3, both replaced, so no save makes step 20 (or 10) whole.
    Every rank raises RestoreError saying so, and nothing is moved or loaded."""
    root = _with_foreign(two_runs, tmp_path, (2, 3))
    results = launch("restore", root, tmp_path / "logs", nodes=4)
    for rank, out in results.items():
        restore = out["restore"]
        assert not restore["ok"], (rank, restore)
        assert restore["error"]["type"] == "RestoreError", restore
        message = restore["error"]["message"]
        assert "step 20: no save makes it whole" in message, message
        assert "holds the shards of rank(s) [0, 1, 3]" in message, message
        assert "holds the shards of rank(s) [1-3]" in message, message
        assert not [e for e in out["restore_events"] if e["type"] == "ForeignFilesSetAside"]
    for rank in (2, 3):
        assert not list((root / f"rank-{rank}").glob("*.foreign-*"))
        assert (step_dir(root, rank, 20) / f"rank-{rank:05d}.shard").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_replaced_node_gets_its_held_copies_back_and_survives_a_second_loss(
        tmp_path: Path) -> None:
    """4 ranks on 2 nodes, replicas=1 (rank 0's copy on rank 2, 1's on 3, 2's on 0, 3's on 1).
    Node1's disks are replaced (ranks 2 and 3 empty): the restore fetches their shards, and
    its result lists the copies node1 held as being sent again, in the background (rank 0's
    to rank 2, rank 1's to rank 3); each arrives later as a ReplicaRestored event. Then node0's
    rank 0 loses its root too: step 20 still restores, rank 0's shard from its copy on rank 2."""
    root = tmp_path / "root"
    saved = launch("save", root, tmp_path / "logs-save")
    assert all(out["saves"]["20"]["ok"] for out in saved.values()), saved
    shutil.rmtree(root / "rank-2")
    shutil.rmtree(root / "rank-3")
    results = launch("restore", root, tmp_path / "logs", args=("--wait-copies",))
    assert_restored(results, saved, 20, fetched={2: 0, 3: 1})
    for rank, out in results.items():
        assert out["restore"]["resending"] == {"2": [0], "3": [1]}, (rank, out["restore"])
        assert out["restore"]["foreign"] == {}
    for source, holder in ((0, 2), (1, 3)):
        out = results[source]
        assert out["copies_settled"], out
        # Listed as pending in the result (restore did not wait for it); the event came
        # afterwards, through the subscriber, while the child waited for it.
        restored = [e for e in out["restore_events"] if e["type"] == "ReplicaRestored"]
        assert [(e["step"], e["holder"]) for e in restored] == [(20, holder)], out
        stored = [e for e in results[holder]["restore_events"] if e["type"] == "ReplicaStored"]
        assert [(e["step"], e["source"]) for e in stored] == [(20, source)]
        copy = step_dir(root, holder, 20) / f"replica-{source:05d}-on-{holder:05d}"
        assert copy.with_suffix(".shard").read_bytes() == (
            step_dir(root, source, 20) / f"rank-{source:05d}.shard").read_bytes()
        assert copy.with_suffix(".commit").exists()
    assert not list(root.rglob(".*tmp-*"))
    shutil.rmtree(root / "rank-0")  # a second node's disk: only the copies sent again hold it
    again = launch("restore", root, tmp_path / "logs-again", args=("--wait-copies",))
    assert_restored(again, saved, 20, fetched={0: 2})


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_copy_still_being_sent_at_close_leaves_nothing_complete_and_is_sent_at_the_next_restore(
        tmp_path: Path) -> None:
    """The same replaced node, but its copy server takes 60 s per data frame it receives
    (longer than the holder lives: it closes right after the restore, its copy server waits
    5 s for the connections in progress), and every rank closes right after the restore: the
    close is bounded (every process exits in time), the copies cut off publish nothing on the
    holders (no copy file, let alone a commit record), and the next restore lists them as
    lacking again and sends them."""
    root = tmp_path / "root"
    saved = launch("save", root, tmp_path / "logs-save")
    assert all(out["saves"]["20"]["ok"] for out in saved.values()), saved
    shutil.rmtree(root / "rank-2")
    shutil.rmtree(root / "rank-3")
    cut = launch("restore", root, tmp_path / "logs", args=(
        "--scenario", "slow-holder", "--delay", "60", "--replication-timeout", "10"))
    assert_restored(cut, saved, 20, fetched={2: 0, 3: 1})
    for rank, out in cut.items():
        assert out["restore"]["resending"] == {"2": [0], "3": [1]}, (rank, out["restore"])
    for source, holder in ((0, 2), (1, 3)):
        events = cut[source]["restore_events"]
        assert not [e for e in events if e["type"] == "ReplicaRestored"], events
        failed = [e for e in events if e["type"] == "ReplicaRestoreFailed"]
        assert [(e["step"], e["holder"]) for e in failed] == [(20, holder)], events
        assert not list(step_dir(root, holder, 20).glob("replica-*")), holder
    again = launch("restore", root, tmp_path / "logs-again", args=("--wait-copies",))
    assert_restored(again, saved, 20, fetched={})
    for source, holder in ((0, 2), (1, 3)):
        assert again[source]["restore"]["resending"] == {"2": [0], "3": [1]}
        restored = [e for e in again[source]["restore_events"] if e["type"] == "ReplicaRestored"]
        assert [(e["step"], e["holder"]) for e in restored] == [(20, holder)]
        assert (step_dir(root, holder, 20) / f"replica-{source:05d}-on-{holder:05d}.commit"
                ).exists()
    assert not list(root.rglob(".*tmp-*"))  # what the cut copies left was scrubbed
