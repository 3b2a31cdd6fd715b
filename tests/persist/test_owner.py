"""A persistent URL belongs to one open of one job: two jobs with their own local roots and one
persistent URL, a job that was killed, a forced takeover, a job that lost the URL mid-run, and
what a killed upload leaves in a directory tier.

The jobs are pipelines of this process (each with its own root, as two jobs on two nodes) or
a child process killed with SIGKILL; the tiers are a directory and moto's S3 server.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._tiers.persistent.layout import STEP_COMMIT
from ckpt_pipeline._tiers.persistent.owner import (
    MAX_OWNER_BYTES,
    OWNER_KEY,
    OwnerRecord,
    Ownership,
    decode_owner,
    encode_owner,
)
from ckpt_pipeline._tiers.persistent.promote import read_step_record
from ckpt_pipeline._tiers.persistent.urls import open_remote
from ckpt_pipeline.storage import LocalStorage
from tests._support.children import spawn_child
from tests._support.replicas import launch

Tier = tuple[str, "dict[str, Any] | None"]


def _tier(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if kind == "dir":
        return str(tmp_path / "shared" / "run"), None
    if kind == "memory":
        return f"memory://owner-{os.getpid()}-{id(tmp_path)}/run", None
    url, options = request.getfixturevalue("s3_url")
    return url, options


@pytest.fixture(params=["dir", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    """(persistent URL or path, its options) of an empty persistent tier."""
    return _tier(request.param, request, tmp_path)


@pytest.fixture(params=["dir", "s3", "memory"])
def any_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    """As ``tier``, and fsspec's in-memory file system: a store without conditional writes
    (ownership there is compare-then-write)."""
    return _tier(request.param, request, tmp_path)


def _pipe(root: Path, tier: Tier, **options: Any) -> cp.CheckpointPipeline:
    url, fs_options = tier
    group = {k: options.pop(k) for k in ("lease_s", "takeover") if k in options}
    return cp.CheckpointPipeline(root, persistent=cp.PersistentConfig(url, options=fs_options,
                                                                      **group),
                                 direct_io=False, **options)


def _owner(tier: Tier) -> OwnerRecord | None:
    remote = open_remote(tier[0], options=tier[1])
    try:
        found = remote.get_versioned(OWNER_KEY, MAX_OWNER_BYTES)
        return None if found is None else decode_owner(found[0], OWNER_KEY)
    finally:
        remote.close()


def _write_owner(tier: Tier, record: OwnerRecord) -> None:
    """Leave the owner object as a job that is gone left it."""
    remote = open_remote(tier[0], options=tier[1])
    try:
        remote.put_versioned(OWNER_KEY, encode_owner(record), None)
    finally:
        remote.close()


def _gone(heartbeat_age_s: float, lease_s: float) -> OwnerRecord:
    now = time.time()
    return OwnerRecord("0123456789abcdef", "gone-host", 4242, "/gone/root", lease_s,
                       now - heartbeat_age_s - 10, now - heartbeat_age_s, 7)


def _save(pipe: cp.CheckpointPipeline, step: int, value: float) -> None:
    pipe.save(step, {"w": torch.full((50_000,), value)}, cp.TrainState(step=step)).result(60)


def _wait_for(events: list[cp.Event], kind: type, step: int) -> None:
    """Until an event of ``kind`` for ``step`` arrived (bounded: a hang fails)."""
    deadline = time.monotonic() + 60
    while not any(isinstance(e, kind) and e.step == step for e in list(events)):
        assert time.monotonic() < deadline, events
        time.sleep(0.01)


def _steps(kind: type, events: list[cp.Event]) -> list[int]:
    return [e.step for e in events if isinstance(e, kind)]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_second_job_on_a_url_whose_holder_is_alive_is_refused_naming_the_holder(
    tmp_path: Path, any_tier: Tier
) -> None:
    tier = any_tier
    events: list[cp.Event] = []
    with _pipe(tmp_path / "a", tier, lease_s=3.0) as first:
        first.subscribe(events.append)
        holder = _owner(tier)
        assert holder is not None and not holder.released
        second = _pipe(tmp_path / "b", tier, lease_s=1.0)
        with pytest.raises(cp.PersistentInUseError) as refused:
            second.open()
        message = str(refused.value)
        for part in (holder.run_id, holder.host, f"pid {os.getpid()}", str(tmp_path / "a"),
                     "PersistentConfig(takeover=True)"):
            assert part in message, message
        # The holder goes on: its next step persists, and it still holds the URL.
        _save(first, 1, 1.0)
    assert _steps(cp.StepPersisted, events) == [1]
    assert not any(isinstance(e, cp.PersistentTakenOver) for e in events)
    released = _owner(tier)
    assert released is not None and released.run_id == holder.run_id and released.released
    # Once the holder closed, the refused job (its root lock given back) opens at once.
    with _pipe(tmp_path / "b", tier, lease_s=1.0) as again:
        _save(again, 2, 2.0)
    owner = _owner(tier)
    assert owner is not None and owner.root == str(tmp_path / "b")


@pytest.mark.timeout(60)
def test_a_url_released_by_a_clean_close_is_taken_at_once_by_the_next_job(
    tmp_path: Path
) -> None:
    tier: Tier = (str(tmp_path / "shared"), None)
    with _pipe(tmp_path / "a", tier, lease_s=3600.0) as first:
        _save(first, 1, 1.0)
    events: list[cp.Event] = []
    # A lease of an hour: were the URL not released, the open would watch it for an hour.
    with _pipe(tmp_path / "b", tier, lease_s=3600.0) as second:
        second.subscribe(events.append)
        _save(second, 2, 2.0)
    assert _steps(cp.StepPersisted, events) == [2]
    assert not any(isinstance(e, cp.PersistentTakenOver) for e in events)


@pytest.mark.timeout(60)
def test_a_url_whose_heartbeat_is_older_than_its_lease_is_taken_over_with_an_event(
    tmp_path: Path, tier: Tier, caplog: pytest.LogCaptureFixture
) -> None:
    _write_owner(tier, _gone(heartbeat_age_s=120.0, lease_s=60.0))
    events: list[cp.Event] = []
    pipe = _pipe(tmp_path / "b", tier, lease_s=3600.0)
    pipe.subscribe(events.append)
    # A lease of an hour for this job: the holder's own lease (60 s) decides.
    with caplog.at_level(logging.WARNING, logger="ckpt_pipeline"), pipe:
        _save(pipe, 5, 5.0)
    taken = [e for e in events if isinstance(e, cp.PersistentTakenOver)]
    assert len(taken) == 1 and taken[0].holder == "0123456789abcdef", events
    assert taken[0].heartbeat_age_s >= 120.0 and not taken[0].forced
    assert any("ckpt.persist.taken_over" in r.getMessage() and "gone-host" in r.getMessage()
               for r in caplog.records), caplog.text
    assert _steps(cp.StepPersisted, events) == [5]


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_holder_whose_heartbeat_does_not_advance_for_one_lease_is_taken_over(
    tmp_path: Path
) -> None:
    tier: Tier = (str(tmp_path / "shared"), None)
    _write_owner(tier, _gone(heartbeat_age_s=0.0, lease_s=1.0))  # died just now
    taken: list[cp.Event] = []
    pipe = _pipe(tmp_path / "b", tier)
    pipe.subscribe(taken.append)
    with pipe:
        _save(pipe, 1, 1.0)
    over = [e for e in taken if isinstance(e, cp.PersistentTakenOver)]
    assert len(over) == 1, taken
    assert (over[0].holder, over[0].host, over[0].pid, over[0].root, over[0].forced) == (
        "0123456789abcdef", "gone-host", 4242, "/gone/root", False)
    assert _steps(cp.StepPersisted, taken) == [1]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_job_that_lost_its_url_to_a_takeover_never_reports_the_other_jobs_step(
    tmp_path: Path, any_tier: Tier, caplog: pytest.LogCaptureFixture
) -> None:
    tier = any_tier
    first_events: list[cp.Event] = []
    second_events: list[cp.Event] = []
    first = _pipe(tmp_path / "a", tier, lease_s=3.0)
    first.subscribe(first_events.append)
    with caplog.at_level(logging.ERROR, logger="ckpt_pipeline"), first:
        _save(first, 1, 1.0)
        _wait_for(first_events, cp.ShardUploaded, 1)
        _save(first, 2, 1.5)  # its vote commits step 1 in the tier
        _wait_for(first_events, cp.StepPersisted, 1)
        second = _pipe(tmp_path / "b", tier, takeover=True)
        second.subscribe(second_events.append)
        with second:
            _save(second, 6, 6.0)
            # The job that lost the URL saves the same step number, with other data, and more.
            for step in (6, 7, 8):
                _save(first, step, -float(step))
    # The second job's close committed its step 6 (and released the URL).
    assert _steps(cp.StepPersisted, second_events) == [6]
    over = [e for e in second_events if isinstance(e, cp.PersistentTakenOver)]
    assert len(over) == 1 and over[0].forced and over[0].root == str(tmp_path / "a"), over
    assert _steps(cp.StepPersisted, first_events) == [1], first_events
    # Each of its steps after the takeover fails once, naming the new holder, whether it was
    # in flight or due when the job learnt it.
    for step in (6, 7, 8):
        failed = [e for e in first_events if isinstance(e, cp.PersistFailed) and e.step == step]
        assert len(failed) == 1 and "taken over by run" in failed[0].error, (step, first_events)
    stopped = [r for r in caplog.records if "ckpt.persist.stopped" in r.getMessage()]
    assert len(stopped) == 1 and stopped[0].levelno == logging.ERROR, caplog.text
    # The tier's step 6 is the second job's, whole: a restore from it alone gets its data.
    save_ids = {e.step: e.save_id for e in second_events if isinstance(e, cp.StepPersisted)}
    remote = open_remote(tier[0], options=tier[1])
    try:
        record = read_step_record(remote, 6)
    finally:
        remote.close()
    assert record is not None and record.save_id == save_ids[6]
    with _pipe(tmp_path / "fresh", tier) as pipe:
        state = {"w": torch.zeros(50_000)}
        result = pipe.restore_latest(state)
    assert result is not None and result.step == 6
    assert torch.equal(state["w"], torch.full((50_000,), 6.0))


@pytest.mark.timeout(120)
def test_a_step_whose_objects_another_job_replaced_is_not_committed(
    tmp_path: Path, tier: Tier
) -> None:
    events: list[cp.Event] = []
    with _pipe(tmp_path / "a", tier) as pipe:
        pipe.subscribe(events.append)
        _save(pipe, 1, 1.0)
        _wait_for(events, cp.ShardUploaded, 1)  # up, not committed before the next vote
        # Another job's shard of step 1 (same size, other bytes) replaces this one's.
        shard = tmp_path / "a" / "step-0000000001" / "rank-00000.shard"
        other = tmp_path / "other.shard"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        other.write_bytes(bytes(data))
        remote = open_remote(tier[0], options=tier[1])
        try:
            remote.upload(LocalStorage(tmp_path), other.name, "step-0000000001/rank-00000.shard")
        finally:
            remote.close()
        _save(pipe, 2, 2.0)
    failed = [e for e in events if isinstance(e, cp.PersistFailed) and e.step == 1]
    assert len(failed) == 1 and "not the object this run uploaded" in failed[0].error, events
    assert _steps(cp.StepPersisted, events) == [2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("option", "value"), [
    ("lease_s", 0), ("lease_s", -1.0), ("lease_s", True), ("lease_s", "60"),
    ("lease_s", 86400.0), ("takeover", "yes"), ("takeover", 1),
])
def test_invalid_ownership_options_fail_at_construction(option: str, value: Any) -> None:
    with pytest.raises(cp.ConfigError, match=option):
        cp.PersistentConfig("/tmp/x", **{option: value})


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_upload_leaves_nothing_in_a_directory_tier_once_a_newer_step_is_complete(
    tmp_path: Path
) -> None:
    tier: Tier = (str(tmp_path / "shared"), None)
    local = tmp_path / "local"
    child = spawn_child("persist_child.py", local, tier[0], stdout=subprocess.PIPE,
                        stderr=tmp_path / "child.log", text=True,
                        env={"CKPT_TEST_PERSIST_LEASE": "1", "CKPT_TEST_HOLD_UPLOAD": "1"})
    try:
        assert child.stdout is not None
        lines = {child.stdout.readline().strip() for _ in range(2)}  # printed by two threads
        assert lines == {"committed 10", "uploading"}, (tmp_path / "child.log").read_text()
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    step_dir = Path(tier[0]) / "step-0000000010"
    temporaries = [p for p in step_dir.iterdir() if ".tmp-" in p.name]
    assert len(temporaries) == 1 and temporaries[0].stat().st_size >= 8 * 1024 * 1024, (
        list(step_dir.iterdir()))
    holder = _owner(tier)
    assert holder is not None and holder.pid == child.pid and not holder.released

    # The next job (the same node, its root intact) takes the dead job's URL over, and the
    # newer step it completes removes the killed promotion, temporary included.
    events: list[cp.Event] = []
    pipe = _pipe(local, tier)
    pipe.subscribe(events.append)
    with pipe:
        _save(pipe, 20, 20.0)
    over = [e for e in events if isinstance(e, cp.PersistentTakenOver)]
    assert len(over) == 1 and over[0].pid == child.pid, events
    assert _steps(cp.StepPersisted, events) == [20]
    assert [(e.step, e.complete) for e in events if isinstance(e, cp.PersistPruned)] == [
        (10, False)]
    assert sorted(p.name for p in Path(tier[0]).iterdir() if not p.name.startswith(".")) == [
        "owner", "step-0000000020"]
    assert not any(".tmp-" in p.name for p in Path(tier[0]).rglob("*"))
    assert (Path(tier[0]) / "step-0000000020" / STEP_COMMIT).exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_rank_of_a_job_refused_the_url_raises_the_refusal_and_none_waits(
    tmp_path: Path
) -> None:
    tier: Tier = (str(tmp_path / "shared"), None)
    with _pipe(tmp_path / "holder", tier, lease_s=3.0) as holder:
        # Rank 0 is refused; rank 1 learns it from the agreement that follows, not after
        # the 60 s coordination timeout of the next one (a CoordinationError).
        results = launch("save", tmp_path / "root", tmp_path / "logs", world=2, nodes=2,
                         replicas=0, steps="10",
                         args=["--persistent", tier[0], "--coordination-timeout", "60"],
                         codes={0: 1, 1: 1})
        _save(holder, 1, 1.0)
    for rank in (0, 1):
        fatal = results[rank]["fatal"]
        assert fatal["type"] == "PersistentInUseError", (rank, fatal)
        assert str(tmp_path / "holder") in fatal["message"], (rank, fatal)
    assert not (tmp_path / "root" / "rank-0" / "step-0000000010").exists()


@pytest.mark.timeout(60)
def test_two_openers_racing_for_a_free_url_get_one_owner(tier: Tier) -> None:
    # A directory and S3 have conditional creates; fsspec's compare-then-write does not.
    remotes = [open_remote(tier[0], options=tier[1]) for _ in range(2)]
    barrier = threading.Barrier(2)
    won: list[Ownership] = []
    refused: list[cp.PersistentInUseError] = []

    def opener(index: int) -> None:
        barrier.wait()
        try:
            owner = Ownership.acquire(remotes[index], root=f"/root-{index}", lease_s=1.0,
                                      takeover=False, emit=lambda event: None)
        except cp.PersistentInUseError as exc:
            refused.append(exc)
            return
        owner.start_heartbeat()  # the winner stays alive: the loser sees it advance
        won.append(owner)

    threads = [threading.Thread(target=opener, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    try:
        assert not any(t.is_alive() for t in threads)
        assert len(won) == 1 and len(refused) == 1, (won, refused)
        assert won[0].record.root in refused[0].message
        assert won[0].check() is None
    finally:
        for owner in won:
            owner.release()
        for remote in remotes:
            remote.close()


@pytest.mark.timeout(60)
def test_a_heartbeat_after_a_takeover_reports_the_loss_naming_the_new_holder(
    any_tier: Tier
) -> None:
    remote = open_remote(any_tier[0], options=any_tier[1])
    try:
        first = Ownership.acquire(remote, root="/first", lease_s=60.0, takeover=False,
                                  emit=lambda event: None)
        assert first.beat() is None and first.check() is None
        taken: list[cp.Event] = []
        second = Ownership.acquire(remote, root="/second", lease_s=60.0, takeover=True,
                                   emit=taken.append)
        assert [type(e) for e in taken] == [cp.PersistentTakenOver]
        lost = first.beat()
        assert lost is not None and second.record.run_id in lost and "/second" in lost, lost
        assert first.check() == lost
        first.release()  # not the holder any more: writes nothing
        assert second.check() is None
        second.release()
        owner = _owner(any_tier)
        assert owner is not None and owner.run_id == second.record.run_id and owner.released
    finally:
        remote.close()
