"""The host buffers are made in the background before the first save asks for them
(``_pipeline/pool_prep``): from the state passed to the first restore, once that restore is
done (a fresh job's restore finds nothing, a restart's loads a step; neither competes with the
making); then the first save finds its buffer made and allocates nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.layout import plan_layout
from ckpt_pipeline._format.region import align_up
from tests._support.logs import LineWatch, watching

pytestmark = pytest.mark.timeout(60)


def _state(step: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 256, generator=gen), "b": torch.arange(1000) + step}


@pytest.fixture
def reserved() -> Iterator[LineWatch]:
    with watching("ckpt.pool.reserved") as watch:
        yield watch


def _needed(state: dict[str, torch.Tensor]) -> int:
    return plan_layout(list(state.values())).buffer_bytes


def test_a_fresh_jobs_restore_makes_the_buffer_its_first_save_uses(
        tmp_path: Path, reserved: LineWatch) -> None:
    state = _state()
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        assert pipe.host_memory_bytes == 0
        assert pipe.restore_latest(state) is None  # nothing yet: the state gives the size
        assert reserved.seen.wait(30)
        assert reserved.fields == [{"rank": 0, "bytes": _needed(state),
                                    "source": "restore state"}]
        made = pipe.host_memory_bytes
        assert made == align_up(_needed(state))
        pipe.save(1, state).result(30)
        assert pipe.host_memory_bytes == made  # the first save allocated nothing


def test_a_restart_makes_the_buffer_once_its_restore_is_done(
        tmp_path: Path, reserved: LineWatch) -> None:
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        pipe.save(1, _state(1)).result(30)
    reserved.clear()
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        # nothing at open: the making would compete with the restore
        assert pipe.host_memory_bytes == 0 and not reserved.seen.is_set()
        live = {k: torch.zeros_like(v) for k, v in _state().items()}
        assert pipe.restore_latest(live) is not None
        assert reserved.seen.wait(30)
        assert reserved.fields == [{"rank": 0, "bytes": _needed(live),
                                    "source": "restore state"}]
        assert pipe.host_memory_bytes == align_up(_needed(live))
        pipe.save(2, live).result(30)
        assert pipe.host_memory_bytes == align_up(_needed(live))  # the save made none


def test_a_state_that_cannot_be_saved_asks_for_no_buffer(
        tmp_path: Path, reserved: LineWatch) -> None:
    bad = {"w": torch.ones(4), "f": object()}
    good = _state()
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        assert pipe.restore_latest(bad) is None
        with pytest.raises(cp.StateError):  # save() reports it, as without the buffers
            pipe.save(1, bad)
        assert pipe.restore_latest(good) is None
        assert reserved.seen.wait(30)
        assert [f["bytes"] for f in reserved.fields] == [_needed(good)]  # the first size


def test_close_waits_for_a_buffer_still_being_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that closes right after its restore: the making started by the restore ends
    before close() returns (a thread left inside torch's allocator at interpreter exit
    aborted the process)."""
    import threading

    from tests._support.gate import gated_buffer_making

    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        pipe.save(1, _state(1)).result(30)
    with gated_buffer_making(monkeypatch) as gate:
        pipe = cp.CheckpointPipeline(tmp_path / "root").open()
        assert pipe.restore_latest({k: torch.zeros_like(v) for k, v in _state().items()})
        assert gate.entered.wait(30)  # the making has started and is held
        closer = threading.Thread(target=pipe.close)
        closer.start()
        closer.join(0.5)
        assert closer.is_alive()  # close() waits for the making
        gate.opened.set()
        closer.join(30)
        assert not closer.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "ckpt-pool-reserve"]
