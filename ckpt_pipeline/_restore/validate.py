"""Checking a verified checkpoint against the live state before anything is loaded into it.

``validate_state`` checks everything that can be checked without touching a live object:
keys, list lengths, tensor shapes, dtypes, DTensor or plain, whether each live tensor can
receive data in place (strided, memory of its own, not an inference tensor, not on ``meta``),
modules against ``module.state_dict()`` as a strict ``load_state_dict`` would, optimizers'
parameter groups (and state shapes, when the live optimizer has state), and the key sets of
other stateful objects, and whether live tensors that share memory can all receive their saved
bytes (``aliasing.check_aliasing``). It raises ``StateError`` naming the path. It runs before
the apply (``apply.py``), so that a checkpoint that does not fit is refused with the live state
untouched.

The live state is walked by the rules of ``live.py``, which the apply and its backups
(``apply.py``, ``backups.py``) follow too.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from itertools import chain
from typing import Any, NoReturn

import torch

from .._format.documents import TensorRef
from .._tree import is_dtensor, is_stateful, join_path, state_dict_of
from ..errors import CheckpointError, StateError
from .aliasing import Target, check_aliasing, written
from .live import local_tensor, walks_tuple

__all__ = ("LayoutChanged", "validate_state")


class LayoutChanged(StateError):
    """A saved DTensor's mesh or placements are not the live one's: a restore reshards it
    where every rank finds the same (``reshard.py``)."""

_SHOWN_KEYS = 8
"""How many missing or unexpected keys an error lists."""


# ---------------------------------------------------------------- helpers

def _describe(t: torch.Tensor) -> str:
    kind = "DTensor " if is_dtensor(t) else ""
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
        self.targets: list[Target] = []
        """The live tensors copied into, for the aliasing check once all are known."""
        self.keep_missing = False
        """Top-level entries of the live state that the checkpoint lacks are left alone."""
        self.not_restored: tuple[str, ...] = ()
        self.not_in_checkpoint: tuple[str, ...] = ()

    def fail(self, message: str, path: str | None = None, hint: str | None = None,
             *, layout: bool = False) -> NoReturn:
        kind = LayoutChanged if layout else StateError
        raise kind(message, step=self.step, rank=self.rank, path=path, hint=hint)

    def saved(self, node: TensorRef, path: str) -> torch.Tensor:
        if not 0 <= node.index < len(self.tensors):
            self.fail(f"the checkpoint refers to tensor {node.index} of {len(self.tensors)}",
                      path)
        return self.tensors[node.index]

    def state_dict_of(self, obj: Any, path: str) -> Any:
        try:
            return state_dict_of(obj)
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
        self.not_restored = tuple(str(k) for k in tree if k not in live)
        missing = [k for k in live if k not in tree]
        if missing and not self.keep_missing:
            self.fail(f"the checkpoint holds no {missing}; it has {sorted(map(str, tree))}",
                      hint="restore into the same state layout that was saved, or pass "
                           "missing='keep' to restore what the checkpoint holds and leave "
                           "the new entries as they are")
        self.not_in_checkpoint = tuple(str(k) for k in missing)
        for name, value in live.items():
            if name in tree:
                self.walk(value, tree[name], str(name), 1)
        check_aliasing(self.targets, lambda message, path, hint: self.fail(message, path, hint))

    def walk(self, obj: Any, node: Any, path: str, depth: int) -> None:
        if depth > 256:
            self.fail("the live state is nested too deeply (a cycle?)", path)
        if isinstance(obj, torch.Tensor):
            if not isinstance(node, TensorRef):
                self.fail(f"the live state has a tensor here, the checkpoint {_kind(node)}",
                          path, hint="restore into the same state layout that was saved")
            self.receivable(obj, path, expanded=True)
            saved = self.saved(node, path)
            self.same_tensor(obj, saved, path)
            self.targets.append(Target(path, local_tensor(obj), local_tensor(saved)))
        elif is_stateful(obj):
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
                self.walk(value, node[key], join_path(path, key), depth + 1)
        elif isinstance(obj, MutableSequence):
            if not isinstance(node, list) or len(node) != len(obj):
                what = (f"a list of {len(node)}" if isinstance(node, list) else _kind(node))
                self.fail(f"the live state has a list of {len(obj)} here, the checkpoint "
                          f"{what}", path,
                          hint="restore into the same state layout that was saved")
            for i, value in enumerate(obj):
                self.walk(value, node[i], join_path(path, i), depth + 1)
        elif walks_tuple(obj):
            if not isinstance(node, (tuple, list)) or len(node) != len(obj):
                what = (f"a {type(node).__name__} of {len(node)}"
                        if isinstance(node, (tuple, list)) else _kind(node))
                self.fail(f"the live state has a {type(obj).__name__} of {len(obj)} here, "
                          f"the checkpoint {what}", path,
                          hint="restore into the same state layout that was saved")
            for i, value in enumerate(obj):
                self.walk(value, node[i], join_path(path, i), depth + 1)
        # anything else is a plain value: the checkpoint's value takes its place

    # ------------------------------------------------------------ tensors

    def receivable(self, t: torch.Tensor, path: str, *, expanded: bool = False) -> None:
        """The live tensor can take the loaded values in place, exactly; ``expanded``: a
        dimension of stride 0 is allowed (``aliasing.check_aliasing`` checks its values)."""
        local = local_tensor(t)
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
        if _may_overlap(written(local) if expanded else local):
            self.fail(f"the live tensor's elements share memory (strides {list(local.stride())}"
                      f" for shape {list(local.shape)}, e.g. an expanded tensor): it cannot "
                      "hold every value of the checkpoint", path,
                      hint="give it memory of its own (t.clone() or t.contiguous())")

    def same_tensor(self, live: torch.Tensor, saved: torch.Tensor, path: str, *,
                    dtype: bool = True) -> None:
        live_d, saved_d = is_dtensor(live), is_dtensor(saved)
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
                          hint="shard the model the same way as when it was saved",
                          layout=True)
            if local_tensor(saved).shape != local_tensor(live).shape:
                self.fail(f"saved local shard is {list(local_tensor(saved).shape)}, the live one "
                          f"{list(local_tensor(live).shape)}", path, layout=True)

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
            sub = join_path(path, key)
            if not isinstance(value, torch.Tensor):
                continue  # extra state: the module's set_extra_state takes what it gets
            if not isinstance(node[key], TensorRef):
                self.fail(f"the module has a tensor here, the checkpoint {_kind(node[key])}",
                          sub)
            self.receivable(value, sub)
            saved = self.saved(node[key], sub)
            self.same_tensor(value, saved, sub)
            self.targets.append(Target(sub, local_tensor(value), local_tensor(saved)))

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
                      f"{len(saved_groups)}", join_path(path, "param_groups"),
                      hint="build the optimizer with the same parameter groups as when saved")
        for i, (group, saved) in enumerate(zip(groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                self.fail(f"parameter group {i} of the optimizer has "
                          f"{len(group['params'])} parameter(s), the checkpoint's "
                          f"{len(saved['params'])}", join_path(path, f"param_groups/{i}"),
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
                    sub = join_path(path, f"state/{key}/{name}")
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
                    self.same_leaves(value, node[key], join_path(path, key), depth + 1)
        elif (isinstance(live, (list, tuple)) and isinstance(node, (list, tuple))
              and len(live) == len(node)):
            for i, (value, sub) in enumerate(zip(live, node)):
                self.same_leaves(value, sub, join_path(path, i), depth + 1)


def validate_state(live: Any, tree: Any, tensors: Sequence[torch.Tensor], *, step: int,
                   rank: int | None = None, keep_missing: bool = False
                   ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Raise StateError if the checkpoint cannot be loaded into ``live``; touches nothing.

    Returns (the saved top-level entries ``live`` does not have: they are not restored, the
    top-level entries of ``live`` the checkpoint does not have: with ``keep_missing`` they are
    left as they are, else that is a StateError)."""
    validator = _Validator(tensors, step, rank)
    validator.keep_missing = keep_missing
    try:
        validator.top(live, tree)
    except CheckpointError:
        raise
    except Exception as exc:  # a live object that misbehaves: still a usage error
        raise StateError(f"checking the live state failed: {type(exc).__name__}: {exc}",
                         step=step, rank=rank) from exc
    return validator.not_restored, validator.not_in_checkpoint
