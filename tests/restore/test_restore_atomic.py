"""A failed restore changes nothing.

Every case saves a checkpoint, builds a live state that does not fit it (or that fails while
it is loaded), and checks that ``restore_latest`` raises a ``CheckpointError`` with a useful
message and leaves the live state bit-identical: every tensor byte for byte (module parameters
and buffers, optimizer state, scheduler state, plain tensors), the same tensor and container
objects, and the RNG states (torch, Python, NumPy). The checkpoint's values differ from the live
ones everywhere, so any entry written before the failure would show.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import tempfile
from collections import namedtuple
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ckpt_pipeline as cp
import ckpt_pipeline._restore.recovery as restore_module
from ckpt_pipeline._restore.apply import apply_state
from ckpt_pipeline._restore.validate import validate_state
from ckpt_pipeline._tree import flatten_state
from ckpt_pipeline.train_state import RNGState
from tests._support.children import child_script, load_script, spawn_child

WORKER = child_script("restore_atomic_worker.py")


# ---------------------------------------------------------------- live states

def make_model(seed: int, *, out: int = 4, bias: bool = True,
               dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, out, bias=bias)).to(dtype)


def train(model: nn.Module, opt: torch.optim.Optimizer,
          sched: Any = None, seed: int = 0) -> None:
    """One optimizer step, so that the optimizer has state."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    opt.zero_grad()
    model(torch.randn(8, 16, generator=g).to(dtype)).pow(2).mean().backward()
    opt.step()
    if sched is not None:
        sched.step()


def make_state(seed: int, *, model: nn.Module | None = None,
               groups: Callable[[nn.Module], Any] | None = None,
               scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
               **extra: Any) -> dict[str, Any]:
    """A plain tensor first (so that it would be written first), then a trained model, its
    AdamW and a scheduler, then ``extra`` entries."""
    model = make_model(seed) if model is None else model
    params = model.parameters() if groups is None else groups(model)
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = (torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
             if scheduler is None else scheduler(opt))
    train(model, opt, sched, seed)
    return {"w": torch.full((64,), float(seed)), "model": model, "optimizer": opt,
            "scheduler": sched, **extra}


Flaky = load_script(WORKER).Flaky


# ---------------------------------------------------------------- bit-exact comparison

def _bytes(t: torch.Tensor) -> tuple[Any, ...]:
    if type(t).__name__ == "DTensor":
        t = t.to_local()  # type: ignore[attr-defined]
    t = t.detach()
    head = (str(t.dtype), tuple(t.shape), t.device.type)
    if t.device.type == "meta":
        return head
    if t.layout != torch.strided:
        t = t.to_dense()
    flat = t.cpu().contiguous().reshape(-1)
    return (*head, bytes(flat.view(torch.uint8).numpy().tobytes()))


def freeze(obj: Any, depth: int = 0) -> Any:
    """A value that compares equal only for bit-identical states."""
    assert depth < 50
    if isinstance(obj, torch.Tensor):
        return ("tensor", _bytes(obj))
    if isinstance(obj, nn.Module):
        return ("module", type(obj).__name__,
                [(k, _bytes(v)) for k, v in obj.named_parameters()],
                [(k, _bytes(v)) for k, v in obj.named_buffers()],
                freeze(dict(obj.state_dict()), depth + 1))
    if callable(getattr(obj, "state_dict", None)) and not isinstance(obj, dict):
        return ("stateful", type(obj).__name__, freeze(obj.state_dict(), depth + 1))
    if isinstance(obj, dict):
        return (type(obj).__name__, [(k, freeze(v, depth + 1)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [freeze(v, depth + 1) for v in obj])
    if isinstance(obj, float):
        return ("float", obj.hex())
    return obj


def objects(obj: Any, out: list[Any] | None = None) -> list[Any]:
    """The live objects a restore must keep (tensors, containers, module parameters)."""
    out = [] if out is None else out
    out.append(obj)
    if isinstance(obj, nn.Module):
        out.extend(obj.parameters())
        out.extend(obj.buffers())
    elif isinstance(obj, dict):
        for value in obj.values():
            objects(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            objects(value, out)
    return out


def rng_states() -> tuple[Any, ...]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return (bytes(torch.get_rng_state().numpy().tobytes()), random.getstate(),
            (name, keys.tobytes(), pos, has_gauss, cached))


class Snapshot:
    def __init__(self, state: dict[str, Any]) -> None:
        self.values = freeze(state)
        self.objects = objects(state)
        self.rng = rng_states()

    def assert_unchanged(self, state: dict[str, Any]) -> None:
        assert rng_states() == self.rng, "the RNG states changed"
        after = objects(state)
        assert len(after) == len(self.objects), "the live structure changed"
        for before, now in zip(self.objects, after):
            assert before is now, f"{type(before).__name__} replaced by {type(now).__name__}"
        assert freeze(state) == self.values, "the live values changed"


def save(root: Path, state: dict[str, Any], step: int = 10) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(step, state, cp.TrainState(step=step)).result(30)


def seed_rngs(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def restore_fails(root: Path, live: dict[str, Any], match: str,
                  kind: type[cp.CheckpointError] = cp.StateError) -> cp.CheckpointError:
    """Restore into ``live``: it must raise ``kind`` matching ``match`` and change nothing."""
    seed_rngs(1234)  # the RNG states differ from those saved
    before = Snapshot(live)
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(kind, match=match) as info:
        pipe.restore_latest(live)
    before.assert_unchanged(live)
    assert isinstance(info.value, cp.CheckpointError)
    return info.value


@pytest.fixture
def saved(root: Path) -> Path:
    """Step 10 of ``make_state(1)`` plus a Flaky entry, saved with seeded RNG states."""
    seed_rngs(1)
    save(root, make_state(1, custom=Flaky(1.0)))
    return root


# ---------------------------------------------------------------- modules

def test_module_with_a_different_layer_shape(saved: Path) -> None:
    live = make_state(2, model=make_model(2, out=5), custom=Flaky(2.0))
    error = restore_fails(saved, live, r"saved tensor is torch\.float32\[4, 32\], the live one "
                                       r"torch\.float32\[5, 32\]")
    assert error.path == "model/2.weight" and error.step == 10


def test_module_with_an_extra_parameter(saved: Path) -> None:
    model = make_model(2)
    model[2].register_parameter("scale", nn.Parameter(torch.ones(4)))
    live = make_state(2, model=model, custom=Flaky(2.0))
    error = restore_fails(saved, live, r"checkpoint lacks 1 key\(s\) of the module: \['2\.scale'\]")
    assert error.path == "model"


def test_module_missing_a_parameter(saved: Path) -> None:
    live = make_state(2, model=make_model(2, bias=False), custom=Flaky(2.0))
    restore_fails(saved, live, r"has 1 key\(s\) the module does not: \['2\.bias'\]")


def test_module_with_an_extra_buffer(saved: Path) -> None:
    model = make_model(2)
    model[0].register_buffer("seen", torch.zeros(3))
    live = make_state(2, model=model, custom=Flaky(2.0))
    restore_fails(saved, live, r"lacks 1 key\(s\) of the module: \['0\.seen'\]")


def test_module_of_another_dtype(saved: Path) -> None:
    live = make_state(2, model=make_model(2, dtype=torch.float64), custom=Flaky(2.0))
    error = restore_fails(saved, live, r"saved tensor is torch\.float32\[32, 16\], the live one "
                                       r"torch\.float64\[32, 16\]")
    assert error.path == "model/0.weight"


def test_module_on_the_meta_device(saved: Path) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    live = {"w": torch.zeros(64), "model": model}
    error = restore_fails(saved, live, "meta device")
    assert error.hint is not None and "to_empty" in error.hint


def test_module_made_under_inference_mode(saved: Path) -> None:
    with torch.inference_mode():
        model = make_model(2)
    live = {"w": torch.zeros(64), "model": model}
    restore_fails(saved, live, "inference tensor")


# ---------------------------------------------------------------- optimizers and schedulers

def test_optimizer_with_another_number_of_param_groups(saved: Path) -> None:
    def two_groups(model: nn.Module) -> Any:
        return [{"params": model[0].parameters()}, {"params": model[2].parameters()}]

    live = make_state(2, groups=two_groups, custom=Flaky(2.0))
    error = restore_fails(saved, live, r"optimizer has 2 parameter group\(s\), the checkpoint 1")
    assert error.path == "optimizer/param_groups"


def test_optimizer_with_another_number_of_params_in_a_group(saved: Path) -> None:
    live = make_state(2, groups=lambda m: list(m.parameters())[:3], custom=Flaky(2.0))
    restore_fails(saved, live, r"parameter group 0 of the optimizer has 3 parameter\(s\), the "
                               r"checkpoint's 4")


def test_optimizer_with_state_of_another_shape(root: Path) -> None:
    saved_model = make_model(1, out=5)
    opt = torch.optim.AdamW(saved_model.parameters(), lr=1e-2)
    train(saved_model, opt)
    save(root, {"w": torch.ones(64), "optimizer": opt})
    model = make_model(2)  # the same number of parameters, other shapes
    live_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, live_opt)
    error = restore_fails(root, {"w": torch.zeros(64), "optimizer": live_opt},
                          r"saved tensor is torch\.float32\[5, 32\], the live one "
                          r"torch\.float32\[4, 32\]")
    assert error.path == "optimizer/state/2/exp_avg"


def test_scheduler_of_another_type(saved: Path) -> None:
    live = make_state(2, scheduler=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 7),
                      custom=Flaky(2.0))
    error = restore_fails(saved, live, r"CosineAnnealingLR does not match the checkpoint: the "
                                       r"checkpoint lacks \['T_max', 'eta_min'\]")
    assert error.path == "scheduler"


# ---------------------------------------------------------------- plain containers

@pytest.fixture
def saved_dict(root: Path) -> Path:
    save(root, {"a": torch.ones(8), "b": [torch.ones(2, 2), 7],
                "c": {"x": torch.ones(3), "y": torch.ones(5), "z": torch.ones(4)}})
    return root


def _plain_live() -> dict[str, Any]:
    return {"a": torch.zeros(8), "b": [torch.zeros(2, 2), 0],
            "c": {"x": torch.zeros(3), "y": torch.zeros(5), "z": torch.zeros(4)}}


def test_dict_missing_a_key_in_the_last_entry(saved_dict: Path) -> None:
    live = _plain_live()
    live["c"]["q"] = torch.zeros(2)
    error = restore_fails(saved_dict, live, "the checkpoint has no key 'q'")
    assert error.path == "c"


def test_dict_with_a_wrong_shape_in_the_last_entry(saved_dict: Path) -> None:
    live = _plain_live()
    live["c"]["z"] = torch.zeros(2, 2)
    error = restore_fails(saved_dict, live, r"torch\.float32\[4\], the live one "
                                            r"torch\.float32\[2, 2\]")
    assert error.path == "c/z"


def test_list_of_another_length(saved_dict: Path) -> None:
    live = _plain_live()
    live["b"].append(1)
    restore_fails(saved_dict, live, "a list of 3 here, the checkpoint a list of 2")


def _expanded() -> torch.Tensor:
    return torch.zeros(1).expand(4)


def _inference() -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(4)


def _meta() -> torch.Tensor:
    return torch.empty(4, device="meta")


def _sparse() -> torch.Tensor:
    return torch.zeros(4).to_sparse()


def _overlapping_view() -> torch.Tensor:
    return torch.zeros(8).as_strided((2, 2), (1, 1))  # elements 1 and 2 are one


@pytest.mark.parametrize(("make", "match"), [
    (_overlapping_view, "elements share memory"),
    (_inference, "inference tensor"),
    (_meta, "meta device"),
    (_sparse, "sparse_coo tensor"),
], ids=["overlapping-view", "inference", "meta", "sparse"])
@pytest.mark.slow
def test_live_tensor_that_cannot_receive_data_in_place(saved_dict: Path,
                                                       make: Callable[[], torch.Tensor],
                                                       match: str) -> None:
    live = _plain_live()
    live["c"]["z"] = make()
    error = restore_fails(saved_dict, live, match)
    assert error.path == "c/z"


def test_expanded_live_tensor_whose_saved_values_differ_along_the_expansion(
        root: Path) -> None:
    save(root, {"a": torch.ones(8), "b": [torch.ones(2, 2), 7],
                "c": {"x": torch.ones(3), "y": torch.ones(5), "z": torch.arange(4.0)}})
    live = _plain_live()
    live["c"]["z"] = _expanded()
    error = restore_fails(root, live, "expanded .* the checkpoint's values differ along")
    assert error.path == "c/z"


def test_live_tensor_of_another_dtype(saved_dict: Path) -> None:
    live = _plain_live()
    live["c"]["z"] = torch.zeros(4, dtype=torch.float16)
    restore_fails(saved_dict, live, r"torch\.float32\[4\], the live one torch\.float16\[4\]")


def test_live_tensor_where_the_checkpoint_holds_a_map(saved_dict: Path) -> None:
    live = _plain_live()
    live["c"] = torch.zeros(3)
    restore_fails(saved_dict, live, "tensor here, the checkpoint a map")


# ---------------------------------------------------------------- failures while applying

def test_stateful_object_that_fails_half_way_is_rolled_back_with_everything_before(
        saved: Path) -> None:
    live = make_state(2, custom=Flaky(2.0, fail=True))
    error = restore_fails(saved, live, "injected: version 1, this object takes version 2")
    assert error.path == "custom"
    assert "live state is as it was" in str(error)


def test_rolled_back_optimizer_holds_its_own_state_objects_again(saved: Path) -> None:
    live = make_state(2, custom=Flaky(2.0, fail=True))
    opt = live["optimizer"]
    state, groups = opt.state, opt.param_groups
    tensors = [t for entry in state.values() for t in entry.values()]
    restore_fails(saved, live, "injected")
    assert opt.state is state and opt.param_groups is groups
    assert [t for entry in opt.state.values() for t in entry.values()] == tensors


def test_optimizer_with_load_hooks_is_rolled_back_through_load_state_dict(
        saved: Path) -> None:
    live = make_state(2, custom=Flaky(2.0, fail=True))
    loads: list[int] = []
    live["optimizer"].register_load_state_dict_post_hook(lambda opt: loads.append(1))
    restore_fails(saved, live, "injected")
    assert len(loads) == 2, "loaded from the checkpoint, then from its own copy"


class Broken(Flaky):
    """Changes part of itself and raises on every load, its own state's included."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buf.copy_(state["buf"])
        raise RuntimeError("injected: broken for good")


def test_object_that_cannot_be_rolled_back_is_reported_and_the_rest_is_rolled_back(
        saved: Path) -> None:
    live = make_state(2, custom=Broken(2.0))
    rest = {k: v for k, v in live.items() if k != "custom"}
    before = Snapshot(rest)
    with cp.CheckpointPipeline(saved) as pipe, pytest.raises(cp.RestoreError) as info:
        pipe.restore_latest(live)
    assert "rolling back the restore of step 10 failed for 1 entry (custom:" in str(info.value)
    assert "the live state is partly loaded" in str(info.value)
    before.assert_unchanged(rest)


def test_failure_in_rng_apply_rolls_everything_back(saved: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    original = RNGState.apply
    calls: list[int] = []

    def failing_apply(self: RNGState) -> None:
        calls.append(1)
        if len(calls) == 1:  # the restore's: set some generators, then fail
            random.seed(99)
            torch.manual_seed(99)
            raise RuntimeError("injected: RNG state rejected")
        original(self)  # the rollback's

    monkeypatch.setattr(RNGState, "apply", failing_apply)
    live = make_state(2, custom=Flaky(2.0))
    error = restore_fails(saved, live, "restoring the RNG states failed", cp.RestoreError)
    assert "injected" in error.message and len(calls) == 2


def test_another_ranks_failed_apply_rolls_this_rank_back(saved: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    original = restore_module.agree_outcome

    async def other_rank_failed(coordinator: Any, step: int, save_id: str, error: str | None,
                                *, what: str, fatal: bool = False
                                ) -> tuple[dict[int, str], bool]:
        failures, any_fatal = await original(coordinator, step, save_id, error, what=what,
                                             fatal=fatal)
        if what == "restore apply":
            failures[1] = "injected: rank 1 could not load"
        return failures, any_fatal

    monkeypatch.setattr(restore_module, "agree_outcome", other_rank_failed)
    live = make_state(2, custom=Flaky(2.0))
    restore_fails(saved, live, r"failed on rank\(s\) \[1\]: rank 1: injected", cp.RestoreError)


def test_failed_final_barrier_rolls_back(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken_barrier(coordinator: Any, *, what: str, step: int | None = None) -> None:
        raise cp.CoordinationError(f"{what}: injected: a rank vanished", step=step)

    monkeypatch.setattr(restore_module, "agree_barrier", broken_barrier)
    live = make_state(2, custom=Flaky(2.0))
    restore_fails(saved, live, "injected: a rank vanished", cp.CoordinationError)


def test_async_pipeline_rolls_back_too(saved: Path) -> None:
    live = make_state(2, custom=Flaky(2.0, fail=True))
    seed_rngs(5)
    before = Snapshot(live)

    async def main() -> None:
        async with cp.AsyncCheckpointPipeline(saved) as pipe:
            with pytest.raises(cp.StateError, match="injected"):
                await pipe.restore_latest(live)

    anyio.run(main)
    before.assert_unchanged(live)


def test_restore_after_a_rolled_back_one_loads_everything(saved: Path) -> None:
    seed_rngs(1)
    expected = make_state(1, custom=Flaky(1.0))
    expected_rng = rng_states()
    live = make_state(2, custom=Flaky(2.0, fail=True))
    with cp.CheckpointPipeline(saved) as pipe:
        with pytest.raises(cp.StateError):
            pipe.restore_latest(live)
        live["custom"].version = 1
        result = pipe.restore_latest(live)
    assert result is not None and result.step == 10
    assert freeze(live) == freeze(expected)
    assert rng_states() == expected_rng


# ---------------------------------------------------------------- tuples and namedtuples

class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


Config = namedtuple("Config", ["lr", "name"])


def test_tuples_hold_their_tensors_in_place_and_namedtuples_keep_their_type(root: Path) -> None:
    save(root, {"pair": (torch.ones(3), torch.full((2,), 2.0)), "cfg": (0.5, "run"),
                "plain": ("x", 1), "mixed": (torch.ones(2), "a")})
    first, second, mixed = torch.zeros(3), torch.zeros(2), torch.zeros(2)
    live = {"pair": Pair(first, second), "cfg": Config(0.0, ""), "plain": (),
            "mixed": (mixed, "b")}
    pair = live["pair"]
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert live["pair"] is pair, "only tensors changed: the namedtuple is kept"
    assert torch.equal(first, torch.ones(3)) and torch.equal(second, torch.full((2,), 2.0))
    assert live["cfg"] == Config(0.5, "run") and type(live["cfg"]) is Config
    assert live["plain"] == ("x", 1)
    assert live["mixed"] == (mixed, "a") and live["mixed"][0] is mixed
    assert torch.equal(mixed, torch.ones(2))


def test_namedtuple_of_another_length_is_refused(root: Path) -> None:
    save(root, {"w": torch.ones(4), "cfg": (0.5, "run", 3)})
    restore_fails(root, {"w": torch.zeros(4), "cfg": Config(0.0, "")},
                  "a Config of 2 here, the checkpoint a tuple of 3")


def test_rolled_back_tuple_slots_get_their_old_tuples(root: Path) -> None:
    save(root, {"cfg": (0.5, "run"), "mixed": (torch.ones(2), "a"), "custom": Flaky(1.0)})
    live = {"cfg": Config(0.0, ""), "mixed": (torch.zeros(2), "b"),
            "custom": Flaky(2.0, fail=True)}
    restore_fails(root, live, "injected")


# ---------------------------------------------------------------- the apply API itself

def test_applied_state_undoes_and_reports_its_backup_size() -> None:
    saved = {"t": torch.ones(100), "d": {"x": torch.ones(3)}, "m": make_model(1)}
    flat = flatten_state(saved, step=1)
    live = {"t": torch.zeros(100), "d": {"x": torch.zeros(3)}, "m": make_model(2)}
    before = Snapshot(live)
    tensors = [t.clone() for t in flat.tensors]
    validate_state(live, flat.skeleton, tensors, step=1)
    applied = apply_state(live, flat.skeleton, tensors, step=1)
    assert torch.equal(live["t"], torch.ones(100))
    params = sum(p.numel() for p in live["m"].parameters())
    assert applied.backup_bytes == 4 * (100 + 3 + params)
    applied.undo()
    before.assert_unchanged(live)
    applied.undo()  # a second undo has nothing left to do
    before.assert_unchanged(live)


def test_checkpoint_keys_absent_from_a_live_dict_are_added_and_removed_on_rollback(
        root: Path) -> None:
    save(root, {"d": {"x": torch.ones(2), "new": torch.ones(3), "n": 5}, "custom": Flaky(1.0)})
    live = {"d": {"x": torch.zeros(2)}, "custom": Flaky(2.0, fail=True)}
    restore_fails(root, live, "injected")
    assert list(live["d"]) == ["x"]
    live["custom"].version = 1
    with cp.CheckpointPipeline(root) as pipe:
        pipe.restore_latest(live)
    assert sorted(live["d"]) == ["n", "new", "x"] and live["d"]["n"] == 5


# ---------------------------------------------------------------- property: random mismatches

DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.bool)


@st.composite
def tensor_specs(draw: st.DrawFn) -> tuple[tuple[int, ...], torch.dtype]:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    return shape, draw(st.sampled_from(DTYPES))


def _spec_trees() -> st.SearchStrategy[dict[str, Any]]:
    keys = st.text("abcdefgh", min_size=1, max_size=3)
    leaf = tensor_specs()
    tree = st.recursive(leaf, lambda inner: st.dictionaries(keys, inner, min_size=1,
                                                            max_size=3), max_leaves=8)
    return st.dictionaries(keys, tree, min_size=1, max_size=4)


def _paths(spec: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield prefix, spec
    if isinstance(spec, dict):
        for key, value in spec.items():
            yield from _paths(value, (*prefix, key))


def _realize(spec: Any, g: torch.Generator) -> Any:
    if isinstance(spec, dict):
        return {k: _realize(v, g) for k, v in spec.items()}
    if isinstance(spec, nn.Module):
        return spec
    shape, dtype = spec
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _module(seed: int, extra_buffer: bool) -> nn.Module:
    torch.manual_seed(seed)
    module = nn.Linear(3, 2)
    if extra_buffer:
        module.register_buffer("extra", torch.zeros(2))
    return module


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=_spec_trees(), with_module=st.booleans(), data=st.data(),
       kind=st.sampled_from(["shape", "dtype", "missing-key", "module-extra-key"]))
@pytest.mark.slow
def test_random_mismatch_leaves_the_live_state_bit_identical(
        spec: dict[str, Any], with_module: bool, kind: str, data: st.DataObject) -> None:
    saved_spec: dict[str, Any] = dict(spec)
    live_spec: dict[str, Any] = _copy_spec(spec)
    if with_module or kind == "module-extra-key":
        saved_spec["net"] = _module(1, extra_buffer=False)
        live_spec["net"] = _module(2, extra_buffer=kind == "module-extra-key")
    if kind in ("shape", "dtype"):
        leaves = [p for p, v in _paths(spec) if isinstance(v, tuple)]
        path = data.draw(st.sampled_from(leaves))
        parent = live_spec
        for key in path[:-1]:
            parent = parent[key]
        shape, dtype = parent[path[-1]]
        if kind == "shape":
            parent[path[-1]] = ((*shape, 2), dtype)
        else:
            parent[path[-1]] = (shape, DTYPES[(DTYPES.index(dtype) + 1) % len(DTYPES)])
    elif kind == "missing-key":
        maps = [p for p, v in _paths(spec) if isinstance(v, dict)]
        path = data.draw(st.sampled_from(maps))
        parent = live_spec
        for key in path:
            parent = parent[key]
        parent["zz-not-saved"] = ((2,), torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        save(root, _realize(saved_spec, torch.Generator().manual_seed(1)))
        live = _realize(live_spec, torch.Generator().manual_seed(2))
        restore_fails(root, live, ".")


def _copy_spec(spec: Any) -> Any:
    return {k: _copy_spec(v) for k, v in spec.items()} if isinstance(spec, dict) else spec


# ---------------------------------------------------------------- several ranks

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(scenario: str, tmp_path: Path, world: int = 2) -> list[dict[str, Any]]:
    port = _free_port()
    outs = [tmp_path / f"out-{r}.json" for r in range(world)]
    procs = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(spawn_child(
            WORKER, scenario, "--root", tmp_path / "ckpt", "--out", outs[rank],
            "--max-seconds", 100, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    logs: list[str] = []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=150)[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"a rank of {scenario} still runs after 150 s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "fsdp"])
def test_apply_failing_on_one_rank_rolls_back_every_rank(tmp_path: Path, kind: str) -> None:
    results = _launch(f"rank1-apply-fails-{kind}", tmp_path)
    for r in results:
        error = r["failed_restore"]
        assert error is not None, r
        if r["rank"] == 1:
            assert error["type"] == "StateError" and "injected" in error["message"], error
        else:
            assert error["type"] == "RestoreError", error
            assert "failed on rank(s) [1]" in error["message"], error
        assert r["unchanged_after_failure"], r
        assert r["restored_step"] == 5 and r["equal_to_saved_after_retry"], r


@pytest.mark.slow
def test_dtensor_and_plain_tensor_mismatch_is_refused_on_every_rank(tmp_path: Path) -> None:
    results = _launch("dtensor-mismatch", tmp_path)
    for r in results:
        for attempt in r["attempts"]:
            assert attempt["type"] == "StateError", attempt
            assert attempt["unchanged"], attempt
        assert "live tensor is a plain tensor, the checkpoint's a DTensor" in \
            r["attempts"][0]["message"]
        assert "live tensor is a DTensor, the checkpoint's a plain tensor" in \
            r["attempts"][1]["message"]


def test_prefetched_backup_copies_are_used_only_while_current() -> None:
    """Large tensors that neither own their memory nor are contiguous (strided views) are
    copied ahead of time; small CPU tensors, tensors a restore will hand new memory and
    contiguous ones whose bits it will exchange are not."""
    from ckpt_pipeline._restore.backups import BackupCopies

    base = torch.arange(1_200_000.0).view(1200, 1000)
    owner = torch.arange(300_000.0)
    module, stateful = nn.Linear(1000, 600), Flaky(1.0)
    module.weight = nn.Parameter(torch.zeros(700, 1000)[:600])  # a view, contiguous
    stateful.buf = base[300:700]  # a view, contiguous: loaded through load_state_dict
    live = {"a": base[:800, :500], "b": base[200:, 300:], "small": torch.arange(6.0),
            "owner": owner, "contiguous": base[100:900], "module": module,
            "stateful": stateful}
    copies = BackupCopies()
    copies.prefetch(live)
    held = {key[1:] for key in copies._copies}
    expect = {(t.data_ptr(), t.dtype, t.shape, t.stride())
              for t in (live["a"], live["b"], live["stateful"].buf)}
    assert held == expect  # not the contiguous view, the module's own tensors nor the rest
    alias = base[:800, :500]  # another alias of a's memory
    taken = copies.host_copy(alias)
    assert torch.equal(taken, live["a"]) and taken.data_ptr() != live["a"].data_ptr()
    with torch.no_grad():
        live["b"].add_(1)  # changed since the prefetch: its copy is stale
    fresh = copies.host_copy(live["b"])
    assert torch.equal(fresh, torch.arange(1_200_000.0).view(1200, 1000)[200:, 300:] + 1)
    small = copies.host_copy(live["small"])
    assert torch.equal(small, live["small"]) and small.data_ptr() != live["small"].data_ptr()
