"""How a restore walks the live state: the rules that validating it (``validate.py``),
loading into it (``apply.py``) and backing it up (``backups.py``) share.

A DTensor is loaded through its local shard; a tuple that holds tensors or stateful objects
(or a namedtuple) is walked element by element, and its slot gets a new tuple of the same
type; any other tuple is a plain value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._tree import is_dtensor, is_stateful

__all__ = ("holds_live_state", "is_namedtuple", "local_tensor", "rebuild_tuple", "walks_tuple")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its memory), or the tensor itself."""
    if is_dtensor(t):
        local: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
        return local
    return t


def is_namedtuple(obj: object) -> bool:
    """Whether ``obj`` is an instance of a ``namedtuple`` class."""
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def holds_live_state(obj: object, depth: int = 0) -> bool:
    """Whether a live container holds something loaded in place (tensor, stateful object)."""
    if isinstance(obj, torch.Tensor) or is_stateful(obj):
        return True
    if depth > 64:
        return False
    if isinstance(obj, Mapping):
        return any(holds_live_state(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_live_state(v, depth + 1) for v in obj)
    return False


def walks_tuple(obj: object) -> bool:
    """A live tuple walked element by element (else its slot takes the checkpoint's value)."""
    return isinstance(obj, tuple) and (is_namedtuple(obj) or holds_live_state(obj))


def rebuild_tuple(like: tuple[Any, ...], values: list[Any]) -> tuple[Any, ...]:
    """A tuple of ``like``'s type (a namedtuple stays one) holding ``values``."""
    kind = type(like)
    if kind is tuple:
        return tuple(values)
    if is_namedtuple(like):
        made: tuple[Any, ...] = kind._make(values)  # type: ignore[attr-defined]
        return made
    rebuilt: tuple[Any, ...] = kind(values)
    return rebuilt
