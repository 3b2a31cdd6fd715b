"""The persistent tier through the pipeline: promotion, completeness, retention, restore from
it after every local root is gone, corrupt or missing objects, failing and throttled PUTs.

Each test runs against a real S3-speaking server (moto, started by the fixtures in
``conftest.py``) and, where the behaviour is the same, against a directory standing in for a
shared file system.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._tiers.persistent import promote as promote_mod
from ckpt_pipeline._tiers.persistent.layout import STEP_COMMIT, decode_step_record
from ckpt_pipeline._tiers.persistent.stream import ShardStream
from ckpt_pipeline._tiers.persistent.urls import open_remote


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "big": torch.randn(300_000)}


def _flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    out["big"] = state["big"].clone()
    for i, s in state["optimizer"].state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{i}.{k}"] = v.clone()
    return out


# S3 in the slow suite: the fast one covers S3 in test_remote.py, test_owner.py and the CLI's URLs
@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.slow), "dir"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    """(persistent URL or path, its options) of an empty persistent tier."""
    if request.param == "dir":
        return str(tmp_path / "shared" / "run"), None
    url, options = request.getfixturevalue("s3_url")
    return url, options


def _steps_in(url: str, options: dict[str, Any] | None) -> dict[int, bool]:
    """{step: complete} of every step prefix in the tier."""
    remote = open_remote(url, options=options)
    try:
        out = {}
        for name in remote.list_steps():
            out[int(name.split("-")[1])] = STEP_COMMIT in remote.list_dir(name)
        return out
    finally:
        remote.close()


def _save_steps(root: Path, tier: tuple[str, dict[str, Any] | None], steps: list[int],
                events: list[cp.Event] | None = None, *, settle: bool = False,
                **options: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Save ``steps`` with a persistent tier; with ``settle``, wait after each save until
    its upload (if one was due) ended, so that no promotion is skipped for being late."""
    url, fs_options = tier
    saved = {}
    seen: list[cp.Event] = [] if events is None else events
    group = cp.PersistentConfig(url, options=fs_options, **{
        k: options.pop(k) for k in ("every", "on_close", "keep", "retries") if k in options})
    with cp.CheckpointPipeline(root, persistent=group, direct_io=False, **options) as pipe:
        pipe.subscribe(seen.append)
        every = group.every
        for n, step in enumerate(steps, 1):
            state = _state(step)
            torch.manual_seed(step)  # the RNG state captured differs per step
            pipe.save(step, state, cp.TrainState(step=step, consumed_train_samples=step * 8,
                                                 extra={"tag": f"s{step}"})).result(60)
            saved[step] = _flat(state)
            if settle and n % every == 0:
                deadline = time.monotonic() + 60
                while not any(isinstance(e, cp.ShardUploaded) and e.step == step
                              for e in list(seen)):
                    assert time.monotonic() < deadline, seen
                    time.sleep(0.01)
    return saved


def test_promotes_every_mth_step_and_restores_after_every_local_root_is_lost(
    tmp_path: Path, tier: tuple[str, dict[str, Any] | None]
) -> None:
    events: list[cp.Event] = []
    saved = _save_steps(tmp_path / "local", tier, [10, 20, 30, 40, 50], events,
                        settle=True, every=2, keep_last=2)
    # Steps 20 and 40 were due (every 2nd commit), 50 at the clean close.
    assert _steps_in(*tier) == {20: True, 40: True, 50: True}
    persisted = [e.step for e in events if isinstance(e, cp.StepPersisted)]
    assert persisted == [20, 40, 50]
    assert all(not isinstance(e, cp.PersistFailed) for e in events)
    # The local tier kept only two steps; the persistent tier three (keep=3).
    assert sorted(p.name for p in (tmp_path / "local").glob("step-*")) == [
        "step-0000000040", "step-0000000050"]

    shutil.rmtree(tmp_path / "local")  # every local root is gone: a new node
    url, options = tier
    state = _state(999)
    torch.manual_seed(4321)
    restored: list[cp.Event] = []
    with cp.CheckpointPipeline(tmp_path / "local",
                               persistent=cp.PersistentConfig(url, options=options),
                               direct_io=False) as pipe:
        pipe.subscribe(restored.append)
        result = pipe.restore_latest(state)
    assert result is not None and result.step == 50 and result.downloaded == (0,)
    assert result.train_state.consumed_train_samples == 400
    assert result.train_state.extra == {"tag": "s50"}
    now = _flat(state)
    assert now.keys() == saved[50].keys()
    assert all(torch.equal(now[k], saved[50][k]) for k in now)
    torch.manual_seed(50)
    assert torch.equal(torch.get_rng_state(), _rng_after_seed(50))
    assert [type(e).__name__ for e in restored if isinstance(e, cp.ShardDownloaded)] == [
        "ShardDownloaded"]
    # The downloaded step is in the local root again: the next restore reads it from there.
    assert (tmp_path / "local" / "step-0000000050" / "rank-00000.commit").exists()


def _rng_after_seed(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.get_rng_state()


def test_a_restore_from_the_tier_reads_the_shard_while_it_downloads(
    tmp_path: Path, tier: tuple[str, dict[str, Any] | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load waits only for the bytes each read needs: its reads of the first parts return
    while later parts are still on their way (each part is announced 20 ms late here, so the
    order cannot be an accident), and the files are published once everything was read."""
    real_open = promote_mod.open_remote
    monkeypatch.setattr(promote_mod, "open_remote", lambda spec, **kw: real_open(
        spec, **{**kw, "part_bytes": 64 * 1024, "threads": 2}))
    saved = _save_steps(tmp_path / "local", tier, [10], settle=True)
    shutil.rmtree(tmp_path / "local")
    order: list[tuple[str, int]] = []
    landed, wait = ShardStream._landed, ShardStream.wait

    def slow_landed(self: ShardStream, index: int) -> None:
        time.sleep(0.02)
        landed(self, index)
        order.append(("landed", index))

    def logged_wait(self: ShardStream, start: int, end: int) -> None:
        wait(self, start, end)
        order.append(("read", start // self.shard.part_bytes))

    monkeypatch.setattr(ShardStream, "_landed", slow_landed)
    monkeypatch.setattr(ShardStream, "wait", logged_wait)
    url, options = tier
    state = _state(999)
    with cp.CheckpointPipeline(tmp_path / "local",
                               persistent=cp.PersistentConfig(url, options=options),
                               direct_io=False) as pipe:
        result = pipe.restore_latest(state)
    assert result is not None and result.step == 10 and result.downloaded == (0,)
    now = _flat(state)
    assert all(torch.equal(now[k], saved[10][k]) for k in now)
    parts = max(i for kind, i in order if kind == "landed") + 1
    assert parts >= 15, order  # a 1.3 MB shard in parts of 64 KiB
    # The header's parts first (the first and the last), then data reads as parts land:
    assert set([i for kind, i in order if kind == "landed"][:2]) == {0, parts - 1}
    first_data_read = order.index(next(e for e in order if e[0] == "read" and e[1] > 0))
    assert first_data_read < order.index(("landed", parts - 2)), order
    step_dir = tmp_path / "local" / "step-0000000010"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "rank-00000.commit", "rank-00000.manifest", "rank-00000.shard"]


@pytest.mark.slow
def test_persistent_keep_prunes_oldest_complete_steps_commit_object_first(
    tmp_path: Path, tier: tuple[str, dict[str, Any] | None]
) -> None:
    events: list[cp.Event] = []
    _save_steps(tmp_path / "local", tier, [1, 2, 3, 4, 5], events, settle=True,
                keep=2)
    assert _steps_in(*tier) == {4: True, 5: True}
    pruned = sorted(e.step for e in events if isinstance(e, cp.PersistPruned))
    assert pruned == [1, 2, 3]
    assert all(e.complete for e in events if isinstance(e, cp.PersistPruned))


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_corrupt_or_missing_object_falls_back_to_the_previous_persisted_step(
    tmp_path: Path, tier: tuple[str, dict[str, Any] | None], damage: str
) -> None:
    saved = _save_steps(tmp_path / "local", tier, [10, 20], settle=True)
    assert _steps_in(*tier) == {10: True, 20: True}
    url, options = tier
    remote = open_remote(url, options=options)
    key = "step-0000000020/rank-00000.shard"
    try:
        if damage == "corrupt":
            data = bytearray(remote.get_small(key, 1 << 30) or b"")
            data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
            remote.put_small(key, bytes(data))
        else:
            remote.delete([key])
    finally:
        remote.close()
    shutil.rmtree(tmp_path / "local")
    state = _state(999)
    with cp.CheckpointPipeline(tmp_path / "local",
                               persistent=cp.PersistentConfig(url, options=options),
                               direct_io=False) as pipe:
        result = pipe.restore_latest(state)
    assert result is not None and result.step == 10
    assert [r.step for r in result.rejected] == [20]
    reason = result.rejected[0].reason
    assert "rank-00000.shard" in reason, reason
    now = _flat(state)
    assert all(torch.equal(now[k], saved[10][k]) for k in now)
    # The failed download took everything it wrote off the disk again.
    assert not (tmp_path / "local" / "step-0000000020").exists()


def test_a_url_as_the_local_root_fails_at_open_and_points_to_persistent() -> None:
    with pytest.raises(cp.ConfigError) as info:
        cp.CheckpointPipeline("s3://bucket/run")
    assert "persistent=" in (info.value.hint or "")


@pytest.mark.slow
def test_throttled_puts_are_retried_and_the_step_persists(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]], fault_proxy: Any
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    proxy.fail("PUT", count=2, status=503)  # SlowDown, twice
    events: list[cp.Event] = []
    _save_steps(tmp_path / "local", (url, proxy.options), [10], events)
    assert _steps_in(url, options) == {10: True}
    assert [e.step for e in events if isinstance(e, cp.StepPersisted)] == [10]
    assert proxy.answered_faults == 2


@pytest.mark.slow
def test_failing_puts_end_in_an_event_and_leave_training_and_the_local_tier_alone(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]], fault_proxy: Any
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    # Every PUT of a step's objects, for good (the owner object, written at open, goes
    # through: a store that is down at open is another case).
    proxy.fail("PUT", count=None, status=500, match="step-")
    events: list[cp.Event] = []
    local = tmp_path / "local"
    _save_steps(local, (url, proxy.options), [10, 20], events, retries=1)
    failed = [e for e in events if isinstance(e, cp.PersistFailed)]
    assert {e.step for e in failed} == {10, 20}, events
    assert all("rank 0" in e.error for e in failed)
    assert not any(isinstance(e, cp.StepPersisted) for e in events)
    committed = [e.step for e in events if isinstance(e, cp.CheckpointCommitted)]
    assert committed == [10, 20]  # training went on; its saves committed
    assert not any(complete for complete in _steps_in(url, options).values())
    # The local tier is intact: a restore without the persistent tier finds step 20.
    with cp.CheckpointPipeline(local, direct_io=False) as pipe:
        result = pipe.restore_latest(_state(0))
    assert result is not None and result.step == 20


@pytest.mark.slow
def test_a_slow_tier_skips_promotions_instead_of_delaying_saves(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]], fault_proxy: Any
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    proxy.delay("PUT", seconds=0.3)
    events: list[cp.Event] = []
    _save_steps(tmp_path / "local", (url, proxy.options), list(range(1, 9)), events,
                on_close=False)
    skipped = [e.step for e in events if isinstance(e, cp.PersistSkipped)]
    persisted = [e.step for e in events if isinstance(e, cp.StepPersisted)]
    committed = [e.step for e in events if isinstance(e, cp.CheckpointCommitted)]
    assert committed == list(range(1, 9))
    assert skipped, events  # uploads are slower than saves here
    assert not set(skipped) & set(persisted)
    assert all("earlier promotion" in e.reason for e in events
               if isinstance(e, cp.PersistSkipped))


def test_credentials_reach_no_log_line_event_or_file(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    url, options = s3_url
    secret = options["secret_access_key"]
    events: list[cp.Event] = []
    caplog.set_level(logging.DEBUG, logger="ckpt_pipeline")  # every line the library writes
    with structlog.testing.capture_logs() as logs:
        _save_steps(tmp_path / "local", (url, options), [10], events)
        shutil.rmtree(tmp_path / "local")
        with cp.CheckpointPipeline(tmp_path / "local",
                                   persistent=cp.PersistentConfig(url, options=options),
                                   direct_io=False) as pipe:
            pipe.restore_latest(_state(0))
    lines = [f"{r.getMessage()} {r.__dict__}" for r in caplog.records
             if r.name.startswith("ckpt_pipeline")]  # ours; not the clients' own debug lines
    assert any("ckpt.persist" in line for line in lines)  # the tier's lines were captured
    text = json.dumps(logs, default=str) + repr(events) + "\n".join(lines)
    assert secret not in text and options["access_key_id"] not in text
    assert secret not in repr(cp.PipelineConfig(persistent=cp.PersistentConfig(url,
                                                                               options=options)))
    remote = open_remote(url, options=options)
    try:
        raw = remote.get_small(f"step-0000000010/{STEP_COMMIT}", 1 << 20)
        assert raw is not None and secret.encode() not in raw
        decode_step_record(raw, "test")
    finally:
        remote.close()
    for path in (tmp_path / "local").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes()


@pytest.mark.gpu
def test_cuda_state_restored_from_the_persistent_tier_onto_the_gpu(tmp_path: Path) -> None:
    """Every local root lost: the shard comes back from a shared directory, and the restore
    copies it to the GPU as a local one (bit-exact, on the device it was saved from)."""
    torch.manual_seed(0)
    state = {"w": torch.randn(4_000_000, device="cuda"),
             "b": torch.arange(1000, device="cuda", dtype=torch.int64)}
    saved = {k: v.cpu() for k, v in state.items()}
    tier = str(tmp_path / "shared")
    with cp.CheckpointPipeline(tmp_path / "local", persistent=tier) as pipe:
        pipe.save(7, state, cp.TrainState(step=7)).result(60)
    shutil.rmtree(tmp_path / "local")
    live = {"w": torch.zeros(4_000_000, device="cuda"),
            "b": torch.zeros(1000, device="cuda", dtype=torch.int64)}
    with cp.CheckpointPipeline(tmp_path / "local", persistent=tier) as pipe:
        result = pipe.restore_latest(live)
    assert result is not None and result.step == 7 and result.downloaded == (0,)
    assert all(v.is_cuda for v in live.values())
    assert all(torch.equal(live[k].cpu(), saved[k]) for k in saved)
