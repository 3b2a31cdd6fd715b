"""Live tensors that share memory: bit-exact copies into them, and which aliasing a restore can
reproduce.

A copy into a live tensor goes through an integer view of the same width (``exact``): a bool
holding the byte 2, a NaN's payload, a float8's bits are copied as they were saved, where a
copy of the tensor's own dtype may normalize them (a strided bool copy stores 0 or 1). The
view shares the tensor's version counter, so the write is seen as an in-place update.

Live tensors that share memory (a tensor and a view of it in another dtype, overlapping slices,
a transposed view, tied weights) are each copied in turn, so the last one written wins where
they overlap. That is exact when every tensor writing a byte writes the same saved byte there:
``check_aliasing`` proves it before anything is loaded, at once when the checkpoint holds the
tensors as views of one saved storage laid out as the live ones are (a relative byte offset and
the same strides: the bytes come from one place), else by writing the saved bytes into scratch
memory as the apply would and reading every tensor back. A live aliasing it cannot reproduce is
refused with a StateError naming both tensors. An expanded live tensor (a dimension of stride 0)
is written through one element of each such dimension; the saved values must then be the same
along it, which the same check proves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, NoReturn

import torch

__all__ = ("Target", "check_aliasing", "copy_exact", "exact", "exact_clone", "memory_range",
           "written")

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def exact(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as integers of its element width (a view: writes go to ``t``)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INTS[t.element_size()])


def _expanded_dims(t: torch.Tensor) -> list[int]:
    return [d for d, (n, s) in enumerate(zip(t.shape, t.stride())) if s == 0 and n > 1]


def written(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """The part of ``t`` that a copy into ``like`` (default: ``t``) writes: each dimension of
    stride 0 in ``like`` narrowed to its first element."""
    for d in _expanded_dims(t if like is None else like):
        t = t.narrow(d, 0, 1)
    return t


def copy_exact(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s bits into the live tensor ``dst`` (same dtype and shape). A conjugate or
    negative view is written by value (its memory then holds the conjugate or the negation)."""
    with torch.no_grad():
        if dst.is_conj() or dst.is_neg():
            written(dst).copy_(written(src, dst))
        else:
            exact(written(dst)).copy_(exact(written(src, dst).resolve_conj().resolve_neg()))


def exact_clone(t: torch.Tensor, device: str | torch.device | None = None) -> torch.Tensor:
    """A copy of ``t``'s bits (on ``device``, default its own) sharing nothing with it."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    raw = exact(t)
    copied = raw.clone() if device is None or torch.device(device) == t.device else raw.to(
        device, copy=True)
    if t.is_complex():
        return torch.view_as_complex(copied.view(torch.float32 if t.element_size() == 8
                                                 else torch.float64))
    return copied.view(t.dtype)


class Target(NamedTuple):
    """A live tensor the apply copies into, and the saved tensor it receives."""

    path: str
    live: torch.Tensor
    saved: torch.Tensor


def _raw(t: torch.Tensor, base: torch.Tensor | None = None, origin: int = 0) -> torch.Tensor:
    """``t``'s bytes as a uint8 view ``[*shape, element size]`` of its storage, or of ``base``
    (a uint8 buffer standing for its storage from byte ``origin`` on)."""
    k = t.element_size()
    shape = (*t.shape, k)
    stride = (*(s * k for s in t.stride()), 1)
    offset = t.storage_offset() * k
    if base is not None:
        return base.as_strided(shape, stride, offset - origin)
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    return out.set_(t.untyped_storage(), offset, shape, stride)


def _image(target: Target) -> torch.Tensor:
    """The bytes the apply leaves in the live tensor's memory (as ``_raw`` of it)."""
    saved, live = target.saved, target.live
    if live.is_conj():
        saved = saved.conj()
    if live.is_neg():
        saved = saved.neg()
    return _raw(saved.resolve_conj().resolve_neg())


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) of a non-empty tensor's elements in its storage."""
    k = t.element_size()
    start = int(t.storage_offset()) * k
    return start, start + (sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * k


def memory_range(t: torch.Tensor) -> tuple[int, int]:
    """The addresses [start, end) of a non-empty tensor's elements."""
    base = t.untyped_storage().data_ptr()
    start, end = _extent(t)
    return base + start, base + end


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def _one_source(component: Sequence[Target]) -> bool:
    """Whether the saved tensors are views of one saved storage laid out as the live ones:
    every live byte then receives one saved byte, whichever tensor writes it."""
    if len({_storage_key(t.saved) for t in component}) != 1:
        return False
    delta = None
    for t in component:
        if (t.live.is_conj() or t.live.is_neg() or t.live.stride() != t.saved.stride()
                or t.live.dtype != t.saved.dtype):
            return False
        d = (t.live.storage_offset() - t.saved.storage_offset()) * t.live.element_size()
        if delta is None:
            delta = d
        elif d != delta:
            return False
    return True


def _write(scratch: torch.Tensor, origin: int, target: Target) -> None:
    live = written(target.live)
    image = written(_image(target), target.live)
    _raw(live, scratch, origin).copy_(image.to(scratch.device))


def _reads_back(scratch: torch.Tensor, origin: int, target: Target) -> bool:
    return torch.equal(_raw(target.live, scratch, origin), _image(target).to(scratch.device))


def _conflict(component: Sequence[Target]) -> tuple[Target, Target | None] | None:
    """A live tensor that would not read back its saved bytes (and one that overwrites them,
    None for an expanded tensor whose saved values differ along a dimension of stride 0)."""
    lo = min(_extent(t.live)[0] for t in component)
    hi = max(_extent(t.live)[1] for t in component)
    device = component[0].saved.device
    scratch = torch.zeros(hi - lo, dtype=torch.uint8, device=device)
    for t in component:
        _write(scratch, lo, t)
    bad = [t for t in component if not _reads_back(scratch, lo, t)]
    if not bad:
        return None
    for a in bad:
        _write(scratch, lo, a)
        if not _reads_back(scratch, lo, a):
            return a, None
        for b in component:
            if b is not a:
                _write(scratch, lo, a)
                _write(scratch, lo, b)
                if not _reads_back(scratch, lo, a):
                    return a, b
    return bad[0], None  # not reached: disagreeing writers are found pairwise


def check_aliasing(targets: Sequence[Target], fail: Callable[[str, str, str], NoReturn]
                   ) -> None:
    """Refuse (``fail(message, path, hint)``) live aliasing a restore cannot reproduce bit
    for bit; touches no live tensor."""
    groups: dict[tuple[torch.device, int], list[Target]] = {}
    for t in targets:
        if t.live.numel() and t.saved.numel():
            groups.setdefault(_storage_key(t.live), []).append(t)
    for members in groups.values():
        members.sort(key=lambda t: _extent(t.live))
        component: list[Target] = []
        reach = -1
        for t in members:
            start, end = _extent(t.live)
            if component and start >= reach:  # shares no byte with the ones before
                _check(component, fail)
                component = []
            component.append(t)
            reach = max(reach, end)
        if component:
            _check(component, fail)


def _check(component: list[Target], fail: Callable[[str, str, str], NoReturn]) -> None:
    if len(component) == 1 and not _expanded_dims(component[0].live):
        return
    if _one_source(component):
        return
    found = _conflict(component)
    if found is None:
        return
    a, b = found
    if b is None:
        fail(f"the live tensor is expanded (strides {list(a.live.stride())} for shape "
             f"{list(a.live.shape)}), but the checkpoint's values differ along its "
             "dimensions of stride 0: it cannot hold them", a.path,
             "give it memory of its own (t.clone() or t.contiguous())")
    fail(f"the live tensors {a.path!r} and {b.path!r} share memory, and the checkpoint's "
         f"values for them differ where they overlap: restoring {b.path!r} would overwrite "
         f"what was saved for {a.path!r}", a.path,
         "restore into tensors that share memory as the saved ones did (or not at all: give "
         "each its own memory with t.clone(), and tie them again after the restore)")
