"""The memory tier beside copies on other nodes (2 gloo ranks on 2 nodes, ``replicas=1``, one
process per rank of ``tests/children/replica_worker.py``): the copies and the disk hold the
steps written through only, a crash restores the newest memory step, and a lost node costs
what the tier's docs say, up to ``disk_every`` save intervals."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests._support.replicas import assert_restored, launch, step_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = (10, 20, 30, 40)  # disk_every=2: the 1st and 3rd memory commits go through to disk
WRITTEN_THROUGH = (10, 30)


def _copy(source: Path, target: Path) -> None:
    shutil.copytree(source, target, symlinks=True)
    for lock in target.rglob(".lock*"):
        lock.unlink()


def test_copies_hold_the_written_through_steps_and_a_lost_node_restores_the_newest_of_them(
        tmp_path: Path, shm_dir: Path) -> None:
    root = tmp_path / "root"
    tier = ("--memory", str(shm_dir), "--disk-every", "2")
    saved = launch("save", root, tmp_path / "logs-save", world=2, nodes=2,
                   steps=",".join(map(str, STEPS)), args=(*tier, "--crash-after-save"),
                   codes={0: -9, 1: -9})
    for rank, out in saved.items():
        other = 1 - rank
        for step in STEPS:
            record = out["saves"][str(step)]
            assert record["ok"] and record["tier"] == "memory", (rank, step, record)
            assert record["durable_holders"] == ([other] if step in WRITTEN_THROUGH
                                                 else None), (rank, step, record)
    for rank in (0, 1):  # the disk and the copies on the other node: written-through steps
        other = 1 - rank
        on_disk = sorted(int(p.name.split("-")[1]) for p in (root / f"rank-{rank}").glob(
            "step-*"))
        assert on_disk == list(WRITTEN_THROUGH), (rank, on_disk)
        for step in WRITTEN_THROUGH:
            copy = step_dir(root, rank, step) / f"replica-{other:05d}-on-{rank:05d}.shard"
            assert copy.exists(), copy
    lost_root, lost_memory = tmp_path / "lost-root", tmp_path / "lost-memory"
    _copy(root, lost_root)
    _copy(shm_dir / "rank-0", lost_memory / "rank-0")

    # The processes crashed, the nodes are intact: the newest step, from memory on both.
    intact = launch("restore", root, tmp_path / "logs-intact", world=2, nodes=2, args=tier)
    assert_restored(intact, saved, 40, fetched={})
    assert all(out["restore"]["from_memory"] == [0, 1] for out in intact.values()), intact

    # Node 1 is lost (its disk and its memory): the newest step written through, with rank
    # 1's shard from its copy on node 0; rank 0's newer memory steps are of no use alone.
    shutil.rmtree(lost_root / "rank-1")
    lost = launch("restore", lost_root, tmp_path / "logs-lost", world=2, nodes=2,
                  args=("--memory", str(lost_memory), "--disk-every", "2"))
    assert_restored(lost, saved, 30, fetched={1: 0})
