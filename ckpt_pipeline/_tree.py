"""Walking the user's state: flatten it into a skeleton plus tensors, and load it back in place.

The state is a mapping whose values are objects with ``state_dict()``/``load_state_dict()``
(modules, optimizers, schedulers), tensors, or nested dicts, lists and tuples of tensors and
plain values (None, bool, int, float, str, bytes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._format.documents import TensorRef
from ._format.header import MAX_MESH_NAME, MAX_MESHES, DistLayout
from ._format.limits import (
    DEVICE_PATTERN,
    DEVICE_TYPES,
    DTYPE_NAMES,
    INT_MAX,
    INT_MIN,
    MAX_NDIM,
    MAX_NESTING,
    MAX_PATH_LEN,
    MAX_TENSORS,
)
from .errors import StateError

__all__ = (
    "FlatState",
    "MeshNames",
    "check_text",
    "dist_layout",
    "find_mesh",
    "flatten_state",
    "is_dtensor",
    "is_stateful",
    "join_path",
    "live_meshes",
    "materialize",
    "mesh_names",
    "mesh_shapes",
    "nesting_error",
    "same_mesh",
    "short_path",
    "state_dict_of",
    "to_dtensor",
    "unmatched_meshes",
)


@dataclass(frozen=True, slots=True)
class FlatState:
    """The skeleton (plain values with TensorRef placeholders) and the tensors, in order."""

    skeleton: dict[str, Any]
    paths: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    """Plain tensors; for a DTensor, this rank's local shard."""
    layouts: tuple[DistLayout | None, ...]
    meshes: tuple[MeshNames, ...] = ()
    """The DeviceMeshes of the state's DTensors: shape and dimension names, each once."""


MeshNames = tuple[tuple[int, ...], tuple[str, ...] | None]
"""A DeviceMesh as a checkpoint records it: its shape and its dimensions' names (None:
unnamed)."""


def mesh_names(mesh: Any) -> MeshNames:
    """``mesh``'s shape and dimension names."""
    names = getattr(mesh, "mesh_dim_names", None)
    return tuple(mesh.shape), None if names is None else tuple(str(n) for n in names)


def join_path(path: str, key: object) -> str:
    """The path of ``key`` under ``path`` (``model/layer.weight``), as errors name it."""
    return f"{path}/{key}" if path else str(key)


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` is saved through ``state_dict()`` and loaded by ``load_state_dict``."""
    return (not isinstance(obj, (torch.Tensor, Mapping))
            and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def state_dict_of(obj: Any) -> Any:
    """``obj.state_dict()``; for a module that keeps ``torch.nn.Module``'s, the same but
    for its DTensors, which are its parameters and buffers themselves rather than detached
    aliases of them (``keep_vars=True``). Detaching a DTensor goes through DTensor's sharding
    propagation, whose cache is per thread: about half a millisecond for each parameter of a
    shape that thread has not seen, paid again by every thread that walks the state
    (measured: ``docs/design.md``, "Walking a module's state"). Other tensors are detached
    as ``state_dict()`` detaches them (a few microseconds; a subclass of ``Parameter``
    comes back a plain tensor, as before). Whoever walks them reads them, never writes."""
    if not (isinstance(obj, torch.nn.Module)
            and type(obj).state_dict is torch.nn.Module.state_dict):
        return obj.state_dict()
    kept = obj.state_dict(keep_vars=True)
    out: OrderedDict[str, Any] = OrderedDict(
        (key, value if is_dtensor(value) or not isinstance(value, torch.Tensor)
         else value.detach()) for key, value in kept.items())
    metadata = getattr(kept, "_metadata", None)
    if metadata is not None:  # module versions, read by _load_from_state_dict
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


def _type_name(obj: object) -> str:
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")


def _container_refusal(obj: object) -> tuple[str, str] | None:
    """(what it is, hint) for a container that would not come back as what was saved."""
    kind = type(obj)
    if kind is dict or kind is OrderedDict or kind is list or kind is tuple:
        return None
    if isinstance(obj, Mapping):
        return (f"a mapping of type {_type_name(obj)}; it would come back as a plain dict",
                "convert it to a dict (dict(value)) before saving")
    if isinstance(obj, tuple):
        if hasattr(kind, "_fields"):
            what = f"a namedtuple {_type_name(obj)}"
        else:
            what = f"a tuple subclass {_type_name(obj)}"
        return (f"{what}; it would come back as a plain tuple",
                "convert it to a tuple (tuple(value)) or a dict (value._asdict()) before "
                "saving")
    if isinstance(obj, list):
        return (f"a list subclass {_type_name(obj)}; it would come back as a plain list",
                "convert it to a list (list(value)) before saving")
    return None


_SUPPORTED = ", ".join(DTYPE_NAMES.values())


_DEVICE_OK: dict[torch.device, bool] = {}


def _device_ok(device: torch.device) -> bool:
    """A CPU or CUDA device whose name a reader accepts (cached: ``device.type`` is slow)."""
    ok = _DEVICE_OK.get(device)
    if ok is None:
        ok = _DEVICE_OK[device] = (device.type in DEVICE_TYPES
                                   and DEVICE_PATTERN.fullmatch(str(device)) is not None)
    return ok


def _tensor_refusal(t: torch.Tensor) -> tuple[str, str] | None:
    """(what the tensor is, hint) when its exact value cannot be saved as raw bytes."""
    if t.is_nested:
        return ("is a nested tensor", "save its components (t.unbind()) or a padded tensor "
                                      "(t.to_padded_tensor(0.0))")
    if t.is_quantized:
        return (f"is a quantized tensor ({t.dtype})",
                "save t.dequantize(), or t.int_repr() with its scale and zero point")
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return (f"is a tensor subclass {_type_name(t)}", "save a plain tensor or a DTensor")
    if t.layout != torch.strided:
        layout = str(t.layout).removeprefix("torch.")
        return (f"is a {layout} tensor", "convert it to a dense tensor (t.to_dense()), or save "
                                         "its parts (indices, values) as dense tensors")
    if not (t.is_cpu or t.is_cuda) and not _device_ok(t.device):
        return (f"is on device {t.device}; only CPU and CUDA tensors can be saved (limit "
                "device)", "move it to the CPU or a CUDA device")
    if t.dtype not in DTYPE_NAMES:
        return (f"has dtype {t.dtype}: dtype {t.dtype} is not supported: supported dtypes are "
                f"{_SUPPORTED} (limit dtype)",
                "convert it (t.to(...)) or save its bytes (t.view(torch.uint8)) with a note of "
                "the dtype")
    if t.dim() > MAX_NDIM:
        return (f"has {t.dim()} dimensions; a reader accepts at most {MAX_NDIM} (limit ndim)",
                "reshape it to fewer dimensions and save the shape beside it")
    return None


def _check_text(text: str, path: str, step: int) -> str:
    """The string as stored (UTF-8: a lone surrogate cannot be encoded)."""
    check_text(text, path, step=step)
    return str(text)


def flatten_state(state: Mapping[str, Any], *, step: int) -> FlatState:
    """Turn the state into a skeleton and a tensor list; unsupported leaves raise StateError.

    Everything accepted here comes back from restore as it was (tensors bit for bit, plain
    values with their types): anything that would not, or that a reader's limit refuses
    (``_format/limits.py``), raises StateError naming its path. Containers are counted in the
    depth the state tree's decoder sees: the state mapping is depth 0, ``state[name]`` depth 1.
    """
    if not isinstance(state, Mapping):
        raise StateError(f"the state must be a mapping of names to objects, got "
                         f"{type(state).__name__}", step=step,
                         hint='pass for example {"model": model, "optimizer": optimizer}')
    paths: list[str] = []
    tensors: list[torch.Tensor] = []
    layouts: list[DistLayout | None] = []
    meshes: dict[int, MeshNames] = {}  # by the mesh object: read once, not a tensor at a time

    def walk(obj: Any, path: str, depth: int) -> Any:
        """``depth``: the depth ``obj`` has in the state tree if it is a container."""
        if isinstance(obj, torch.Tensor):
            return tensor_leaf(obj, path)
        if obj is None or isinstance(obj, bool):
            return obj
        if isinstance(obj, int):
            if not INT_MIN <= obj <= INT_MAX:
                raise StateError(f"integer {obj} does not fit in 64 bits (limit int_range)",
                                 step=step, path=path)
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, str):
            return _check_text(obj, path, step)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return obj if type(obj) is bytes else bytes(obj)
        if is_stateful(obj):
            value = state_dict_of(obj)
            # A state dict takes the object's place; one that is stateful again counts as a
            # level, so that a chain of them cannot recurse forever.
            return walk(value, path, depth + 1 if is_stateful(value) else depth)
        refusal = _container_refusal(obj)
        if refusal is not None:
            what, hint = refusal
            raise StateError(f"{path} is {what}", step=step, path=path, hint=hint)
        if isinstance(obj, (dict, list, tuple)) and depth >= MAX_NESTING:
            raise nesting_error(path, depth, step=step)
        if isinstance(obj, dict):
            out: dict[Any, Any] = {}
            for key, value in obj.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise StateError(
                        f"map key {key!r} of type {type(key).__name__} is not supported "
                        "(limit map_keys: keys must be str or int)", step=step, path=path,
                        hint="use str or int keys")
                if isinstance(key, str):
                    plain_key: str | int = _check_text(key, path, step)
                else:
                    if not INT_MIN <= key <= INT_MAX:
                        raise StateError(f"map key {key} does not fit in 64 bits (limit "
                                         "int_range)", step=step, path=path)
                    plain_key = int(key)
                out[plain_key] = walk(value, join_path(path, key), depth + 1)
            return out
        if isinstance(obj, list):
            return [walk(v, join_path(path, i), depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(walk(v, join_path(path, i), depth + 1) for i, v in enumerate(obj))
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
        if is_dtensor(t):
            layout = dist_layout(t, step=step, path=path)
            mesh = t.device_mesh  # type: ignore[attr-defined]
            if id(mesh) not in meshes:  # alive while its tensors are: ids stay distinct
                meshes[id(mesh)] = _recordable_mesh(mesh, set(meshes.values()), path, step)
            with torch.no_grad():  # a parameter (state_dict_of): no autograd node a save
                t = t.to_local()  # type: ignore[attr-defined]
        refusal = _tensor_refusal(t)
        if refusal is not None:
            what, hint = refusal
            raise StateError(f"tensor {short_path(path)} {what}", step=step, path=path,
                             hint=hint)
        if len(path) > MAX_PATH_LEN:
            raise StateError(
                f"the path of tensor {short_path(path)} is {len(path)} characters; a reader "
                f"accepts at most {MAX_PATH_LEN} (limit path_length)", step=step, path=path,
                hint="use shorter keys (a tensor's path joins the keys leading to it with "
                     "'/')")
        if len(tensors) >= MAX_TENSORS:
            raise StateError(
                f"the state holds more than {MAX_TENSORS} tensors, the most a shard may hold "
                f"(limit tensor_count); the next is {short_path(path)}", step=step, path=path,
                hint="merge small tensors into larger ones (for example one flat buffer "
                     "per dtype)")
        paths.append(path)
        tensors.append(t.detach())
        layouts.append(layout)
        return TensorRef(len(tensors) - 1)

    skeleton = {}
    for name, value in state.items():
        if not isinstance(name, str):
            raise StateError(f"top-level key {name!r} is not a string", step=step)
        skeleton[_check_text(name, name, step)] = walk(value, name, 1)
    return FlatState(skeleton, tuple(paths), tuple(tensors), tuple(layouts),
                     tuple(dict.fromkeys(meshes.values())))


def short_path(path: str) -> str:
    """A path cut to at most about 120 characters, for an error message."""
    return path if len(path) <= 120 else f"{path[:60]}...{path[-40:]}"


def nesting_error(path: str, depth: int, *, step: int | None, rank: int | None = None,
                  document: str = "the state tree") -> StateError:
    """The refusal of a container nested as deep as a reader refuses (limit nesting)."""
    return StateError(
        f"{short_path(path)} is a container at depth {depth} of {document}; a reader refuses "
        f"containers at depth {MAX_NESTING} or deeper (limit nesting)", step=step, rank=rank,
        path=path, hint="flatten the structure (for example join keys into one string key) or "
                        "store the deep part as a str or bytes value")


def check_text(text: str, path: str, *, step: int | None, rank: int | None = None) -> None:
    """Strings are stored as UTF-8: a lone surrogate cannot be encoded."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise StateError(f"a string at {short_path(path)} cannot be encoded as UTF-8 "
                         f"({exc.reason} at index {exc.start}) (limit value_types)", step=step,
                         rank=rank, path=path, hint="remove lone surrogates (or save it as "
                                                    "bytes)") from exc


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (without importing torch.distributed)."""
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
    for obj in _dtensors(live):
        if tuple(obj.device_mesh.shape) == mesh_shape:
            return obj.device_mesh, obj.to_local().device
    return None


def mesh_shapes(live: Mapping[str, Any]) -> set[tuple[int, ...]]:
    """The shapes of the DeviceMeshes the live state's DTensors are on."""
    return {tuple(obj.device_mesh.shape) for obj in _dtensors(live)}


def _recordable_mesh(mesh: Any, recorded: set[MeshNames], path: str, step: int) -> MeshNames:
    """``mesh_names(mesh)``, refused with a StateError where a reader would refuse the
    header that records it (``_format/header.decode_meshes``): a dimension name empty, longer
    than MAX_MESH_NAME or not UTF-8, or more than MAX_MESHES distinct meshes."""
    found = mesh_names(mesh)
    for name in found[1] or ():
        _check_text(name, path, step)
        if not 0 < len(name) <= MAX_MESH_NAME:
            raise StateError(f"DTensor {short_path(path)} is on a mesh whose dimension name "
                             f"{name[:40]!r} has {len(name)} characters; a checkpoint records "
                             f"names of 1 to {MAX_MESH_NAME}", step=step, path=path,
                             hint="name the mesh's dimensions with shorter, non-empty names")
    if found not in recorded and len(recorded) >= MAX_MESHES:
        raise StateError(f"the state's DTensors are on more than {MAX_MESHES} distinct "
                         f"meshes; the next is that of {short_path(path)}", step=step,
                         path=path, hint="put the DTensors on fewer meshes")
    return found


def live_meshes(live: Mapping[str, Any]) -> set[MeshNames]:
    """The shapes and dimension names of the DeviceMeshes the live state's DTensors are on."""
    return {mesh_names(obj.device_mesh) for obj in _dtensors(live)}


def same_mesh(a: MeshNames, b: MeshNames) -> bool:
    """Whether two recorded meshes are the same: the same shape, and the same dimension names
    where both have names (an unnamed mesh says nothing of its dimensions' roles)."""
    return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])


def unmatched_meshes(saved: Iterable[MeshNames], live: Iterable[MeshNames]
                     ) -> list[MeshNames]:
    """The meshes of ``saved`` that no mesh of ``live`` is the same as (``same_mesh``)."""
    live = list(live)
    return [m for m in saved if not any(same_mesh(m, other) for other in live)]


def _dtensors(live: Mapping[str, Any]) -> Iterator[Any]:
    """The DTensors of a live state: its values, modules' parameters, optimizers' params,
    nested in mappings, lists and tuples; each once."""
    stack: list[Any] = list(live.values())
    seen: set[int] = set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if is_dtensor(obj):
            yield obj
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            stack.extend(p for g in obj.param_groups for p in g["params"])
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)


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

