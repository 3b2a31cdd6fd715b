"""Loading a verified checkpoint into the live state so that a failed restore changes nothing.

Two steps:

- ``validate_state`` checks everything that can be checked without touching a live object:
  keys, list lengths, tensor shapes, dtypes, DTensor or plain, whether each live tensor can
  receive data in place (strided, memory of its own, not an inference tensor, not on ``meta``),
  modules against ``module.state_dict()`` as a strict ``load_state_dict`` would, optimizers'
  parameter groups (and state shapes, when the live optimizer has state), and the key sets of
  other stateful objects. It raises ``StateError`` naming the path.
- ``apply_state`` validates again, then applies, keeping what it overwrites in a journal:
  a host copy of each live tensor before it is overwritten (CUDA tensors are copied to host
  memory, so no GPU memory is doubled), a deep copy of ``obj.state_dict()`` (tensors on the
  host) before ``obj.load_state_dict`` (for a plain ``torch.optim`` optimizer, whose
  ``load_state_dict`` replaces its state rather than writing into it, the old state objects
  themselves: nothing is copied), the old value (or its absence) of every container slot it
  changes, and the RNG states before it sets them. When anything fails (a custom
  ``load_state_dict``, a hook, the RNG states), the journal is undone in reverse order and the
  live state is as it was. On success it returns an ``AppliedState`` whose ``undo()`` does the
  same later (another rank failed, the final agreement failed) and ``release()`` frees the
  copies.

The rules for the live state: a tensor is loaded in place (``copy_``); an object with
``state_dict()``/``load_state_dict()`` through ``load_state_dict``; a dict or list in place,
slot by slot (a key only the checkpoint has is added to a dict; at the top level, it is left
out); a tuple that holds tensors or stateful objects (or a namedtuple) is walked like a list and
its slot gets a new tuple of the same type; anything else (plain values, tuples of plain values,
other objects) is replaced by the checkpoint's value.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NoReturn

import torch

from .._format.codec import TensorRef
from .._tree import _is_dtensor, _is_stateful, _join, materialize
from ..errors import CheckpointError, RestoreError, StateError
from ..train_state import RNGState

__all__ = ("AppliedState", "BackupCopies", "apply_state", "undone_on_error", "validate_state")

_SHOWN_KEYS = 8
"""How many missing or unexpected keys an error lists."""


# ---------------------------------------------------------------- helpers

def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its memory), or the tensor itself."""
    if _is_dtensor(t):
        local: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
        return local
    return t


def _describe(t: torch.Tensor) -> str:
    kind = "DTensor " if _is_dtensor(t) else ""
    return f"{kind}{t.dtype}{list(t.shape)}"


def _kind(node: Any) -> str:
    if isinstance(node, TensorRef):
        return "a tensor"
    if isinstance(node, dict):
        return "a map"
    if isinstance(node, list):
        return "a list"
    if isinstance(node, tuple):
        return "a tuple"
    return f"a value of type {type(node).__name__}"


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _holds_live_state(obj: object, depth: int = 0) -> bool:
    """Whether a live container holds something loaded in place (tensor, stateful object)."""
    if isinstance(obj, torch.Tensor) or _is_stateful(obj):
        return True
    if depth > 64:
        return False
    if isinstance(obj, Mapping):
        return any(_holds_live_state(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_live_state(v, depth + 1) for v in obj)
    return False


def _walks_tuple(obj: object) -> bool:
    """A live tuple walked element by element (else its slot takes the checkpoint's value)."""
    return isinstance(obj, tuple) and (_is_namedtuple(obj) or _holds_live_state(obj))


def _rebuild_tuple(like: tuple[Any, ...], values: list[Any]) -> tuple[Any, ...]:
    """A tuple of ``like``'s type (a namedtuple stays one) holding ``values``."""
    kind = type(like)
    if kind is tuple:
        return tuple(values)
    if _is_namedtuple(like):
        made: tuple[Any, ...] = kind._make(values)  # type: ignore[attr-defined]
        return made
    rebuilt: tuple[Any, ...] = kind(values)
    return rebuilt


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an expanded tensor, an overlapping
    ``as_strided`` view): copying into it would not store every value."""
    dims = sorted((stride, size) for stride, size in zip(t.stride(), t.shape) if size > 1)
    extent = 0
    for stride, size in dims:
        if stride <= extent:
            return True
        extent += stride * (size - 1)
    return False


def _public_keys(state: Mapping[Any, Any]) -> set[Any]:
    """Keys that are part of an object's configuration; private ones (``_step_count``,
    ``_is_initial``, ...) come and go between library versions and are not compared."""
    return {k for k in state if not (isinstance(k, str) and k.startswith("_"))}


def _shown(keys: Sequence[Any]) -> str:
    listed = ", ".join(repr(k) for k in keys[:_SHOWN_KEYS])
    more = len(keys) - _SHOWN_KEYS
    return f"[{listed}{f', ... ({more} more)' if more > 0 else ''}]"


# ---------------------------------------------------------------- validation

class _Validator:
    """Checks the checkpoint against the live state; raises StateError, touches nothing."""

    def __init__(self, tensors: Sequence[torch.Tensor], step: int, rank: int | None) -> None:
        self.tensors = tensors
        self.step = step
        self.rank = rank

    def fail(self, message: str, path: str | None = None, hint: str | None = None
             ) -> NoReturn:
        raise StateError(message, step=self.step, rank=self.rank, path=path, hint=hint)

    def saved(self, node: TensorRef, path: str) -> torch.Tensor:
        if not 0 <= node.index < len(self.tensors):
            self.fail(f"the checkpoint refers to tensor {node.index} of {len(self.tensors)}",
                      path)
        return self.tensors[node.index]

    def state_dict_of(self, obj: Any, path: str) -> Any:
        try:
            return obj.state_dict()
        except CheckpointError:
            raise
        except Exception as exc:
            raise StateError(f"state_dict() of {type(obj).__name__} failed: "
                             f"{type(exc).__name__}: {exc}", step=self.step, rank=self.rank,
                             path=path) from exc

    def top(self, live: Any, tree: Any) -> None:
        if not isinstance(live, MutableMapping):
            self.fail(f"the state must be a mutable mapping of names to objects, got "
                      f"{type(live).__name__}",
                      hint='pass for example {"model": model, "optimizer": optimizer}')
        if not isinstance(tree, dict):
            self.fail("the checkpoint's state is not a map")
        missing = [k for k in live if k not in tree]
        if missing:
            self.fail(f"the checkpoint holds no {missing}; it has {sorted(map(str, tree))}",
                      hint="restore into the same state layout that was saved")
        for name, value in live.items():
            self.walk(value, tree[name], str(name), 1)

    def walk(self, obj: Any, node: Any, path: str, depth: int) -> None:
        if depth > 256:
            self.fail("the live state is nested too deeply (a cycle?)", path)
        if isinstance(obj, torch.Tensor):
            if not isinstance(node, TensorRef):
                self.fail(f"the live state has a tensor here, the checkpoint {_kind(node)}",
                          path, hint="restore into the same state layout that was saved")
            self.receivable(obj, path)
            self.same_tensor(obj, self.saved(node, path), path)
        elif _is_stateful(obj):
            if isinstance(obj, torch.nn.Module):
                self.module(obj, node, path)
            elif isinstance(obj, torch.optim.Optimizer):
                self.optimizer(obj, node, path)
            else:
                self.other_stateful(obj, node, path)
        elif isinstance(obj, MutableMapping):
            if not isinstance(node, dict):
                self.fail(f"the live state has a map here, the checkpoint {_kind(node)}", path,
                          hint="restore into the same state layout that was saved")
            missing = [k for k in obj if k not in node]
            if missing:
                self.fail(f"the checkpoint has no key {missing[0]!r}"
                          + (f" (nor {_shown(missing[1:])})" if len(missing) > 1 else ""),
                          path, hint="restore into the same state layout that was saved")
            for key, value in obj.items():
                self.walk(value, node[key], _join(path, key), depth + 1)
        elif isinstance(obj, MutableSequence):
            if not isinstance(node, list) or len(node) != len(obj):
                what = (f"a list of {len(node)}" if isinstance(node, list) else _kind(node))
                self.fail(f"the live state has a list of {len(obj)} here, the checkpoint "
                          f"{what}", path,
                          hint="restore into the same state layout that was saved")
            for i, value in enumerate(obj):
                self.walk(value, node[i], _join(path, i), depth + 1)
        elif _walks_tuple(obj):
            if not isinstance(node, (tuple, list)) or len(node) != len(obj):
                what = (f"a {type(node).__name__} of {len(node)}"
                        if isinstance(node, (tuple, list)) else _kind(node))
                self.fail(f"the live state has a {type(obj).__name__} of {len(obj)} here, "
                          f"the checkpoint {what}", path,
                          hint="restore into the same state layout that was saved")
            for i, value in enumerate(obj):
                self.walk(value, node[i], _join(path, i), depth + 1)
        # anything else is a plain value: the checkpoint's value takes its place

    # ------------------------------------------------------------ tensors

    def receivable(self, t: torch.Tensor, path: str) -> None:
        """The live tensor can take the loaded values in place, exactly."""
        local = _local(t)
        if torch.nn.parameter.is_lazy(local):
            self.fail("the live tensor is an uninitialized lazy parameter or buffer", path,
                      hint="run one forward pass (or build the module with its sizes) "
                           "before restoring")
        if local.is_nested or local.is_quantized or local.layout != torch.strided:
            layout = "nested" if local.is_nested else (
                "quantized" if local.is_quantized else str(local.layout).removeprefix("torch."))
            self.fail(f"the live tensor is a {layout} tensor, which cannot receive the "
                      "checkpoint's values in place", path, hint="use a dense (strided) tensor")
        if type(local) not in (torch.Tensor, torch.nn.Parameter):
            self.fail(f"the live tensor is a {type(local).__name__}, a tensor subclass the "
                      "checkpoint's values cannot be copied into", path,
                      hint="use a plain tensor or a DTensor")
        if local.device.type == "meta":
            self.fail("the live tensor is on the meta device: it has no memory, copying into "
                      "it would do nothing", path,
                      hint="materialize it first, e.g. module.to_empty(device=...)")
        if local.device.type not in ("cpu", "cuda"):
            self.fail(f"the live tensor is on {local.device}; only CPU and CUDA tensors are "
                      "restored", path, hint="move it to the CPU or a CUDA device")
        if local.is_inference():
            self.fail("the live tensor is an inference tensor (made under "
                      "torch.inference_mode): it cannot be updated in place", path,
                      hint="create the state outside torch.inference_mode()")
        if _may_overlap(local):
            self.fail(f"the live tensor's elements share memory (strides {list(local.stride())}"
                      f" for shape {list(local.shape)}, e.g. an expanded tensor): it cannot "
                      "hold every value of the checkpoint", path,
                      hint="give it memory of its own (t.clone() or t.contiguous())")

    def same_tensor(self, live: torch.Tensor, saved: torch.Tensor, path: str, *,
                    dtype: bool = True) -> None:
        live_d, saved_d = _is_dtensor(live), _is_dtensor(saved)
        if live_d != saved_d:
            self.fail(f"the live tensor is a {'DTensor' if live_d else 'plain tensor'}, the "
                      f"checkpoint's a {'DTensor' if saved_d else 'plain tensor'}", path,
                      hint="shard the model the same way (fully_shard) as when it was saved")
        if saved.shape != live.shape or (dtype and saved.dtype != live.dtype):
            self.fail(f"saved tensor is {_describe(saved)}, the live one {_describe(live)}",
                      path, hint="restore into the same state layout that was saved")
        if live_d:
            lp = tuple(live.placements)  # type: ignore[attr-defined]
            sp = tuple(saved.placements)  # type: ignore[attr-defined]
            if lp != sp or live.device_mesh != saved.device_mesh:  # type: ignore[attr-defined]
                self.fail(f"saved DTensor is placed {list(sp)} on mesh "
                          f"{saved.device_mesh}, the live one {list(lp)} on mesh "  # type: ignore[attr-defined]
                          f"{live.device_mesh}", path,  # type: ignore[attr-defined]
                          hint="shard the model the same way as when it was saved")
            if _local(saved).shape != _local(live).shape:
                self.fail(f"saved local shard is {list(_local(saved).shape)}, the live one "
                          f"{list(_local(live).shape)}", path)

    # ------------------------------------------------------------ stateful objects

    def module(self, module: torch.nn.Module, node: Any, path: str) -> None:
        """What a strict ``load_state_dict`` checks (keys, shapes), and dtypes and in-place
        receivability of every parameter and buffer."""
        name = type(module).__name__
        if not isinstance(node, dict):
            self.fail(f"the live state has a module ({name}) here, the checkpoint "
                      f"{_kind(node)}", path)
        live = self.state_dict_of(module, path)
        missing = [k for k in live if k not in node]
        unexpected = [k for k in node if k not in live]
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"the checkpoint lacks {len(missing)} key(s) of the module: "
                             f"{_shown(missing)}")
            if unexpected:
                parts.append(f"it has {len(unexpected)} key(s) the module does not: "
                             f"{_shown(unexpected)}")
            self.fail(f"module {name} does not match the checkpoint: {'; '.join(parts)}", path,
                      hint="restore into a model built the same way as the saved one")
        for key, value in live.items():
            sub = _join(path, key)
            if not isinstance(value, torch.Tensor):
                continue  # extra state: the module's set_extra_state takes what it gets
            if not isinstance(node[key], TensorRef):
                self.fail(f"the module has a tensor here, the checkpoint {_kind(node[key])}",
                          sub)
            self.receivable(value, sub)
            self.same_tensor(value, self.saved(node[key], sub), sub)

    def optimizer(self, opt: torch.optim.Optimizer, node: Any, path: str) -> None:
        """Parameter groups (count, parameters per group), as ``load_state_dict`` checks them,
        and the state's shapes against the live optimizer's state, when it has some."""
        if (not isinstance(node, dict) or not isinstance(node.get("state"), dict)
                or not isinstance(node.get("param_groups"), list)
                or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                           for g in node["param_groups"])):
            self.fail(f"the live state has an optimizer ({type(opt).__name__}) here, the "
                      "checkpoint no optimizer state (a map of 'state' and 'param_groups')",
                      path)
        saved_groups: list[dict[str, Any]] = node["param_groups"]
        groups = opt.param_groups
        if len(saved_groups) != len(groups):
            self.fail(f"the optimizer has {len(groups)} parameter group(s), the checkpoint "
                      f"{len(saved_groups)}", _join(path, "param_groups"),
                      hint="build the optimizer with the same parameter groups as when saved")
        for i, (group, saved) in enumerate(zip(groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                self.fail(f"parameter group {i} of the optimizer has "
                          f"{len(group['params'])} parameter(s), the checkpoint's "
                          f"{len(saved['params'])}", _join(path, f"param_groups/{i}"),
                          hint="build the optimizer with the same parameter groups as when "
                               "saved")
        if not opt.state:
            return
        params = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        for key, entry in node["state"].items():
            param = params.get(key)
            live_entry = opt.state.get(param) if isinstance(param, torch.Tensor) else None
            if not live_entry or not isinstance(entry, dict):
                continue
            for name, value in live_entry.items():
                saved_value = entry.get(name)
                if isinstance(value, torch.Tensor) and isinstance(saved_value, TensorRef):
                    sub = _join(path, f"state/{key}/{name}")
                    self.same_tensor(value, self.saved(saved_value, sub), sub, dtype=False)

    def other_stateful(self, obj: Any, node: Any, path: str) -> None:
        """Key sets (public keys) of ``obj.state_dict()`` and the checkpoint's map, and the
        shapes and dtypes of tensors at the same keys; an empty live state dict takes
        anything."""
        live = self.state_dict_of(obj, path)
        if not isinstance(live, Mapping) or not live or not isinstance(node, dict):
            return
        missing = sorted(map(str, _public_keys(live) - _public_keys(node)))
        unexpected = sorted(map(str, _public_keys(node) - _public_keys(live)))
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"the checkpoint lacks {_shown(missing)}")
            if unexpected:
                parts.append(f"it has {_shown(unexpected)}, which the live one has not")
            self.fail(f"the state of {type(obj).__name__} does not match the checkpoint: "
                      f"{'; '.join(parts)}", path,
                      hint="restore into an object of the same type and configuration")
        self.same_leaves(live, node, path, 0)

    def same_leaves(self, live: Any, node: Any, path: str, depth: int) -> None:
        if depth > 64:
            return
        if isinstance(live, torch.Tensor) and isinstance(node, TensorRef):
            self.same_tensor(live, self.saved(node, path), path)
        elif isinstance(live, Mapping) and isinstance(node, dict):
            for key, value in live.items():
                if key in node:
                    self.same_leaves(value, node[key], _join(path, key), depth + 1)
        elif (isinstance(live, (list, tuple)) and isinstance(node, (list, tuple))
              and len(live) == len(node)):
            for i, (value, sub) in enumerate(zip(live, node)):
                self.same_leaves(value, sub, _join(path, i), depth + 1)


def validate_state(live: Any, tree: Any, tensors: Sequence[torch.Tensor], *, step: int,
                   rank: int | None = None) -> None:
    """Raise StateError if the checkpoint cannot be loaded into ``live``; touches nothing."""
    try:
        _Validator(tensors, step, rank).top(live, tree)
    except CheckpointError:
        raise
    except Exception as exc:  # a live object that misbehaves: still a usage error
        raise StateError(f"checking the live state failed: {type(exc).__name__}: {exc}",
                         step=step, rank=rank) from exc


# ---------------------------------------------------------------- backups

def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s values in host memory (a CPU tensor is cloned, a CUDA one copied)."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    return t.to("cpu", copy=True)


_DEVICE_MARGIN_BYTES = 1 << 30
"""GPU memory left free when backups are kept on the GPU (or a tenth of it, if more)."""


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What identifies the memory a (detached) view reads: the same for every alias of it."""
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))


class BackupCopies:
    """Host copies of the live tensors that a restore will overwrite, taken ahead of time.

    Copying a model's tensors to fresh host memory runs at a few GB/s, as long as reading a
    large part of the checkpoint: taken while the shard is read (``prefetch`` in a worker
    thread), the rollback backup costs the restore almost nothing. Each copy is keyed by the
    memory it read and kept with the tensor's version counter: a tensor changed since (or one
    not prefetched) is copied again when its backup is taken.
    """

    def __init__(self) -> None:
        self._copies: dict[tuple[Any, ...], tuple[int, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._device_budget: dict[int, int] = {}

    def prefetch(self, live: Any, *, device_reserved: Mapping[int, int] | None = None) -> None:
        """Copy what ``apply_state`` would back up: plain tensors, and the tensors of the
        state dicts of stateful objects (not plain optimizers: kept by reference).

        A CUDA tensor is copied on its own GPU where the GPU has room to spare (a copy there
        takes microseconds, to host memory a second per couple of GB), else to host memory.
        ``device_reserved``: bytes per GPU that the restore is about to allocate itself.
        """
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for index in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(index)
                cached = (torch.cuda.memory_reserved(index)
                          - torch.cuda.memory_allocated(index))
                margin = max(_DEVICE_MARGIN_BYTES, total // 10)
                reserved = (device_reserved or {}).get(index, 0)
                self._device_budget[index] = max(0, free + cached - margin - reserved)
        self._walk(live, 0)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _walk(self, obj: Any, depth: int) -> None:
        if depth > 256:
            return
        if isinstance(obj, torch.Tensor):
            self._take(_local(obj))
        elif _is_stateful(obj):
            if not _OptimizerBackup.applies_to(obj):
                self._walk(obj.state_dict(), depth + 1)
        elif isinstance(obj, Mapping):
            for value in list(obj.values()):
                self._walk(value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for value in list(obj):
                self._walk(value, depth + 1)

    def _take(self, t: torch.Tensor) -> None:
        t = t.detach()
        if t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
            return
        key = _view_key(t)
        with self._lock:
            if key in self._copies:
                return
        version = t._version
        nbytes = t.numel() * t.element_size()
        index = t.device.index if t.device.type == "cuda" else None
        if index is not None and self._device_budget.get(index, 0) >= nbytes:
            self._device_budget[index] -= nbytes
            copy_ = t.clone()
        else:
            copy_ = _host_copy(t)
        with self._lock:
            self._copies[key] = (version, copy_)

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """The prefetched copy of ``t`` if it is still current, else a fresh one."""
        t = t.detach()
        with self._lock:
            found = self._copies.pop(_view_key(t), None) if t.layout == torch.strided else None
        if found is not None and found[0] == t._version:
            return found[1]
        return _host_copy(t)

    def clear(self) -> None:
        with self._lock:
            self._copies.clear()


@dataclass(frozen=True, slots=True)
class _HostDTensor:
    """A DTensor's local shard kept on the host, rebuilt on its device when undone."""

    local: torch.Tensor
    device: torch.device
    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def rebuild(self) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(self.local.to(self.device), self.mesh, self.placements,
                                  run_check=False, shape=self.shape, stride=self.stride)


def _deep_copy(obj: Any, depth: int = 0,
               copy_tensor: Callable[[torch.Tensor], torch.Tensor] = _host_copy) -> Any:
    """A copy of a state dict whose tensors are in host memory and share nothing with it."""
    if isinstance(obj, torch.Tensor):
        if _is_dtensor(obj):
            local = _local(obj)
            return _HostDTensor(copy_tensor(local), local.device, obj.device_mesh,  # type: ignore[attr-defined]
                                tuple(obj.placements), obj.shape,  # type: ignore[attr-defined]
                                tuple(obj.stride()))
        return copy_tensor(obj)
    if depth > 256:
        return obj
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = _deep_copy(value, depth + 1, copy_tensor)
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None:  # module versions, read by _load_from_state_dict
            out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list) and type(obj) is list:
        return [_deep_copy(v, depth + 1, copy_tensor) for v in obj]
    if type(obj) is tuple or _is_namedtuple(obj):
        return _rebuild_tuple(obj, [_deep_copy(v, depth + 1, copy_tensor) for v in obj])
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    try:
        return copy.deepcopy(obj)
    except Exception:  # cannot be copied: keep it (it is restored as the same object)
        return obj


def _rebuilt(obj: Any, depth: int = 0) -> Any:
    """The state dict to give back to ``load_state_dict``: DTensors rebuilt on their devices."""
    if isinstance(obj, _HostDTensor):
        return obj.rebuild()
    if depth > 256:
        return obj
    if isinstance(obj, dict):
        if not any(isinstance(v, (_HostDTensor, dict, list, tuple)) for v in obj.values()):
            return obj
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = _rebuilt(value, depth + 1)
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None:
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_rebuilt(v, depth + 1) for v in obj]
    if type(obj) is tuple or _is_namedtuple(obj):
        return _rebuild_tuple(obj, [_rebuilt(v, depth + 1) for v in obj])
    return obj


def _nbytes(obj: Any, depth: int = 0) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, _HostDTensor):
        return _nbytes(obj.local)
    if depth > 256:
        return 0
    if isinstance(obj, dict):
        return sum(_nbytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v, depth + 1) for v in obj)
    return 0


_ABSENT: Any = object()
"""The old value of a container slot that the restore added."""


class _Backup:
    """One journal entry: what undoes one change to the live state."""

    path: str
    nbytes: int = 0

    def undo(self) -> None:
        raise NotImplementedError


class _TensorBackup(_Backup):
    def __init__(self, live: torch.Tensor, path: str, copies: BackupCopies) -> None:
        self.live = live
        self.path = path
        self.old = copies.host_copy(_local(live))
        self.nbytes = _nbytes(self.old)

    def undo(self) -> None:
        with torch.no_grad():
            _local(self.live).copy_(self.old)


class _StatefulBackup(_Backup):
    def __init__(self, obj: Any, path: str, copies: BackupCopies) -> None:
        self.obj = obj
        self.path = path
        self.old = _deep_copy(obj.state_dict(), copy_tensor=copies.host_copy)
        self.nbytes = _nbytes(self.old)

    def undo(self) -> None:
        self.obj.load_state_dict(_rebuilt(self.old))


class _OptimizerBackup(_Backup):
    """The optimizer's own ``state`` and ``param_groups`` objects.

    ``torch.optim.Optimizer.load_state_dict`` never writes into them: it builds new ones
    (from the loaded tensors) and swaps them in. So keeping the old ones is an exact backup
    that copies nothing: no host memory, and no GPU memory beyond what the restore already held
    before the apply (the old state and the loaded one). Used only for optimizers that keep
    that ``load_state_dict`` and have no load hooks; others get a ``_StatefulBackup``.
    """

    def __init__(self, opt: torch.optim.Optimizer, path: str) -> None:
        self.opt = opt
        self.path = path
        self.state = opt.state
        self.param_groups = opt.param_groups

    @staticmethod
    def applies_to(obj: object) -> bool:
        return (isinstance(obj, torch.optim.Optimizer)
                and type(obj).load_state_dict is torch.optim.Optimizer.load_state_dict
                and not getattr(obj, "_optimizer_load_state_dict_pre_hooks", None)
                and not getattr(obj, "_optimizer_load_state_dict_post_hooks", None))

    def undo(self) -> None:
        self.opt.state = self.state
        self.opt.param_groups = self.param_groups


class _SlotBackup(_Backup):
    def __init__(self, container: Any, key: Any, old: Any, path: str) -> None:
        self.container = container
        self.key = key
        self.old = old
        self.path = path

    def undo(self) -> None:
        if self.old is _ABSENT:
            if self.key in self.container:
                del self.container[self.key]
        else:
            self.container[self.key] = self.old


class _RNGBackup(_Backup):
    def __init__(self, restored: RNGState) -> None:
        self.path = "rng"
        if (restored.torch_cuda is not None and torch.cuda.is_available()
                and not torch.cuda.is_initialized()):
            torch.cuda.init()  # so that the CUDA generators' states are captured too
        self.old = RNGState.capture()

    def undo(self) -> None:
        self.old.apply()


class AppliedState:
    """A restore applied to the live state, with what it overwrote, until released."""

    def __init__(self, journal: list[_Backup], *, step: int, rank: int | None) -> None:
        self._journal = journal
        self.step = step
        self.rank = rank

    @property
    def backup_bytes(self) -> int:
        """Memory held by the copies of what was overwritten (host, or the GPU's own where a
        GPU had room to spare)."""
        return sum(entry.nbytes for entry in self._journal)

    def release(self) -> None:
        """Keep what was applied; free the copies."""
        self._journal = []

    def undo(self, *, reason: str | None = None) -> None:
        """Put the live state back as it was, undoing every change in reverse order.

        Raises RestoreError if a change could not be undone (the others are undone still);
        ``reason``, why the restore is rolled back, goes into its message.
        """
        journal, self._journal = self._journal, []
        failed: list[str] = []
        first: BaseException | None = None
        for entry in reversed(journal):
            try:
                entry.undo()
            except Exception as exc:
                failed.append(f"{entry.path}: {type(exc).__name__}: {exc}")
                first = first or exc
        if failed:
            raise RestoreError(
                (f"{reason}; then " if reason else "")
                + f"rolling back the restore of step {self.step} failed for "
                f"{len(failed)} entr{'y' if len(failed) == 1 else 'ies'} ({'; '.join(failed)}):"
                " the live state is partly loaded", step=self.step, rank=self.rank,
                hint="do not train on this state: rebuild it, or restart the job") from first


# ---------------------------------------------------------------- applying

class _Applier:
    def __init__(self, tensors: Sequence[torch.Tensor], journal: list[_Backup],
                 copies: BackupCopies) -> None:
        self.tensors = list(tensors)
        self.journal = journal
        self.copies = copies

    def slot(self, container: Any, key: Any, node: Any, path: str) -> None:
        """Load ``node`` into ``container[key]``; the slot changes only if its value does."""
        old = container[key]
        new = self.load(old, node, path)
        if new is not old:
            self.journal.append(_SlotBackup(container, key, old, path))
            container[key] = new

    def load(self, obj: Any, node: Any, path: str) -> Any:
        """Load ``node`` into ``obj`` in place; return the value its slot should hold."""
        if isinstance(obj, torch.Tensor):
            self._guarded(path, lambda: self._copy_into(obj, node, path))
            return obj
        if _is_stateful(obj):
            self._guarded(path, lambda: self._load_stateful(obj, node, path))
            return obj
        if isinstance(obj, MutableMapping):
            for key in list(node):
                sub = _join(path, key)
                if key in obj:
                    self.slot(obj, key, node[key], sub)
                else:
                    self.journal.append(_SlotBackup(obj, key, _ABSENT, sub))
                    obj[key] = materialize(node[key], self.tensors)
            return obj
        if isinstance(obj, MutableSequence):
            for i in range(len(obj)):
                self.slot(obj, i, node[i], _join(path, i))
            return obj
        if _walks_tuple(obj):
            values = [self.load(v, node[i], _join(path, i)) for i, v in enumerate(obj)]
            if all(new is old for new, old in zip(values, obj)):
                return obj
            return self._guarded(path, lambda: _rebuild_tuple(obj, values))
        return materialize(node, self.tensors)

    def _copy_into(self, live: torch.Tensor, node: TensorRef, path: str) -> None:
        self.journal.append(_TensorBackup(live, path, self.copies))
        with torch.no_grad():
            live.copy_(self.tensors[node.index])

    def _load_stateful(self, obj: Any, node: Any, path: str) -> None:
        if _OptimizerBackup.applies_to(obj):
            self.journal.append(_OptimizerBackup(obj, path))
        else:
            self.journal.append(_StatefulBackup(obj, path, self.copies))
        obj.load_state_dict(materialize(node, self.tensors))

    @staticmethod
    def _guarded(path: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as exc:
            raise StateError(f"loading {path} failed: {type(exc).__name__}: {exc}",
                             path=path) from exc


def apply_state(live: MutableMapping[str, Any], tree: dict[str, Any],
                tensors: Sequence[torch.Tensor], *, step: int, rank: int | None = None,
                rng: RNGState | None = None, copies: BackupCopies | None = None
                ) -> AppliedState:
    """Validate, then load the checkpoint into the live objects in place, and ``rng`` into the
    global generators; on any failure undo every change and raise (StateError for the state,
    RestoreError for the RNG states or a failed rollback). The returned ``AppliedState`` can
    undo it all later. ``copies``: backups prefetched while the checkpoint was read."""
    validate_state(live, tree, tensors, step=step, rank=rank)
    journal: list[_Backup] = []
    applier = _Applier(tensors, journal, copies if copies is not None else BackupCopies())
    stage = "state"
    try:
        for name in list(live):
            applier.slot(live, name, tree[name], name)
        if rng is not None:
            stage = "rng"
            journal.append(_RNGBackup(rng))
            rng.apply()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stage = "cuda"
            torch.cuda.synchronize()
    except BaseException as exc:
        applier.copies.clear()
        applied = AppliedState(journal, step=step, rank=rank)
        # Raises RestoreError (from its own cause, naming this failure) if that fails too.
        applied.undo(reason=f"{type(exc).__name__}: {exc}")
        if not isinstance(exc, Exception):
            raise  # an interrupt: the state is as it was, let it through
        raise _rolled_back(exc, stage, step, rank) from exc
    applier.copies.clear()  # prefetched copies of what was not overwritten after all
    return AppliedState(journal, step=step, rank=rank)


def _rolled_back(exc: Exception, stage: str, step: int, rank: int | None) -> CheckpointError:
    """The error to raise for ``exc`` once every change was undone."""
    done = "; every change was undone: the live state is as it was"
    if isinstance(exc, CheckpointError):
        kind: type[CheckpointError] = type(exc)
        path, hint, message = exc.path, exc.hint, exc.message
    elif stage == "rng":
        kind, path, hint = RestoreError, "rng", None
        message = f"restoring the RNG states failed: {type(exc).__name__}: {exc}"
    else:
        kind, path, hint = RestoreError, None, None
        message = f"loading the state failed: {type(exc).__name__}: {exc}"
    try:
        error = kind(message + done, step=step, rank=rank, path=path, hint=hint)
    except TypeError:  # a subclass with another signature
        error = RestoreError(message + done, step=step, rank=rank, path=path, hint=hint)
    return error


@contextlib.contextmanager
def undone_on_error(applied: AppliedState | None) -> Iterator[None]:
    """Around the rest of a restore after the apply: if it raises (another rank failed, a
    barrier, a cancellation), undo the apply on this thread; if it returns, keep it."""
    try:
        yield
    except BaseException as exc:
        if applied is not None:
            applied.undo(reason=f"the restore did not complete ({type(exc).__name__}: {exc})")
        raise
    if applied is not None:
        applied.release()
