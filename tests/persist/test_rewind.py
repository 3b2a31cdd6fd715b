"""A rewind (``restore(step=N)``) reaches the persistent tier: after it, whatever tier survives
a restart, the run resumes the newest step of its current timeline, never a step it abandoned.

One process, a persistent tier that is a directory (and S3 on the moto server for the main
case): save 1-6 and promote each, rewind to 3, then restart with the local root intact or lost.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.documents import decode_rewinds
from ckpt_pipeline._tiers.persistent import rewinding as rewinding_mod
from ckpt_pipeline._tiers.persistent.layout import STEP_COMMIT
from ckpt_pipeline._tiers.persistent.retries import RemoteError
from ckpt_pipeline._tiers.persistent.rewinds import TIER_REWINDS
from ckpt_pipeline._tiers.persistent.urls import open_remote
from ckpt_pipeline.testing import CRASH_ENV
from tests._support.children import run_child
from tests._support.cli import run_cli

Tier = tuple[str, "dict[str, Any] | None"]


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((1000,), value), "meta": {"v": value}}


def _open(root: Path, tier: Tier, **options: Any) -> cp.CheckpointPipeline:
    url, fs_options = tier
    group = cp.PersistentConfig(url, options=fs_options, every=1, keep=None)
    return cp.CheckpointPipeline(root, persistent=group, direct_io=False, keep_last=10,
                                 **options)


def _save(pipe: cp.CheckpointPipeline, step: int, value: float, seen: list[cp.Event]) -> None:
    """Save ``step`` and wait until its upload ended, so that no promotion is skipped (the
    next commit vote, or the close, completes it in the tier)."""
    pipe.save(step, _state(value), cp.TrainState(step=step)).result(60)
    deadline = time.monotonic() + 60
    while not any(isinstance(e, cp.ShardUploaded) and e.step == step for e in list(seen)):
        assert time.monotonic() < deadline, seen
        time.sleep(0.01)


def _first_timeline(root: Path, tier: Tier) -> None:
    """Steps 1-6 (value = step), each complete in the tier."""
    with _open(root, tier) as pipe:
        seen: list[cp.Event] = []
        pipe.subscribe(seen.append)
        for step in range(1, 7):
            _save(pipe, step, float(step), seen)


def _rewind_and_save_new_4(root: Path, tier: Tier) -> None:
    with _open(root, tier) as pipe:
        seen: list[cp.Event] = []
        pipe.subscribe(seen.append)
        state = _state(0.0)
        result = pipe.restore(state, step=3)
        assert result is not None and result.step == 3
        _save(pipe, 4, 40.0, seen)  # the new timeline's step 4


def _restore_latest(root: Path, tier: Tier) -> tuple[int, float]:
    state = _state(-1.0)
    with _open(root, tier) as pipe:
        result = pipe.restore_latest(state)
    assert result is not None
    return result.step, float(state["w"][0])


def _complete_in_tier(tier: Tier) -> list[int]:
    remote = open_remote(tier[0], options=tier[1])
    try:
        return sorted(int(n.split("-")[1]) for n in remote.list_steps()
                      if STEP_COMMIT in remote.list_dir(n))
    finally:
        remote.close()


@pytest.fixture
def dir_tier(tmp_path: Path) -> Tier:
    return str(tmp_path / "shared" / "run"), None


@pytest.fixture(params=["dir", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param == "dir":
        return str(tmp_path / "shared" / "run"), None
    url, options = request.getfixturevalue("s3_url")
    return url, options


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_after_a_rewind_and_a_new_save_the_new_step_is_restored_whatever_tier_survives(
    tmp_path: Path, tier: Tier
) -> None:
    root = tmp_path / "local"
    _first_timeline(root, tier)
    _rewind_and_save_new_4(root, tier)
    # The tier holds 1-3 and the new 4: the abandoned 4-6 are off it.
    assert _complete_in_tier(tier) == [1, 2, 3, 4]
    assert _restore_latest(root, tier) == (4, 40.0)  # the local root intact
    shutil.rmtree(root)
    assert _restore_latest(root, tier) == (4, 40.0)  # only the tier: downloaded


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_rewind_closed_without_a_new_save_resumes_the_rewind_point_from_the_tier(
    tmp_path: Path, dir_tier: Tier
) -> None:
    root = tmp_path / "local"
    _first_timeline(root, dir_tier)
    with _open(root, dir_tier) as pipe:
        assert pipe.restore(_state(0.0), step=3) is not None
    remote = open_remote(dir_tier[0])
    try:
        raw = remote.get_small(TIER_REWINDS, 1 << 20)
    finally:
        remote.close()
    assert raw is not None
    (rewind,) = decode_rewinds(raw, TIER_REWINDS)
    assert (rewind.step, [s for s, _ in rewind.abandoned]) == (3, [4, 5, 6])
    assert _restore_latest(root, dir_tier) == (3, 3.0)
    shutil.rmtree(root)
    assert _restore_latest(root, dir_tier) == (3, 3.0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_process_killed_right_after_the_rewind_resumes_the_rewind_point_whatever_survives(
    tmp_path: Path, dir_tier: Tier
) -> None:
    """SIGKILL once the rewind is recorded in every tier, before any step is moved aside."""
    root = tmp_path / "local"
    _first_timeline(root, dir_tier)
    done = run_child("rewind_child.py", root, dir_tier[0], 3, timeout=90,
                     env={CRASH_ENV: "restore.rewind_recorded"})
    assert done.returncode == -9, done.stderr
    assert (root / "step-0000000006").exists()  # not moved aside: killed before that
    assert cp.load(root).step == 3
    shown = run_cli("show", root, "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["step"] == 3, shown.stderr
    rows = {r["step"]: r for r in _rows(run_cli("ls", root, "--json").stdout)}
    assert all("abandoned by a rewind" in str(rows[s]["reason"]) for s in (4, 5, 6))
    assert rows[3]["reason"] is None
    assert _restore_latest(root, dir_tier) == (3, 3.0)  # the local root intact
    shutil.rmtree(root)
    assert _restore_latest(root, dir_tier) == (3, 3.0)  # only the tier


@pytest.mark.timeout(120)
def test_a_rewind_while_the_tier_is_unreachable_is_kept_pending_and_recorded_at_the_next_open(
    tmp_path: Path, dir_tier: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "local"
    _first_timeline(root, dir_tier)
    real = rewinding_mod.record_rewinds

    def unreachable(*_: Any) -> Any:
        raise RemoteError("injected: the tier cannot be reached", path=dir_tier[0])

    monkeypatch.setattr(rewinding_mod, "record_rewinds", unreachable)
    with _open(root, dir_tier) as pipe:
        assert pipe.restore(_state(0.0), step=3) is not None  # bounded: returns all the same
    # The tier still has the abandoned steps, but the local record hides them.
    assert _complete_in_tier(dir_tier) == [1, 2, 3, 4, 5, 6]
    assert cp.load(root).step == 3
    monkeypatch.setattr(rewinding_mod, "record_rewinds", real)
    # The tier is back: the next open records the pending rewind there.
    assert _restore_latest(root, dir_tier) == (3, 3.0)
    assert _complete_in_tier(dir_tier) == [1, 2, 3]
    shutil.rmtree(root)
    assert _restore_latest(root, dir_tier) == (3, 3.0)


@pytest.mark.timeout(120)
def test_cp_load_and_show_of_the_tier_skip_steps_its_rewind_record_abandons(
    tmp_path: Path, dir_tier: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rewind recorded in the tier, its abandoned commit objects not yet removed (as after
    a crash between the two): readers of the URL still never pick them as the newest."""
    root = tmp_path / "local"
    _first_timeline(root, dir_tier)

    def crash(*_: Any) -> Any:
        raise RemoteError("injected: lost before the commit objects went", path=dir_tier[0])

    monkeypatch.setattr(rewinding_mod, "drop_commit_objects", crash)
    with _open(root, dir_tier) as pipe:
        assert pipe.restore(_state(0.0), step=3) is not None
    assert _complete_in_tier(dir_tier) == [1, 2, 3, 4, 5, 6]
    url = f"file://{dir_tier[0]}"
    loaded = cp.load(url)
    assert loaded.step == 3 and float(loaded.tree["w"][0]) == 3.0
    assert cp.load(url, step=6).step == 6  # asked for by number, it still loads
    assert cp.load(dir_tier[0]).step == 3  # the directory read as a root: the same
    for where in (url, dir_tier[0]):
        shown = run_cli("show", where, "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["step"] == 3


@pytest.mark.timeout(120)
def test_ls_labels_rewound_steps_and_retention_removes_them_once_the_new_timeline_passes(
    tmp_path: Path, dir_tier: Tier
) -> None:
    root = tmp_path / "local"
    _first_timeline(root, dir_tier)
    with _open(root, dir_tier) as pipe:
        events: list[cp.Event] = []
        pipe.subscribe(events.append)
        assert pipe.restore(_state(0.0), step=3) is not None
        (rewound,) = [e for e in events if isinstance(e, cp.CheckpointRewound)]
        assert (rewound.step, rewound.abandoned, rewound.timeline) == (3, (4, 5, 6), 1)
        assert Path(rewound.path) == root / "rewind-0000000001-r00000"
        listed = run_cli("ls", root, "--json")
        assert listed.returncode == 0, listed.stderr
        rows = _rows(listed.stdout)
        assert {r["step"]: r["status"] for r in rows if r["status"] != "complete"} == {
            4: "rewound", 5: "rewound", 6: "rewound"}
        assert all("rewind to step 3" in r["reason"] for r in rows
                   if r["status"] == "rewound")
        assert len(list(root.glob("step-*.rewound-0000000003-r00000-*"))) == 3
        seen: list[cp.Event] = []
        pipe.subscribe(seen.append)
        _save(pipe, 4, 40.0, seen)
        pipe.wait(60)  # retention runs after result(): wait() returns once it is done
        # Step 4 of the new timeline is committed on every rank: the rewound steps go.
        assert list(root.glob("step-*.rewound-*")) == []
        pruned = sorted(e.step for e in seen if isinstance(e, cp.CheckpointPruned))
        assert pruned == [4, 5, 6]
    assert sorted(p.name for p in root.glob("step-*")) == [
        f"step-000000000{s}" for s in (1, 2, 3, 4)]


def _rows(text: str) -> list[dict[str, Any]]:
    doc = json.loads(text)
    rows = doc["steps"] if isinstance(doc, dict) else doc
    assert isinstance(rows, list)
    return rows
