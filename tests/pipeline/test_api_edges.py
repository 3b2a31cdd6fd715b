"""Rough edges of the API that surprised users (issue 25): the explicit open, awaiting a
handle, numbers of other types in TrainState.extra, a retention policy returning a generator."""

from __future__ import annotations

import fractions
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import GatedStorage

pytestmark = pytest.mark.timeout(60)


def _steps(root: Path) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-"))


def test_open_returns_the_pipeline_and_errors_say_whether_it_was_opened(root: Path) -> None:
    pipe = cp.CheckpointPipeline(root)
    with pytest.raises(cp.PipelineClosedError, match="not opened yet") as caught:
        pipe.save(1, {"w": torch.ones(3)})
    assert "open()" in str(caught.value)
    assert pipe.open() is pipe
    try:
        assert pipe.save(1, {"w": torch.ones(3)}).result(30).step == 1
    finally:
        pipe.close()
    with pytest.raises(cp.PipelineClosedError, match=r"save\(\) after close\(\)"):
        pipe.save(2, {"w": torch.ones(3)})
    with pytest.raises(cp.PipelineClosedError, match="after close"):
        pipe.latest_step()


@pytest.mark.asyncio
async def test_a_handle_is_awaitable_in_the_async_face(root: Path) -> None:
    storage = GatedStorage(root)
    async with cp.AsyncCheckpointPipeline(root, storage=storage) as pipe:
        handle = await pipe.save(1, {"w": torch.ones(1000)})
        assert not handle.done()
        storage.gate.set()
        info = await handle
        assert info.step == 1 and info.tier == "disk"
        assert (await handle).step == 1  # settled: at once


def test_numbers_of_other_types_in_extra_are_kept_as_the_plain_numbers_they_equal(
        root: Path) -> None:
    class Loss(float):
        pass

    extra = {"loss": np.float64(0.25), "tokens": np.int64(10**12), "lr": np.float32(0.5),
             "sub": Loss(1.5)}
    with cp.CheckpointPipeline(root, retention=cp.KeepBest(1, metric="loss")) as pipe:
        for step, loss in ((1, 0.5), (2, 0.125), (3, 0.75)):
            pipe.save(step, {"w": torch.ones(3)},
                      cp.TrainState(step=step, extra={**extra, "loss": np.float64(loss)})
                      ).result(30)
        pipe.wait(30)
        assert _steps(root) == [2, 3]  # the best, and the newest (never pruned)
        result = pipe.restore_latest({"w": torch.zeros(3)})
    assert result is not None
    saved = result.train_state.extra
    assert saved == {"loss": 0.75, "tokens": 10**12, "lr": 0.5, "sub": 1.5}
    assert all(type(v) in (int, float) for v in saved.values())


def test_a_number_that_does_not_convert_exactly_is_refused_with_its_path(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.StateError,
                                                            match="extra/third"):
        pipe.save(1, {"w": torch.ones(3)},
                  cp.TrainState(step=1, extra={"third": fractions.Fraction(1, 3)}))


class _FirstOnly:
    """A custom policy whose keep() is a generator (consumed by a first membership test)."""

    def keep(self, steps: Sequence[int]):  # type: ignore[no-untyped-def]
        return (s for s in steps if s % 2 == 0)


def test_a_policy_returning_a_generator_is_taken_whole(root: Path) -> None:
    with cp.CheckpointPipeline(root, retention=_FirstOnly()) as pipe:  # type: ignore[arg-type]
        for step in range(1, 7):
            pipe.save(step, {"w": torch.ones(3)}).result(30)
        pipe.wait(30)
    assert _steps(root) == [2, 4, 6]


class _Bad:
    def keep(self, steps: Sequence[int]) -> object:
        return 3


def test_a_policy_returning_no_steps_fails_retention_and_prunes_nothing(root: Path) -> None:
    failed: list[cp.RetentionFailed] = []
    with cp.CheckpointPipeline(root, retention=_Bad()) as pipe:  # type: ignore[arg-type]
        pipe.subscribe(lambda e: failed.append(e) if isinstance(e, cp.RetentionFailed)
                       else None)
        for step in (1, 2, 3):
            pipe.save(step, {"w": torch.ones(3)}).result(30)
        pipe.wait(30)
    assert _steps(root) == [1, 2, 3]
    assert failed and "not the steps to keep" in failed[0].error


def _model_and_ema(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)


def test_restoring_a_subset_says_what_was_not_restored(root: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    model, ema = _model_and_ema(1)
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"model": model, "ema": ema}).result(30)
    fresh, _ = _model_and_ema(2)
    caplog.set_level("INFO", logger="ckpt_pipeline")
    with cp.CheckpointPipeline(root) as pipe:
        result = pipe.restore_latest({"model": fresh})
    assert result is not None and result.not_restored == ("ema",)
    assert result.not_in_checkpoint == ()
    assert torch.equal(fresh.weight, model.weight)
    assert any("ckpt.recovery.partial" in r.getMessage() and "ema" in r.getMessage()
               for r in caplog.records)


def test_a_state_that_grew_is_refused_unless_missing_is_keep(root: Path) -> None:
    model, _ = _model_and_ema(1)
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"model": model}).result(30)
    fresh, ema = _model_and_ema(2)
    ema_before = ema.weight.detach().clone()
    with cp.CheckpointPipeline(root) as pipe:
        with pytest.raises(cp.StateError, match="missing='keep'"):
            pipe.restore_latest({"model": fresh, "ema": ema})
        assert not torch.equal(fresh.weight, model.weight)  # nothing was applied
        result = pipe.restore_latest({"model": fresh, "ema": ema}, missing="keep")
        assert result is not None and result.not_in_checkpoint == ("ema",)
        with pytest.raises(cp.ConfigError, match="missing='drop'"):
            pipe.restore_latest({"model": fresh}, missing="drop")  # type: ignore[arg-type]
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(ema.weight, ema_before)  # left as it was
