"""The persistent tier with real gloo process groups: four ranks promoting into one prefix of a
real S3-speaking server, and a training process killed while it uploads.

The four-rank runs use ``tests/children/replica_worker.py`` (every value saved is a function of
(step, rank), so a restore is checked exactly) through the launcher of the replication tests.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._tiers.persistent.layout import STEP_COMMIT, decode_step_record
from ckpt_pipeline._tiers.persistent.urls import open_remote
from tests._support.children import spawn_child
from tests._support.replicas import launch


def _objects(url: str, options: dict[str, Any]) -> dict[str, dict[str, int]]:
    remote = open_remote(url, options=options)
    try:
        return {name: remote.list_dir(name) for name in remote.list_steps()}
    finally:
        remote.close()


@pytest.mark.slow
def test_four_ranks_promote_into_one_prefix_and_restore_after_every_root_is_lost(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]], fault_proxy: Any
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)  # records every request, in order
    env = {r: {"CKPT_TEST_PERSIST_OPTIONS": json.dumps(proxy.options)} for r in range(4)}
    args = ("--persistent", url, "--persist-every", "1", "--numel", "1000000")
    results = launch("save", tmp_path / "root", tmp_path / "logs", world=4, nodes=4,
                     replicas=0, steps="10,20,30", args=args, env=env)
    for rank, out in results.items():
        assert all(s["ok"] for s in out["saves"].values()), (rank, out["saves"])
        uploaded = [e["step"] for e in out["events"] if e["type"] == "ShardUploaded"]
        assert uploaded == [10, 20, 30], (rank, out["events"])
    persisted = [e["step"] for e in results[0]["events"] if e["type"] == "StepPersisted"]
    assert persisted == [10, 20, 30]
    assert all(e["type"] != "StepPersisted" for r in (1, 2, 3) for e in results[r]["events"])

    objects = _objects(url, options)
    assert sorted(objects) == ["step-0000000010", "step-0000000020", "step-0000000030"]
    remote = open_remote(url, options=options)
    try:
        for name, listing in objects.items():
            ranks = {f"rank-{r:05d}.{k}" for r in range(4) for k in ("shard", "manifest",
                                                                   "commit")}
            assert set(listing) == ranks | {STEP_COMMIT}, listing
            raw = remote.get_small(f"{name}/{STEP_COMMIT}", 1 << 20)
            assert raw is not None
            record = decode_step_record(raw, name)
            assert record.world_size == 4 and set(record.objects) == ranks
            assert {record.objects[n].size for n in ranks} == {listing[n] for n in ranks}
    finally:
        remote.close()
    # One commit object per step, written after every rank's objects of the step.
    writes = [path for method, path in proxy.requests
              if method in ("PUT", "POST") and "/step-" in path]
    for name in objects:
        commits = [i for i, p in enumerate(writes) if f"{name}/{STEP_COMMIT}" in p]
        assert len(commits) == 1, writes
        rank_writes = [i for i, p in enumerate(writes) if f"{name}/rank-" in p]
        assert rank_writes and max(rank_writes) < commits[0], writes

    # cp.load by URL reads any rank's shard of the tier, and all four with consolidate=True
    # (plain tensors: rank 0's values), in this process.
    for rank in range(4):
        got = cp.load(url, rank=rank, options=options)
        assert (got.step, got.rank, got.world_size) == (30, rank, 4)
        assert torch.equal(got.tree["model"]["bias"], torch.full((4,), 3000.0 + rank))
    whole = cp.load(url, 20, consolidate=True, options=options)
    assert (whole.step, whole.rank) == (20, None)
    assert torch.equal(whole.tree["w"], torch.arange(1_000_000, dtype=torch.float32).add_(320))
    assert whole.bytes == 4 * cp.load(url, 20, options=options).bytes

    shutil.rmtree(tmp_path / "root")  # every node replaced
    env = {r: {"CKPT_TEST_PERSIST_OPTIONS": json.dumps(options)} for r in range(4)}
    restored = launch("restore", tmp_path / "root", tmp_path / "logs2", world=4, nodes=4,
                      replicas=0, args=("--persistent", url, "--numel", "1000000"), env=env)
    for rank, out in restored.items():
        got = out["restore"]
        assert got["ok"] and got["step"] == 30, (rank, got)
        assert got["downloaded"] == [0, 1, 2, 3]
        assert got["mismatches"] == [], (rank, got)
        assert got["train_state"]["step"] == 30
        assert got["rng"] == results[rank]["saves"]["30"]["rng"]


@pytest.mark.slow
def test_sigkill_during_an_upload_leaves_no_step_that_looks_complete(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]], fault_proxy: Any
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    proxy.delay("PUT", seconds=1.0)  # each part takes a second: the upload is in flight
    local = tmp_path / "local"
    child = spawn_child("persist_child.py", local, url, stdout=subprocess.PIPE,
                        stderr=tmp_path / "child.log", text=True,
                        env={"CKPT_TEST_PERSIST_OPTIONS": json.dumps(proxy.options),
                             "CKPT_TEST_PERSIST_LEASE": "1"})
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "committed 10", (
            (tmp_path / "child.log").read_text())
        deadline = time.monotonic() + 30
        # The shard is up, the manifest on its way: the kill leaves a partial step behind.
        while not any(m == "PUT" and "step-0000000010/rank-00000.manifest" in p
                      for m, p in proxy.requests):
            assert time.monotonic() < deadline, proxy.requests
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        # The proxy still forwards what it held when the client died (a store may complete a
        # request whose client is gone, too): let it land before looking.
        time.sleep(1.5)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    objects = _objects(url, options)
    assert "rank-00000.shard" in objects["step-0000000010"], objects
    assert STEP_COMMIT not in objects["step-0000000010"], objects

    # The next promotion works, and the leftovers of the killed one are removed.
    events: list[cp.Event] = []
    with cp.CheckpointPipeline(local, persistent=cp.PersistentConfig(url, options=options),
                               direct_io=False) as pipe:
        pipe.subscribe(events.append)
        pipe.save(20, {"w": torch.ones(1000)}, cp.TrainState(step=20)).result(60)
    assert [e.step for e in events if isinstance(e, cp.StepPersisted)] == [20]
    assert [(e.step, e.complete) for e in events if isinstance(e, cp.PersistPruned)] == [
        (10, False)]
    objects = _objects(url, options)
    assert sorted(objects) == ["step-0000000020"]
    assert STEP_COMMIT in objects["step-0000000020"]
