"""How a Lightning checkpoint dict is stored without pickle, and the retention that keeps what
``ModelCheckpoint`` would keep: the plumbing of ``ckpt_pipeline.integrations.lightning``,
which re-exports the public names.

``encode_checkpoint`` turns the dict into tensors and msgpack-able plain values, recording
which containers were Lightning's own types (``AttributeDict``, ``OrderedDict`` with its
``_metadata``) under one top-level entry; ``decode_checkpoint`` undoes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import ckpt_pipeline as cp

__all__ = ("Converter", "decode_checkpoint", "encode_checkpoint", "retention_for")

Converter = Callable[[str, Any], Any]
"""``convert(key_path, value)``: a plain replacement for a value the pipeline cannot store."""

_TYPES_KEY = "ckpt_pipeline.lightning"
"""The top-level entry recording which containers come back as Lightning's own types."""


def encode_checkpoint(checkpoint: Mapping[str, Any], *, exclude: Iterable[str] = (),
                      convert: Converter | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict as the pipeline stores it: tensors and plain values only.

    ``exclude``: key paths (``"hyper_parameters/encoder"``, keys joined by ``/``) left out.
    ``convert``: called with the key path and the value for anything not storable; returns a
    plain replacement. Raises ``cp.StateError`` naming the key path of a value that stays
    unstorable. ``decode_checkpoint`` undoes it.
    """
    excluded = frozenset(exclude)
    attribute_dicts: list[list[str | int]] = []
    ordered: list[list[Any]] = []
    step = checkpoint.get("global_step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None

    def refuse(path: str, value: Any, why: str) -> cp.StateError:
        return cp.StateError(
            f"checkpoint entry {path!r} {why}; the pipeline stores tensors, None, bool, int, "
            f"float, str, bytes and dicts, lists and tuples of them (no pickle)", step=step,
            path=path,
            hint=f"leave it out with exclude=[{path!r}] (PipelineCheckpointIO or "
                 f"PipelineModelParallelStrategy), or turn it into plain values with "
                 f"convert=lambda path, value: ... (given {path!r} and the "
                 f"{type(value).__qualname__})")

    def walk(value: Any, keys: list[str | int], converted: bool) -> Any:
        path = "/".join(str(k) for k in keys)
        if isinstance(value, torch.Tensor):
            return value
        if value is None or isinstance(value, (bool, str, bytes)):
            return value
        if isinstance(value, float) or (isinstance(value, int) and type(value) in (int, bool)):
            return value
        kind = type(value)
        if kind in (dict, OrderedDict, AttributeDict):
            out: dict[str | int, Any] = {}
            for key, item in value.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise refuse(path or "<top level>", value,
                                 f"has the key {key!r} of type {type(key).__qualname__} "
                                 "(keys must be str or int)")
                sub = [*keys, key]
                if "/".join(str(k) for k in sub) in excluded:
                    continue
                out[key] = walk(item, sub, False)
            if kind is AttributeDict:
                attribute_dicts.append(keys)
            elif kind is OrderedDict:
                metadata = getattr(value, "_metadata", None)
                ordered.append([keys, None if metadata is None else
                                walk(dict(metadata), [*keys, "_metadata"], False)])
            return out
        if kind is list:
            return [walk(item, [*keys, i], False) for i, item in enumerate(value)]
        if kind is tuple:
            return tuple(walk(item, [*keys, i], False) for i, item in enumerate(value))
        if kind.__module__ == "numpy" and getattr(value, "ndim", None) == 0:
            return walk(value.item(), keys, converted)
        if convert is not None and not converted:
            replacement = convert(path, value)
            if replacement is not value:
                return walk(replacement, keys, True)
        why = (f"holds the {kind.__module__}.{kind.__qualname__} that convert= returned"
               if converted else f"holds a {kind.__module__}.{kind.__qualname__}")
        raise refuse(path, value, why)

    for name in checkpoint:
        if not isinstance(name, str):
            raise refuse(repr(name), name, "is a top-level key that is not a string")
    encoded: dict[str, Any] = walk(dict(checkpoint), [], False)
    encoded[_TYPES_KEY] = {"attribute_dicts": attribute_dicts, "ordered_dicts": ordered}
    return encoded


def decode_checkpoint(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint dict Lightning saved, from what ``cp.load`` read (``encode_checkpoint``
    undone: ``AttributeDict`` and ``OrderedDict`` with ``_metadata`` where they were)."""
    checkpoint = dict(tree)
    types = checkpoint.pop(_TYPES_KEY, None) or {}

    def replace(keys: Sequence[str | int], make: Callable[[Any], Any]) -> None:
        if not keys:
            return
        parent: Any = checkpoint
        for key in keys[:-1]:
            parent = parent[key]
        parent[keys[-1]] = make(parent[keys[-1]])

    for keys, metadata in types.get("ordered_dicts", ()):
        def ordered(value: Any, metadata: Any = metadata) -> OrderedDict[Any, Any]:
            result: OrderedDict[Any, Any] = OrderedDict(value)
            if metadata is not None:
                result._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
            return result
        replace(keys, ordered)
    for keys in types.get("attribute_dicts", ()):
        replace(keys, AttributeDict)
    return checkpoint


def retention_for(callbacks: Iterable[Callback]) -> list[cp.RetentionPolicy] | None:
    """The retention that keeps what these ``ModelCheckpoint`` callbacks would keep.

    ``save_top_k=K`` without ``monitor``: ``KeepLast(K)``; with ``monitor``:
    ``KeepBest(K, metric=monitor, mode=mode)`` (the metric is recorded with each save by
    ``PipelineCheckpointCallback`` or ``PipelineModelParallelStrategy``); ``save_top_k=-1``:
    every step (``KeepEvery(1)``).
    None when there is no ``ModelCheckpoint`` that saves (the pipeline's default applies).
    The newest committed step is always kept, which covers ``save_last``.
    """
    policies: list[cp.RetentionPolicy] = []
    for callback in callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.save_top_k == 0:
            continue
        top_k = callback.save_top_k
        if top_k < 0:
            policies.append(cp.KeepEvery(1))
        elif callback.monitor is None:
            policies.append(cp.KeepLast(top_k))
        else:
            if callback.mode == "max":
                policies.append(cp.KeepBest(top_k, metric=callback.monitor, mode="max"))
            else:
                policies.append(cp.KeepBest(top_k, metric=callback.monitor, mode="min"))
    return policies or None
