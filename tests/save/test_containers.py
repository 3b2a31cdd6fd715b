"""Containers: what would not come back as what was saved is refused in save(), naming the path
and the type; dicts, OrderedDicts, lists, tuples and objects with state_dict() are saved, and
torch's optimizers and LR schedulers round-trip through load_state_dict."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import ckpt_pipeline as cp
from tests._support.roundtrip import assert_refused, assert_same, restore, round_trip, save


class Point(NamedTuple):
    x: int
    y: int


class MyTuple(tuple):  # type: ignore[type-arg]
    pass


class MyList(list):  # type: ignore[type-arg]
    pass


class MyDict(dict):  # type: ignore[type-arg]
    pass


class ReadOnly(Mapping[str, Any]):
    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


REFUSED: dict[str, tuple[Callable[[], Any], str, str]] = {
    "namedtuple": (lambda: Point(1, 2), r"is a namedtuple .*Point; it would come back as a "
                                        r"plain tuple", "tuple(value)"),
    "torch.Size": (lambda: torch.Size([2, 3]), r"is a tuple subclass torch.Size", "tuple(value)"),
    "tuple subclass": (lambda: MyTuple((1, 2)), r"is a tuple subclass .*MyTuple", "tuple"),
    "list subclass": (lambda: MyList([1]), r"is a list subclass .*MyList", "list(value)"),
    "defaultdict": (lambda: collections.defaultdict(int, a=1),
                    r"is a mapping of type collections.defaultdict; it would come back as a "
                    r"plain dict", "dict(value)"),
    "Counter": (lambda: collections.Counter("aab"), r"mapping of type collections.Counter",
                "dict(value)"),
    "dict subclass": (lambda: MyDict(a=1), r"mapping of type .*MyDict", "dict(value)"),
    "custom Mapping": (lambda: ReadOnly({"a": torch.ones(1)}), r"mapping of type .*ReadOnly",
                       "dict(value)"),
    "ChainMap": (lambda: collections.ChainMap({"a": 1}), r"mapping of type collections.ChainMap",
                 "dict(value)"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_containers_that_would_change_type_are_refused(root: Path, kind: str) -> None:
    make, match, hint = REFUSED[kind]
    error = assert_refused(root, {"model": {"opt": [1, {"v": make()}]}}, path="model/opt/1/v",
                           match=match)
    assert hint in (error.hint or "")


def test_plain_containers_and_ordered_dicts_round_trip(root: Path) -> None:
    state = {"m": {"d": {"a": 1, 2: [3, (4, 5.5)]}, "l": [[], (), {}], "t": ((), ((),)),
                   "o": collections.OrderedDict(b=torch.ones(2), a=None)}}
    round_trip(root, state)


def test_train_state_extra_refuses_what_would_change_type(root: Path) -> None:
    for value, match in ((Point(1, 2), "Point"), (collections.OrderedDict(a=1), "OrderedDict"),
                         (object(), "builtins.object"), (torch.ones(1), "torch.Tensor")):
        ts = cp.TrainState(step=1, extra={"a": [value]})
        assert_refused(root, {"m": {}}, ts, path="train_state/extra/a/0",
                       match=rf"{match}.*limit value_types")


class Stateful:
    """Not a mapping, not a tensor: saved through state_dict()."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.inner = torch.full((2,), value)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "inner": self.inner, "steps": (1, 2)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert sd["steps"] == (1, 2)
        self.value = sd["value"]
        self.inner = sd["inner"].clone()


def test_objects_with_state_dict_stay_accepted(root: Path) -> None:
    save(root, {"s": Stateful(2.5)})
    live = {"s": Stateful(0.0)}
    restore(root, live)
    assert live["s"].value == 2.5
    assert torch.equal(live["s"].inner, torch.full((2,), 2.5))


def _schedulers(opt: torch.optim.Optimizer) -> dict[str, Any]:
    sched = torch.optim.lr_scheduler
    return {
        "LambdaLR": sched.LambdaLR(opt, lambda epoch: 0.9 ** epoch),
        "OneCycleLR": sched.OneCycleLR(opt, max_lr=0.1, total_steps=20),
        "CosineAnnealingLR": sched.CosineAnnealingLR(opt, T_max=7, eta_min=1e-4),
        "SequentialLR": sched.SequentialLR(
            opt, [sched.ConstantLR(opt, factor=0.5, total_iters=2),
                  sched.ExponentialLR(opt, gamma=0.9)], milestones=[2]),
    }


def _training(name: str, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.95))
    return {"model": model, "optimizer": opt, "scheduler": _schedulers(opt)[name]}


@pytest.mark.parametrize("name", ["LambdaLR", "OneCycleLR", "CosineAnnealingLR", "SequentialLR"])
def test_adamw_and_lr_schedulers_round_trip(root: Path, name: str) -> None:
    state = _training(name, seed=0)
    for _ in range(5):
        state["model"](torch.randn(2, 4)).sum().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
    assert isinstance(state["optimizer"].state_dict()["param_groups"][0]["betas"], tuple)
    save(root, state)
    live = _training(name, seed=1)
    restore(root, live)
    saved_opt, live_opt = state["optimizer"].state_dict(), live["optimizer"].state_dict()
    assert_same(live_opt["state"], saved_opt["state"], "optimizer/state")
    assert live_opt["param_groups"] == saved_opt["param_groups"]
    for group in live_opt["param_groups"]:
        assert type(group["betas"]) is tuple
    assert live["scheduler"].state_dict() == state["scheduler"].state_dict()
    assert live["scheduler"].get_last_lr() == state["scheduler"].get_last_lr()
    for a, b in zip(live["model"].parameters(), state["model"].parameters()):
        assert torch.equal(a, b)
