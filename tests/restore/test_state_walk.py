"""Walking a module's state (``_tree.state_dict_of``): DTensors as they are, no detach."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_pipeline._tree import flatten_state, materialize, state_dict_of


def test_a_plain_module_gives_what_state_dict_gives() -> None:
    model = torch.nn.BatchNorm1d(3)
    walked = state_dict_of(model)
    expected = model.state_dict()
    assert list(walked) == list(expected)
    assert walked._metadata == expected._metadata  # type: ignore[attr-defined]
    for key, value in walked.items():
        assert type(value) is torch.Tensor and not value.requires_grad
        assert value.data_ptr() == expected[key].data_ptr()


def test_a_parameter_subclass_comes_back_a_plain_tensor_and_saves() -> None:
    class Tagged(torch.nn.Parameter):
        pass

    model = torch.nn.Linear(2, 2)
    model.weight = Tagged(torch.ones(2, 2))
    assert type(state_dict_of(model)["weight"]) is torch.Tensor
    flat = flatten_state({"model": model}, step=1)
    restored = materialize(flat.skeleton["model"], list(flat.tensors))
    assert torch.equal(restored["weight"], torch.ones(2, 2))


def test_a_module_that_overrides_state_dict_is_asked_as_it_asks() -> None:
    class Renamed(torch.nn.Linear):
        def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            assert not args and not kwargs  # called as every other stateful object
            return {"w": self.weight.detach()}

    assert list(state_dict_of(Renamed(2, 2))) == ["w"]


_FSDP_CHILD = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from ckpt_pipeline._tree import flatten_state, state_dict_of
    store = dist.FileStore(os.environ["STORE"], 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = torch.nn.Linear(4, 3)
    fully_shard(model)
    walked = state_dict_of(model)
    assert walked["weight"] is model.weight and walked["bias"] is model.bias, walked
    flat = flatten_state({"model": model}, step=1)
    assert all(type(t) is torch.Tensor and not t.requires_grad for t in flat.tensors)
    assert [t.data_ptr() for t in flat.tensors] == [
        p.to_local().data_ptr() for p in model.parameters()]
    assert all(layout is not None for layout in flat.layouts)
    dist.destroy_process_group()
    print("ok")
""")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_fsdp2_module_gives_its_dtensor_parameters_themselves(tmp_path: Path) -> None:
    """One gloo rank (a real group; the module is FSDP2's): the walk hands back the DTensor
    parameters themselves, and the save still keeps plain, detached local tensors. Slow (a
    child process imports torch: 3 s of the fast suite's minute); the FSDP2 reshard tests
    walk the same way."""
    done = subprocess.run([sys.executable, "-c", _FSDP_CHILD], capture_output=True,
                          text=True, timeout=50,
                          env={**os.environ, "STORE": str(tmp_path / "store")})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
