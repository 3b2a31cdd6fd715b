"""The journal's entries: what undoes each change that a restore makes to the live state.

Before the apply (``apply.py``) overwrites anything it appends a backup of it to the journal.
A large live tensor of contiguous memory that the restore's read memory can be exchanged with
(``swappable``: a view, an FSDP2 shard, a DTensor's local shard, a module parameter that does
not own its memory) gets the checkpoint's bits by an exchange, and the read memory, which then
holds the old bits, is its backup (``SwappedBackup``): no copy to fresh memory, which costs more
than the exchange wherever the kernel must first fault the pages in. A large CPU tensor that
owns its memory is handed the read memory instead (``AdoptedBackup``). Else a host copy of each
live tensor (CUDA tensors are copied to host memory, so no GPU memory is doubled;
``BackupCopies`` takes those copies ahead of time, while the shard is read), a deep
copy of ``obj.state_dict()`` (tensors on the host) before ``obj.load_state_dict`` (for a plain
``torch.optim`` optimizer, whose ``load_state_dict`` replaces its state rather than writing
into it, the old state objects themselves: nothing is copied), the old value (or its absence)
of every container slot it changes, and the RNG states before it sets them. Each entry's
``undo`` puts back what it kept; ``rollback.py`` undoes a journal in reverse order.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._tree import is_dtensor, is_stateful, state_dict_of
from ..train_state import RNGState
from .aliasing import copy_exact, exact, exact_clone, written
from .live import is_namedtuple, local_tensor, rebuild_tuple

__all__ = ("ABSENT", "ADOPT_MIN_BYTES", "AdoptedBackup", "Backup", "BackupCopies",
           "OptimizerBackup", "RNGBackup", "SlotBackup", "StatefulBackup", "SwappedBackup",
           "TensorBackup", "adoptable", "owns_memory", "restored_local", "swap_candidate",
           "swappable", "view_key")


# ---------------------------------------------------------------- copies

def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s bits in host memory (a CPU tensor is cloned, a CUDA one copied)."""
    return exact_clone(t, "cpu")


ADOPT_MIN_BYTES = 1 << 20
"""CPU tensors at least this large take the restored memory instead of a copy of it."""


def _use_count(t: torch.Tensor) -> int | None:
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    try:
        return int(counter(t.untyped_storage()._cdata)) - 1  # this call's storage object
    except (RuntimeError, TypeError, AttributeError):
        return None


def owns_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is a large CPU tensor that alone uses memory of exactly its size, private
    to this process and not pinned: it may be given other memory without anyone seeing it
    (but raw pointers to it, such as a ``numpy()`` view)."""
    nbytes = t.numel() * t.element_size()
    if (nbytes < ADOPT_MIN_BYTES or not t.is_cpu
            or type(t) not in (torch.Tensor, torch.nn.Parameter)
            or t.layout != torch.strided or t.grad_fn is not None or t._base is not None
            or t.storage_offset() != 0):
        return False
    storage = t.untyped_storage()
    if (storage.nbytes() != nbytes or t.is_shared()
            or t.is_pinned() or getattr(storage, "filename", None) is not None):
        return False
    return _use_count(t) == 1


def adoptable(live: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether ``live`` can take ``new``'s memory (same layout, neither used elsewhere)."""
    return (live.dtype == new.dtype and live.shape == new.shape
            and live.stride() == new.stride() and owns_memory(live) and owns_memory(new))


def restored_local(t: torch.Tensor) -> torch.Tensor:
    """The memory a restored tensor's bits are in: a DTensor's local shard (its own object,
    not a ``to_local()`` view of it), or the tensor itself."""
    if is_dtensor(t):
        local: torch.Tensor = t._local_tensor  # type: ignore[attr-defined]
        return local
    return t


def _private(t: torch.Tensor) -> bool:
    """Whether ``t`` (a tensor a restore read into, or ``DTensor.from_local``'s view of one)
    is the only user of memory of exactly its size: no other tensor sees a write to it."""
    expected = 1
    base = t._base
    if base is not None:  # from_local's view of the whole tensor read
        if (base._base is not None or base.data_ptr() != t.data_ptr()
                or base.shape != t.shape or base.stride() != t.stride()):
            return False
        expected = 2  # the view's and its base's references to the storage
    if t.layout != torch.strided or t.storage_offset() != 0:
        return False
    storage = t.untyped_storage()
    if (storage.nbytes() != t.numel() * t.element_size() or t.is_shared()
            or getattr(storage, "filename", None) is not None):
        return False
    return _use_count(t) == expected


def swap_candidate(t: torch.Tensor) -> bool:
    """Whether a live tensor is laid out for ``SwappedBackup``: contiguous memory on the CPU or
    a GPU, at least ``ADOPT_MIN_BYTES``, read as it is stored (no conjugate or negative
    bit)."""
    return (t.layout == torch.strided and t.device.type in ("cpu", "cuda")
            and t.numel() * t.element_size() >= ADOPT_MIN_BYTES and t.is_contiguous()
            and not t.is_conj() and not t.is_neg())


def swappable(live: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether the apply may exchange the bits of the live tensor ``live`` and of the restored
    ``new`` (both local tensors) instead of backing ``live`` up and copying: one dtype, shape
    and device, both ``swap_candidate``, and ``new`` private to the restore."""
    return (live.dtype == new.dtype and live.shape == new.shape and live.device == new.device
            and swap_candidate(live) and swap_candidate(new) and _private(new))


_DEVICE_MARGIN_BYTES = 1 << 30
"""GPU memory left free when backups are kept on the GPU (or a tenth of it, if more)."""


def view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What identifies the memory a (detached) view reads: the same for every alias of it."""
    return (t.get_device(), t.data_ptr(), t.dtype, t.shape, t.stride())


class BackupCopies:
    """Host copies of the live tensors that a restore will overwrite, taken ahead of time.

    Copying a model's tensors to fresh host memory runs at a few GB/s, as long as reading a
    large part of the checkpoint: taken while the shard is read (``prefetch`` in a worker
    thread), the rollback backup costs the restore almost nothing. Each copy is keyed by the
    memory it read and kept with the tensor's version counter: a tensor changed since (or one
    not prefetched) is copied again when its backup is taken.
    """

    def __init__(self) -> None:
        self._copies: dict[tuple[Any, ...], tuple[int | None, torch.Tensor]] = {}
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

    def _walk(self, obj: Any, depth: int, swapped: bool = True) -> None:
        """``swapped``: whether the apply exchanges bits with the tensors found here (a
        tensor of the state, a module's parameters and buffers), not copies them."""
        if depth > 256:
            return
        if isinstance(obj, torch.Tensor):
            self._take(written(local_tensor(obj)), swapped)
        elif is_stateful(obj):
            if not OptimizerBackup.applies_to(obj):
                self._walk(state_dict_of(obj), depth + 1,
                           swapped and isinstance(obj, torch.nn.Module))
        elif isinstance(obj, Mapping):
            for value in list(obj.values()):
                self._walk(value, depth + 1, swapped)
        elif isinstance(obj, (list, tuple)):
            for value in list(obj):
                self._walk(value, depth + 1, swapped)

    def _take(self, t: torch.Tensor, swapped: bool) -> None:
        if t.is_cpu and t.numel() * t.element_size() < ADOPT_MIN_BYTES:
            return  # copied when its backup is taken: cheaper than keying it here
        if owns_memory(t):
            return  # the restore will likely hand it the read memory: nothing to copy
        if swapped and swap_candidate(t):
            return  # the apply will likely exchange its bits with the read memory's
        t = t.detach()
        if t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
            return
        key = view_key(t)
        with self._lock:
            if key in self._copies:
                return
        version = t._version
        nbytes = t.numel() * t.element_size()
        index = t.device.index if t.device.type == "cuda" else None
        if index is not None and self._device_budget.get(index, 0) >= nbytes:
            self._device_budget[index] -= nbytes
            copy_ = exact_clone(t)
        else:
            copy_ = _host_copy(t)
        with self._lock:
            self._copies[key] = (version, copy_)

    def keep(self, t: torch.Tensor, old: torch.Tensor) -> None:
        """``old`` holds the values ``t``'s memory had before the restore wrote into it, and
        nothing will write into ``old``: the next ``host_copy`` of that memory returns it
        instead of copying. It is taken by the memory's key alone, never by its version
        counter: the other views of it that a backup meets (a module's ``state_dict()``,
        FSDP2's sharded parameters) can have counters of their own, and the exchange has
        already written into it."""
        with self._lock:
            self._copies[view_key(t.detach())] = (None, old)

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """The prefetched copy of ``t`` if it is still current, else a fresh one."""
        t = t.detach()
        if t.is_cpu and t.numel() * t.element_size() < ADOPT_MIN_BYTES:
            return exact_clone(t)  # never prefetched nor kept (``_take``, ``keep``)
        with self._lock:
            found = self._copies.pop(view_key(t), None) if t.layout == torch.strided else None
        if found is not None and (found[0] is None or found[0] == t._version):
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
        if is_dtensor(obj):
            local = local_tensor(obj)
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
    if type(obj) is tuple or is_namedtuple(obj):
        return rebuild_tuple(obj, [_deep_copy(v, depth + 1, copy_tensor) for v in obj])
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
    if type(obj) is tuple or is_namedtuple(obj):
        return rebuild_tuple(obj, [_rebuilt(v, depth + 1) for v in obj])
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


ABSENT: Any = object()
"""The old value of a container slot that the restore added."""


class Backup:
    """One journal entry: what undoes one change to the live state."""

    path: str
    nbytes: int = 0

    def undo(self) -> None:
        raise NotImplementedError


class TensorBackup(Backup):
    """A copy of the live tensor's bits (of the part a copy writes, for an expanded one)."""

    def __init__(self, live: torch.Tensor, path: str, copies: BackupCopies) -> None:
        self.live = live
        self.path = path
        self.old = copies.host_copy(written(local_tensor(live)))
        self.nbytes = _nbytes(self.old)

    def undo(self) -> None:
        copy_exact(written(local_tensor(self.live)), self.old)


SWAP_CHUNK_BYTES = {"cpu": 1 << 20, "cuda": 64 << 20}
"""How much of a tensor each step of an exchange of bits moves through its scratch buffer: on
the host, a buffer that stays in a core's cache (1 MiB exchanged 512 MiB in 72 ms on the 2-core
VM, 4 MiB in 92 ms: ``benchmarks/probe_swap_chunk.py``)."""


class SwappedBackup(Backup):
    """A live tensor whose bits were exchanged with the restored tensor's (``swap``): the
    restored memory then holds the old bits and is the backup, so nothing is copied to fresh
    memory. Both are contiguous, of one dtype, shape and device (``swappable``); the exchange
    goes through a small scratch buffer, a chunk at a time, and ``undo`` exchanges back the
    chunks done (also after an exchange that failed part way)."""

    def __init__(self, live: torch.Tensor, new: torch.Tensor, path: str) -> None:
        self.live = live.detach()
        self.old = new.detach()  # the restored bits until ``swap``, the old ones after it
        self.path = path
        self.nbytes = new.numel() * new.element_size()
        self._done = 0

    def swap(self) -> None:
        self._done = 0
        self._exchange(self.nbytes, done=True)

    def undo(self) -> None:
        self._exchange(self._done, done=False)
        self._done = 0

    def _exchange(self, end: int, *, done: bool) -> None:
        if end <= 0:
            return
        live = exact(self.live).reshape(-1).view(torch.uint8)
        old = exact(self.old).reshape(-1).view(torch.uint8)
        step = SWAP_CHUNK_BYTES.get(live.device.type, 4 << 20)
        scratch = torch.empty(min(step, end), dtype=torch.uint8, device=live.device)
        with torch.no_grad():
            for start in range(0, end, step):
                stop = min(start + step, end)
                here = scratch[:stop - start]
                here.copy_(live[start:stop])
                live[start:stop].copy_(old[start:stop])
                old[start:stop].copy_(here)
                if done:
                    self._done = stop


class AdoptedBackup(Backup):
    """A live tensor given the restored memory: undone by giving it its old memory back."""

    def __init__(self, live: torch.Tensor, path: str) -> None:
        self.live = live
        self.path = path
        self.old = live.detach()  # keeps the old memory, untouched from now on

    def undo(self) -> None:
        with torch.no_grad():
            old = self.old
            self.live.set_(old.untyped_storage(), old.storage_offset(), old.shape, old.stride())


class StatefulBackup(Backup):
    def __init__(self, obj: Any, path: str, copies: BackupCopies) -> None:
        self.obj = obj
        self.path = path
        self.old = _deep_copy(state_dict_of(obj), copy_tensor=copies.host_copy)
        self.nbytes = _nbytes(self.old)

    def undo(self) -> None:
        self.obj.load_state_dict(_rebuilt(self.old))


class OptimizerBackup(Backup):
    """The optimizer's own ``state`` and ``param_groups`` objects.

    ``torch.optim.Optimizer.load_state_dict`` never writes into them: it builds new ones
    (from the loaded tensors) and swaps them in. So keeping the old ones is an exact backup
    that copies nothing: no host memory, and no GPU memory beyond what the restore already held
    before the apply (the old state and the loaded one). Used only for optimizers that keep
    that ``load_state_dict`` and have no load hooks; others get a ``StatefulBackup``.
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


class SlotBackup(Backup):
    def __init__(self, container: Any, key: Any, old: Any, path: str) -> None:
        self.container = container
        self.key = key
        self.old = old
        self.path = path

    def undo(self) -> None:
        if self.old is ABSENT:
            if self.key in self.container:
                del self.container[self.key]
        else:
            self.container[self.key] = self.old


class RNGBackup(Backup):
    def __init__(self, restored: RNGState) -> None:
        self.path = "rng"
        if (restored.torch_cuda is not None and torch.cuda.is_available()
                and not torch.cuda.is_initialized()):
            torch.cuda.init()  # so that the CUDA generators' states are captured too
        self.old = RNGState.capture()

    def undo(self) -> None:
        self.old.apply()
