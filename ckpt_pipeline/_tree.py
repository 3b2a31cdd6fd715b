"""Walking the user's state: flatten it into a skeleton plus tensors, and load it back in place.

The state is a mapping whose values are objects with ``state_dict()``/``load_state_dict()``
(modules, optimizers, schedulers), tensors, or nested dicts, lists and tuples of tensors and
plain values (None, bool, int, float, str, bytes).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass
from typing import Any

import torch

from ._format import DTYPE_NAMES, DistLayout, TensorRef
from .errors import StateError

__all__ = (
    "FlatState",
    "apply_state",
    "check_structure",
    "dist_layout",
    "find_mesh",
    "flatten_state",
    "materialize",
    "to_dtensor",
)

_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class FlatState:
    """The skeleton (plain values with TensorRef placeholders) and the tensors, in order."""

    skeleton: dict[str, Any]
    paths: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    """Plain tensors; for a DTensor, this rank's local shard."""
    layouts: tuple[DistLayout | None, ...]


def _join(path: str, key: object) -> str:
    return f"{path}/{key}" if path else str(key)


def _is_stateful(obj: object) -> bool:
    return (not isinstance(obj, (torch.Tensor, Mapping))
            and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def flatten_state(state: Mapping[str, Any], *, step: int) -> FlatState:
    """Turn the state into a skeleton and a tensor list; unsupported leaves raise StateError."""
    if not isinstance(state, Mapping):
        raise StateError(f"the state must be a mapping of names to objects, got "
                         f"{type(state).__name__}", step=step,
                         hint='pass for example {"model": model, "optimizer": optimizer}')
    paths: list[str] = []
    tensors: list[torch.Tensor] = []
    layouts: list[DistLayout | None] = []

    def walk(obj: Any, path: str, depth: int) -> Any:
        if depth > 64:
            raise StateError("the state is nested more than 64 levels deep", step=step,
                             path=path)
        if isinstance(obj, torch.Tensor):
            return tensor_leaf(obj, path)
        if obj is None or isinstance(obj, (bool, bytes)):
            return obj
        if isinstance(obj, int):
            if not _INT_MIN <= obj <= _INT_MAX:
                raise StateError(f"integer {obj} does not fit in 64 bits", step=step,
                                 path=path)
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, (bytearray, memoryview)):
            return bytes(obj)
        if _is_stateful(obj):
            return walk(obj.state_dict(), path, depth + 1)
        if isinstance(obj, Mapping):
            out: dict[Any, Any] = {}
            for key, value in obj.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise StateError(
                        f"map key {key!r} of type {type(key).__name__} is not supported "
                        "(keys must be str or int)", step=step, path=path)
                plain_key = str(key) if isinstance(key, str) else int(key)
                out[plain_key] = walk(value, _join(path, key), depth + 1)
            return out
        if isinstance(obj, list):
            return [walk(v, _join(path, i), depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(walk(v, _join(path, i), depth + 1) for i, v in enumerate(obj))
        item = getattr(obj, "item", None)
        if type(obj).__module__ == "numpy" and callable(item) and getattr(obj, "ndim", 1) == 0:
            return walk(item(), path, depth)
        raise StateError(
            f"leaf of type {type(obj).__module__}.{type(obj).__qualname__} cannot be "
            "checkpointed", step=step, path=path,
            hint="use tensors, plain values (None, bool, int, float, str, bytes), dicts, "
                 "lists, tuples, or objects with state_dict()/load_state_dict()")

    def tensor_leaf(t: torch.Tensor, path: str) -> TensorRef:
        layout: DistLayout | None = None
        if _is_dtensor(t):
            layout = dist_layout(t, step=step, path=path)
            t = t.to_local()  # type: ignore[attr-defined]
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise StateError(f"tensor subclass {type(t).__name__} is not supported",
                             step=step, path=path,
                             hint="save a plain tensor or a DTensor")
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            raise StateError(f"tensor layout {t.layout} is not supported", step=step,
                             path=path, hint="convert it to a dense tensor")
        if t.device.type not in ("cpu", "cuda"):
            raise StateError(f"tensors on {t.device} are not supported", step=step,
                             path=path, hint="move it to the CPU or a CUDA device")
        if t.dtype not in DTYPE_NAMES:
            raise StateError(f"dtype {t.dtype} is not supported", step=step, path=path)
        paths.append(path)
        tensors.append(t.detach())
        layouts.append(layout)
        return TensorRef(len(tensors) - 1)

    skeleton = {}
    for name, value in state.items():
        if not isinstance(name, str):
            raise StateError(f"top-level key {name!r} is not a string", step=step)
        skeleton[name] = walk(value, name, 0)
    return FlatState(skeleton, tuple(paths), tuple(tensors), tuple(layouts))


def _is_dtensor(t: object) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def dist_layout(t: Any, *, step: int, path: str) -> DistLayout:
    """The layout of a DTensor's local shard; only Shard(dim) and Replicate are supported."""
    from torch.distributed.tensor import Replicate, Shard

    placements: list[str] = []
    for p in t.placements:
        if type(p) is Shard:
            placements.append(f"S{p.dim}")
        elif type(p) is Replicate:
            placements.append("R")
        else:
            raise StateError(f"DTensor placement {p} is not supported", step=step, path=path,
                             hint="redistribute to Shard or Replicate before saving")
    return DistLayout(tuple(t.device_mesh.shape), tuple(placements), tuple(t.shape),
                      tuple(t.stride()))


def find_mesh(live: Mapping[str, Any], mesh_shape: tuple[int, ...]
              ) -> tuple[Any, torch.device] | None:
    """A DeviceMesh of this shape used by a DTensor of the live state, and the device of that
    DTensor's local shard on this rank (None if there is none)."""
    stack: list[Any] = list(live.values())
    seen: set[int] = set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if _is_dtensor(obj):
            if tuple(obj.device_mesh.shape) == mesh_shape:
                return obj.device_mesh, obj.to_local().device
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            stack.extend(p for g in obj.param_groups for p in g["params"])
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return None


def to_dtensor(local: torch.Tensor, layout: DistLayout, mesh: Any,
               device: torch.device) -> torch.Tensor:
    """Rebuild a DTensor from this rank's local shard on the live mesh and device."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = [Replicate() if p == "R" else Shard(int(p[1:])) for p in layout.placements]
    local = local.to(device, non_blocking=True)
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(layout.global_shape),
                              stride=layout.global_stride)


def materialize(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace TensorRef placeholders by the loaded tensors."""
    if isinstance(tree, TensorRef):
        return tensors[tree.index]
    if isinstance(tree, dict):
        return {k: materialize(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [materialize(v, tensors) for v in tree]
    if isinstance(tree, tuple):
        return tuple(materialize(v, tensors) for v in tree)
    return tree


def check_structure(live: Mapping[str, Any], tree: Any, tensors: list[torch.Tensor],
                    *, step: int) -> None:
    """Raise StateError if the checkpoint cannot be loaded into ``live``, touching nothing."""
    if not isinstance(tree, dict):
        raise StateError("the checkpoint's state is not a map", step=step)
    missing = [k for k in live if k not in tree]
    if missing:
        raise StateError(f"the checkpoint holds no {missing}; it has {sorted(map(str, tree))}",
                         step=step, hint="restore into the same state layout that was saved")

    def walk(obj: Any, node: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            if not isinstance(node, TensorRef):
                raise StateError("the checkpoint has no tensor here", step=step, path=path)
            saved = tensors[node.index]
            if saved.shape != obj.shape or saved.dtype != obj.dtype:
                raise StateError(
                    f"saved tensor is {saved.dtype}{list(saved.shape)}, the live one "
                    f"{obj.dtype}{list(obj.shape)}", step=step, path=path)
        elif _is_stateful(obj):
            return  # load_state_dict validates its own input
        elif isinstance(obj, MutableMapping):
            if not isinstance(node, dict):
                raise StateError("the checkpoint has no map here", step=step, path=path)
            for key, value in obj.items():
                if key not in node:
                    raise StateError(f"the checkpoint has no key {key!r}", step=step,
                                     path=path)
                walk(value, node[key], _join(path, key))
        elif isinstance(obj, MutableSequence):
            if not isinstance(node, list) or len(node) != len(obj):
                raise StateError("the checkpoint has no list of this length here", step=step,
                                 path=path)
            for i, value in enumerate(obj):
                walk(value, node[i], _join(path, i))

    for name, value in live.items():
        walk(value, tree[name], name)


def apply_state(live: MutableMapping[str, Any], tree: dict[str, Any],
                tensors: list[torch.Tensor], *, step: int) -> None:
    """Load the checkpoint into the live objects, in place."""
    check_structure(live, tree, tensors, step=step)

    def load(obj: Any, node: Any, path: str) -> Any:
        """Load ``node`` into ``obj`` in place; return the value the parent should hold."""
        if isinstance(obj, torch.Tensor):
            with torch.no_grad():
                obj.copy_(tensors[node.index])
            return obj
        if _is_stateful(obj):
            try:
                obj.load_state_dict(materialize(node, tensors))
            except Exception as exc:
                raise StateError(f"load_state_dict failed: {exc}", step=step,
                                 path=path) from exc
            return obj
        if isinstance(obj, MutableMapping):
            for key in list(node):
                if key in obj:
                    obj[key] = load(obj[key], node[key], _join(path, key))
                else:
                    obj[key] = materialize(node[key], tensors)
            return obj
        if isinstance(obj, MutableSequence):
            for i in range(len(obj)):
                obj[i] = load(obj[i], node[i], _join(path, i))
            return obj
        return materialize(node, tensors)

    for name in list(live):
        live[name] = load(live[name], tree[name], name)
