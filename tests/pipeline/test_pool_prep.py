"""The host buffers are made in the background before the first save asks for them
(``_pipeline/pool_prep``): from the newest step at open, or from the state a fresh job passes
to its first restore; then the first save finds its buffer made and allocates nothing."""

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


def test_a_restart_makes_the_buffer_at_open_from_its_newest_step(
        tmp_path: Path, reserved: LineWatch) -> None:
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        pipe.save(1, _state(1)).result(30)
    reserved.clear()
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        assert reserved.seen.wait(30)  # at open, before any restore
        assert reserved.fields[0]["source"] == "newest step"
        live = {k: torch.zeros_like(v) for k, v in _state().items()}
        assert pipe.restore_latest(live) is not None
        assert len(reserved.fields) == 1  # the restore's state asks for nothing more
        assert pipe.host_memory_bytes == align_up(_needed(live))


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


def test_a_step_saved_by_another_number_of_ranks_gives_no_size_at_open(
        tmp_path: Path) -> None:
    """A reshard's rank holds another share than the saved rank of its number: the size comes
    from the state it restores into, not from the saved step."""
    from ckpt_pipeline._pipeline.opening import newest_buffer_size
    from ckpt_pipeline.storage import LocalStorage

    state = _state(1)
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        pipe.save(1, state).result(30)
    roots = [LocalStorage(tmp_path / "root")]
    found = newest_buffer_size(roots, 0, 1)
    assert found is not None and found[0] >= _needed(state) and found[1] is False
    assert newest_buffer_size(roots, 0, 2) is None
