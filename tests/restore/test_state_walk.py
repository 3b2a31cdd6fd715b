"""Walking a module's state (``_tree.state_dict_of``): the parameters themselves, no detach."""

from __future__ import annotations

from typing import Any

import torch

from ckpt_pipeline._tree import flatten_state, materialize, state_dict_of


def test_a_module_gives_its_parameters_and_buffers_themselves() -> None:
    model = torch.nn.BatchNorm1d(3)
    walked = state_dict_of(model)
    assert list(walked) == list(model.state_dict())
    assert walked["weight"] is model.weight
    assert walked["running_mean"] is model.running_mean


def test_a_module_that_overrides_state_dict_is_asked_as_it_asks() -> None:
    class Renamed(torch.nn.Linear):
        def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            assert not args and not kwargs  # called as every other stateful object
            return {"w": self.weight.detach()}

    model = Renamed(2, 2)
    walked = state_dict_of(model)
    assert list(walked) == ["w"]
    assert walked["w"] is not model.weight


def test_a_saved_module_keeps_detached_tensors_and_its_values() -> None:
    model = torch.nn.Linear(4, 3)
    flat = flatten_state({"model": model}, step=1)
    assert all(not t.requires_grad for t in flat.tensors)
    assert [t.data_ptr() for t in flat.tensors] == [p.data_ptr() for p in model.parameters()]
    restored = materialize(flat.skeleton["model"], list(flat.tensors))
    assert torch.equal(restored["weight"], model.weight.detach())
    assert torch.equal(restored["bias"], model.bias.detach())
