"""Byte views of host tensors without copies (and without requiring NumPy)."""

from __future__ import annotations

import ctypes

import torch

__all__ = ("byte_view",)


def byte_view(t: torch.Tensor, start: int = 0, stop: int | None = None) -> memoryview:
    """A writable memoryview of bytes [start, stop) of a contiguous CPU tensor.

    The caller keeps ``t`` alive while the view is in use.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    total = t.numel() * t.element_size()
    stop = total if stop is None else stop
    if not 0 <= start <= stop <= total:
        raise ValueError(f"range [{start}, {stop}) is outside {total} bytes")
    length = stop - start
    if length == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * length).from_address(t.data_ptr() + start)
    return memoryview(array).cast("B")
