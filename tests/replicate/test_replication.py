"""Replication across nodes, with real gloo process groups: one process per rank, one root per
rank, nodes given by ``node_name`` (``tests/children/replica_worker.py``).

Every value a rank saves is a function of (step, rank), so a restore is checked exactly, and so
are the TrainState and the RNG state the save captured.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ckpt_pipeline.testing import CRASH_ENV
from tests._support.replicas import assert_restored, launch, step_dir


@pytest.fixture(scope="module")
def saved_4x2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    """4 ranks on 2 nodes (0, 1 on node0; 2, 3 on node1), replicas=1, steps 10 and 20."""
    base = tmp_path_factory.mktemp("saved-4x2")
    results = launch("save", base / "root", base / "logs")
    for rank, out in results.items():
        for step in ("10", "20"):
            assert out["saves"][step]["ok"], (rank, out["saves"][step])
    return base / "root", results


def fresh(saved: tuple[Path, dict[int, Any]], tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(saved[0], root, symlinks=True)
    for lock in root.glob("rank-*/.lock-*"):
        lock.unlink()
    return root


def flip_data_byte(shard: Path, offset: int = 4096 + 17) -> None:
    with shard.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# ---------------------------------------------------------------- saving with copies

@pytest.mark.timeout(200)
@pytest.mark.slow
def test_every_shard_is_copied_to_the_other_node_as_placed(
        saved_4x2: tuple[Path, dict[int, Any]]) -> None:
    root, results = saved_4x2
    holder_of = {0: 2, 1: 3, 2: 0, 3: 1}  # k-th copy: node (i+1) mod 2, same position
    for rank, out in results.items():
        for step in ("10", "20"):
            assert out["saves"][step]["replica_holders"] == [holder_of[rank]]
            assert out["saves"][step]["missing"] == []
        sent = [e for e in out["events"] if e["type"] == "ShardReplicated"]
        assert [(e["step"], e["peer"], e["node"]) for e in sent] == [
            (10, holder_of[rank], f"node{holder_of[rank] // 2}"),
            (20, holder_of[rank], f"node{holder_of[rank] // 2}")]
        assert all(e["bytes"] > 1_200_000 and e["seconds"] > 0 for e in sent)
    for source, holder in holder_of.items():
        for step in (10, 20):
            own = step_dir(root, source, step)
            copy = step_dir(root, holder, step)
            for kind in ("shard", "manifest", "commit"):
                mine = (own / f"rank-{source:05d}.{kind}").read_bytes()
                theirs = (copy / f"replica-{source:05d}-on-{holder:05d}.{kind}").read_bytes()
                if kind == "commit":  # same save, written at another moment
                    assert len(theirs) > 0
                else:
                    assert mine == theirs, (source, holder, step, kind)
    leftovers = [p for p in root.rglob(".*tmp-*")]
    assert leftovers == []


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_lost_node_is_restored_from_the_copies_and_gets_its_shards_back(
        saved_4x2: tuple[Path, dict[int, Any]], tmp_path: Path) -> None:
    root = fresh(saved_4x2, tmp_path)
    shutil.rmtree(root / "rank-2")
    shutil.rmtree(root / "rank-3")  # node1's disks are gone: a replaced node
    results = launch("restore", root, tmp_path / "logs")
    assert_restored(results, saved_4x2[1], 20, fetched={2: 0, 3: 1})
    for rank in (2, 3):
        fetched = [e for e in results[rank]["restore_events"] if e["type"] == "ShardFetched"]
        assert [(e["step"], e["peer"]) for e in fetched] == [(20, rank - 2)]
        # Redundancy is back: the fetched shard is the rank's own again, byte for byte.
        own = step_dir(root, rank, 20) / f"rank-{rank:05d}.shard"
        copy = step_dir(root, rank - 2, 20) / f"replica-{rank:05d}-on-{rank - 2:05d}.shard"
        assert own.read_bytes() == copy.read_bytes()
    # A second restart needs no fetch: every rank holds its own shard again.
    again = launch("restore", root, tmp_path / "logs-again")
    assert_restored(again, saved_4x2[1], 20, fetched={})


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_shard_lost_with_its_copy_falls_back_to_the_newest_step_still_whole(
        saved_4x2: tuple[Path, dict[int, Any]], tmp_path: Path) -> None:
    root = fresh(saved_4x2, tmp_path)
    shutil.rmtree(step_dir(root, 2, 20))  # rank 2's step 20, and its only copy (on rank 0)
    for name in ("shard", "manifest", "commit"):
        (step_dir(root, 0, 20) / f"replica-00002-on-00000.{name}").unlink()
    results = launch("restore", root, tmp_path / "logs")
    assert_restored(results, saved_4x2[1], 10, fetched={})


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_shard_held_nowhere_is_a_restore_error_naming_it(
        saved_4x2: tuple[Path, dict[int, Any]], tmp_path: Path) -> None:
    root = fresh(saved_4x2, tmp_path)
    shutil.rmtree(root / "rank-2")  # rank 2 and the holder of its copy, rank 0: both gone
    shutil.rmtree(root / "rank-0")
    results = launch("restore", root, tmp_path / "logs")
    for rank, out in results.items():
        restore = out["restore"]
        assert not restore["ok"], (rank, restore)
        assert restore["error"]["type"] == "RestoreError"
        assert "the shard of rank(s) [0, 2]" in restore["error"]["message"], restore


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_corrupt_copy_does_not_matter_while_the_original_is_good(
        saved_4x2: tuple[Path, dict[int, Any]], tmp_path: Path) -> None:
    root = fresh(saved_4x2, tmp_path)
    flip_data_byte(step_dir(root, 0, 20) / "replica-00002-on-00000.shard")
    results = launch("restore", root, tmp_path / "logs")
    assert_restored(results, saved_4x2[1], 20, fetched={})


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_corrupt_original_is_replaced_by_its_good_copy(
        saved_4x2: tuple[Path, dict[int, Any]], tmp_path: Path) -> None:
    root = fresh(saved_4x2, tmp_path)
    flip_data_byte(step_dir(root, 2, 20) / "rank-00002.shard")
    results = launch("restore", root, tmp_path / "logs")
    assert_restored(results, saved_4x2[1], 20, fetched={2: 0})
    moved = list((root / "rank-2").glob("step-0000000020.rejected-r00002-*/rank-00002.shard"))
    assert len(moved) == 1  # the corrupt one, kept aside for inspection


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_corrupt_original_and_corrupt_copy_fall_back_together(
        saved_4x2: tuple[Path, dict[int, Any]], tmp_path: Path) -> None:
    root = fresh(saved_4x2, tmp_path)
    flip_data_byte(step_dir(root, 2, 20) / "rank-00002.shard")
    flip_data_byte(step_dir(root, 0, 20) / "replica-00002-on-00000.shard")
    results = launch("restore", root, tmp_path / "logs")
    assert_restored(results, saved_4x2[1], 10, fetched={})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fetched_step_that_fails_elsewhere_is_moved_aside_and_saved_again(
        saved_4x2: tuple[Path, dict[int, Any]], tmp_path: Path) -> None:
    """Rank 2's root is gone: it fetches step 20, but rank 1's step 20 is corrupt everywhere
    (its own shard and its copy), so every rank falls back to step 10, which rank 2 fetches
    too. The step 20 it fetched must not stay complete in its root: training saves step 20
    again after the restore, and that save must work on every rank."""
    root = fresh(saved_4x2, tmp_path)
    shutil.rmtree(root / "rank-2")
    flip_data_byte(step_dir(root, 1, 20) / "rank-00001.shard")
    flip_data_byte(step_dir(root, 3, 20) / "replica-00001-on-00003.shard")
    results = launch("save-restore", root, tmp_path / "logs", steps="20")
    assert_restored(results, saved_4x2[1], 10, fetched={2: 0})
    for rank, out in results.items():
        save = out["saves"]["20"]
        assert save["ok"] and save["missing"] == [], (rank, save)
    assert list((root / "rank-2").glob("step-0000000020.rejected-r00002-*/rank-00002.shard"))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_retention_prunes_the_copies_with_their_step(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = launch("save", root, tmp_path / "logs", steps="10,20,30",
                     args=("--keep-last", "2"))
    assert all(out["saves"]["30"]["ok"] for out in results.values())
    for rank in range(4):
        held = sorted(p.name for p in (root / f"rank-{rank}").iterdir()
                      if p.name.startswith("step-"))
        assert held == ["step-0000000020", "step-0000000030"], (rank, held)
        for step in (20, 30):
            names = sorted(p.name for p in step_dir(root, rank, step).iterdir())
            source = (rank + 2) % 4  # the rank whose copy this one holds
            assert names == sorted([f"rank-{rank:05d}.{k}" for k in ("commit", "manifest",
                                                                      "shard")]
                                   + [f"replica-{source:05d}-on-{rank:05d}.{k}"
                                      for k in ("commit", "manifest", "shard")]), names


# ---------------------------------------------------------------- faults while copying

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_holder_killed_mid_transfer_publishes_no_torn_copy_and_the_next_save_works(
        tmp_path: Path) -> None:
    """Rank 0 (the holder of rank 2's copy) is SIGKILLed after the first frame of step 20's
    copy arrived (two frames of data, header and preamble make 4 frames per copy): step 20
    fails on every other rank (the dead rank never votes: CoordinationError after the
    timeout); nothing of rank 2's copy of step 20 is published on rank 0. A new job restores
    step 10 and saves again, with its copies."""
    root = tmp_path / "root"
    results = launch("save", root, tmp_path / "logs", args=("--coordination-timeout", "8"),
                     env={0: {"CKPT_PIPELINE_CRASH_AT": "replicate.receiving:5"}},
                     codes={0: -9})
    assert 0 not in results
    for rank in (1, 2, 3):
        saves = results[rank]["saves"]
        assert saves["10"]["ok"] and not saves["20"]["ok"], (rank, saves)
        assert saves["20"]["error"]["type"] in ("CoordinationError", "SaveError"), saves["20"]
    published = sorted(p.name for p in step_dir(root, 0, 20).glob("replica-*")) if (
        step_dir(root, 0, 20).exists()) else []
    assert published == []
    after = launch("save-restore", root, tmp_path / "logs-2", steps="30")
    for rank, out in after.items():
        assert out["restore"]["step"] == 10, (rank, out["restore"])
        assert out["restore"]["mismatches"] == []
        assert out["saves"]["30"]["ok"] and out["saves"]["30"]["missing"] == [], out["saves"]
    assert not list(root.rglob(".*tmp-*"))  # the killed rank's temporaries were scrubbed


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_holder_that_refuses_copies_makes_the_step_commit_degraded_on_every_rank(
        tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = launch("save", root, tmp_path / "logs", steps="10,20,30",
                     args=("--scenario", "refuse-copies", "--target", "1",
                           "--max-failures", "2"))
    for rank, out in results.items():
        # The failure policy counts a degraded save: after two in a row, the next save()
        # raises once, naming what happened.
        third = out["saves"]["30"]
        assert third["raised_in_save"] and third["error"]["type"] == "SaveError", third
        assert ("2 saves in a row failed or committed without all their copies"
                in third["error"]["message"]), third
        assert "rank 3's copy on rank 1" in third["error"]["message"], third
        for step in ("10", "20"):
            save = out["saves"][step]
            assert save["ok"], (rank, save)
            assert save["missing"] == [[3, 1]], (rank, save)  # rank 3's copy lives on rank 1
        degraded = [e for e in out["events"] if e["type"] == "ReplicationDegraded"]
        assert [e["step"] for e in degraded] == [10, 20]
        assert "rank 1 refuses copies (injected)" in degraded[0]["reasons"][0], degraded
        # No logging is configured in the workers: each degraded commit is a warning.
        log = (tmp_path / "logs" / f"rank-{rank}.log").read_text(errors="replace")
        for step in (10, 20):
            assert (f"CheckpointWarning: ckpt_pipeline: step {step} committed without 1 of "
                    "its copies") in log, log[-3000:]
    assert results[3]["saves"]["20"]["replica_holders"] == []
    assert results[0]["saves"]["20"]["replica_holders"] == [2]
    assert not list(step_dir(root, 1, 20).glob("replica-*"))
    # Still restorable (every own shard is there).
    restored = launch("restore", root, tmp_path / "logs-restore")
    assert_restored(restored, results, 20, fetched={})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_transfers_slower_than_saves_apply_backpressure_with_flat_memory(
        tmp_path: Path) -> None:
    """Every holder takes 0.25 s per frame it receives (a 24 MB shard goes in 6 frames), and
    the saves are requested back to back. A save's host buffer is busy until its bytes are
    written and handed to the connections; once the connections' socket buffers are full the
    sender waits for the holder, so with one buffer slot the next save() waits too
    (when_busy="block"). Nothing is dropped or missing, the pool stays one slot, and the
    process's memory stops growing once the pipeline is warm (a holder receives into a mapped
    piece buffer per connection, unmapped after it)."""
    steps = ",".join(str(10 * k) for k in range(1, 13))
    results = launch("save", tmp_path / "root", tmp_path / "logs", steps=steps,
                     args=("--scenario", "slow-holder", "--delay", "0.25", "--no-wait",
                           "--numel", "6000000"))
    for rank, out in results.items():
        saves = [out["saves"][s] for s in steps.split(",")]
        assert all(s["ok"] and s["missing"] == [] for s in saves), (rank, saves)
        # Each later save() waited for the buffer that the previous copy still sent from.
        assert all(s["blocking"] > 0.2 for s in saves[1:]), (rank, saves)
        memory = out["host_memory_bytes"]
        assert len(set(memory)) == 1 and memory[0] < 25_000_000, memory  # one slot
        # No growth with saves once warm (the pool, the threads and their buffers are made in
        # the first saves). The allocator moves RSS by up to two states (48 MB) either way
        # between saves (53 MB was seen once, on a loaded 2-core machine), so the check
        # compares peaks, eight saves apart: keeping one state (24 MB) per save would lift
        # the peak of the last four of the 12 saves some 192 MB above the peak of the first
        # four; the bound is three states.
        rss = out["rss_bytes"]
        assert len(rss) == 12 and max(rss[8:]) - max(rss[:4]) < 72_000_000, rss


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_eight_ranks_on_four_nodes_with_two_copies_survive_two_lost_nodes(
        tmp_path: Path) -> None:
    root = tmp_path / "root"
    saved = launch("save", root, tmp_path / "logs", world=8, nodes=4, replicas=2)
    for out in saved.values():
        assert out["saves"]["20"]["ok"] and out["saves"]["20"]["missing"] == [], out
        assert len(out["saves"]["20"]["replica_holders"]) == 2
    for rank in (2, 3, 4, 5):  # node1 and node2
        shutil.rmtree(root / f"rank-{rank}")
    results = launch("restore", root, tmp_path / "logs-restore", world=8, nodes=4,
                     replicas=2)
    # rank 2, 3 (node1): copies on node2 (lost) and node3 (ranks 6, 7); rank 4, 5 (node2):
    # copies on node3 (6, 7) and node0 (0, 1), the lowest holder asked first.
    assert_restored(results, saved, 20, fetched={2: 6, 3: 7, 4: 0, 5: 1})


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_more_copies_than_other_nodes_is_a_config_error_at_open(tmp_path: Path) -> None:
    results = launch("save", tmp_path / "root", tmp_path / "logs", world=2, nodes=1,
                     codes={0: 1, 1: 1})
    for out in results.values():
        assert out["fatal"]["type"] == "ConfigError"
        assert "copies=1 needs 2 nodes, this job runs on 1" in out["fatal"]["message"]


# ---------------------------------------------------------------- a rewind and the copies
#
# Two ranks on two nodes, replicas=1 (each rank's shard copied to the other), steps 10-60,
# then restore(step=30). When a rank's root is lost afterwards, the copies the other rank holds
# never bring back the abandoned steps 40-60, whether the rewind finished or was killed once
# it was recorded.

REWIND_STEPS = "10,20,30,40,50,60"


def _saved_to_60(tmp_path: Path) -> tuple[Path, dict[int, Any]]:
    root = tmp_path / "root"
    results = launch("save", root, tmp_path / "logs-save", world=2, nodes=2, replicas=1,
                     steps=REWIND_STEPS, args=("--keep-last", "10"))
    for rank, out in results.items():
        assert all(s["ok"] for s in out["saves"].values()), (rank, out["saves"])
    return root, results


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_after_a_rewind_a_lost_root_is_restored_from_copies_of_the_current_timeline(
        tmp_path: Path) -> None:
    root, saved = _saved_to_60(tmp_path)
    rewound = launch("restore", root, tmp_path / "logs-rewind", steps="",
                     world=2, nodes=2, replicas=1,
                     args=("--keep-last", "10", "--restore-step", "30"))
    assert_restored(rewound, saved, 30, fetched={})
    # Rank 0 moved aside its own steps 40-60 and the copies of rank 1's that it holds.
    for step in (40, 50, 60):
        assert not step_dir(root, 0, step).exists()
        assert len(list((root / "rank-0").glob(f"step-{step:010d}.rewound-0000000030-*"))) == 1
    shutil.rmtree(root / "rank-1")  # rank 1's node is replaced
    results = launch("restore", root, tmp_path / "logs-after", steps="", world=2, nodes=2,
                     replicas=1, args=("--keep-last", "10"))
    assert_restored(results, saved, 30, fetched={1: 0})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rewind_killed_once_recorded_still_resumes_the_rewind_point_from_the_copies(
        tmp_path: Path) -> None:
    root, saved = _saved_to_60(tmp_path)
    crash = {CRASH_ENV: "restore.rewind_recorded"}
    launch("restore", root, tmp_path / "logs-rewind", steps="", world=2, nodes=2, replicas=1,
           args=("--keep-last", "10", "--restore-step", "30"), env={0: crash, 1: crash},
           codes={0: -9, 1: -9})
    # Killed before anything was moved aside: rank 0 still holds its 40-60 and the copies of
    # rank 1's; only the rewind records say they are abandoned.
    assert all(step_dir(root, 0, s).exists() for s in (40, 50, 60))
    assert sorted(p.name for p in (root / "rank-0").glob("rewind-*")) == [
        "rewind-0000000001-r00000"]
    shutil.rmtree(root / "rank-1")
    results = launch("restore", root, tmp_path / "logs-after", steps="", world=2, nodes=2,
                     replicas=1, args=("--keep-last", "10"))
    assert_restored(results, saved, 30, fetched={1: 0})
    assert all(not step_dir(root, 0, s).exists() for s in (40, 50, 60))
