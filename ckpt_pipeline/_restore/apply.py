"""Loading a verified checkpoint into the live state so that a failed restore changes nothing.

``apply_state`` validates (``validate.py``), then applies, appending a backup of everything it
overwrites to a journal (``backups.py``, ``rollback.py``) first. When anything fails (a custom
``load_state_dict``, a hook, the RNG states), the journal is undone in reverse order and the
live state is as it was. On success it returns an ``AppliedState`` whose ``undo()`` does the
same later (another rank failed, the final agreement failed) and ``release()`` frees the
copies.

The rules for the live state: a tensor is loaded in place, bit for bit (``aliasing.copy_exact``;
live tensors that share memory were checked to receive the same bytes where they overlap; a
large one by an exchange of bits with the restored tensor, or by taking its memory: see
``backups.py``); an object with
``state_dict()``/``load_state_dict()`` through ``load_state_dict``; a dict or list in place,
slot by slot (a key only the checkpoint has is added to a dict; at the top level, it is left
out); a tuple that holds tensors or stateful objects (or a namedtuple) is walked like a list and
its slot gets a new tuple of the same type; anything else (plain values, tuples of plain values,
other objects) is replaced by the checkpoint's value.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, MutableMapping, MutableSequence, Sequence
from typing import Any

import torch

from .._format.documents import TensorRef
from .._tree import is_stateful, join_path, materialize
from ..errors import CheckpointError, RestoreError, StateError
from ..train_state import RNGState
from .aliasing import copy_exact
from .backups import (
    ABSENT,
    AdoptedBackup,
    Backup,
    BackupCopies,
    OptimizerBackup,
    RNGBackup,
    SlotBackup,
    StatefulBackup,
    SwappedBackup,
    TensorBackup,
    adoptable,
    restored_local,
    swappable,
)
from .inplace import Prewrites
from .live import local_tensor, rebuild_tuple, walks_tuple
from .rollback import AppliedState

__all__ = ("apply_state",)


class _Applier:
    def __init__(self, tree: Any, tensors: Sequence[torch.Tensor], journal: list[Backup],
                 copies: BackupCopies, prewrites: Prewrites | None = None) -> None:
        self.tensors = list(tensors)
        self.journal = journal
        self.copies = copies
        self.prewrites = prewrites
        self.uses = Counter(_refs(tree))  # a restored tensor used twice is never swapped

    def slot(self, container: Any, key: Any, node: Any, path: str) -> None:
        """Load ``node`` into ``container[key]``; the slot changes only if its value does."""
        old = container[key]
        new = self.load(old, node, path)
        if new is not old:
            self.journal.append(SlotBackup(container, key, old, path))
            container[key] = new

    def load(self, obj: Any, node: Any, path: str) -> Any:
        """Load ``node`` into ``obj`` in place; return the value its slot should hold."""
        if isinstance(obj, torch.Tensor):
            self._guarded(path, lambda: self._copy_into(obj, node, path))
            return obj
        if is_stateful(obj):
            self._guarded(path, lambda: self._load_stateful(obj, node, path))
            return obj
        if isinstance(obj, MutableMapping):
            for key in list(node):
                sub = join_path(path, key)
                if key in obj:
                    self.slot(obj, key, node[key], sub)
                else:
                    self.journal.append(SlotBackup(obj, key, ABSENT, sub))
                    obj[key] = materialize(node[key], self.tensors)
            return obj
        if isinstance(obj, MutableSequence):
            for i in range(len(obj)):
                self.slot(obj, i, node[i], join_path(path, i))
            return obj
        if walks_tuple(obj):
            values = [self.load(v, node[i], join_path(path, i)) for i, v in enumerate(obj)]
            if all(new is old for new, old in zip(values, obj)):
                return obj
            return self._guarded(path, lambda: rebuild_tuple(obj, values))
        return materialize(node, self.tensors)

    def _copy_into(self, live: torch.Tensor, node: TensorRef, path: str) -> None:
        if self._prewritten(live, node.index):
            return
        new = self.tensors[node.index]
        if adoptable(live, new):
            self._adopt(live, new, path)
            return
        if self._swap(live, node.index, path):
            return
        self.journal.append(TensorBackup(live, path, self.copies))
        copy_exact(local_tensor(live), local_tensor(new))

    def _swap(self, live: torch.Tensor, index: int, path: str) -> bool:
        """Exchange the bits of ``live`` and of restored tensor ``index`` where they allow it
        (``swappable``, and the tensor used once): ``live`` then holds the checkpoint's, and
        the restored memory the old bits, its backup. A tensor the reshard read straight
        into (``inplace.py``) holds the checkpoint's bits already, and its backup is in the
        journal from the start: nothing to exchange. Whether it did either."""
        if self._prewritten(live, index):
            return True
        if self.uses[index] != 1:
            return False
        target = _live_local(live)
        new = restored_local(self.tensors[index])
        if not swappable(target, new):
            return False
        backup = SwappedBackup(target, new, path)
        self.journal.append(backup)
        backup.swap()
        self.copies.keep(target, backup.old)  # a StatefulBackup of ``live`` takes the old bits
        return True

    def _prewritten(self, live: torch.Tensor, index: int) -> bool:
        """Whether the reshard read restored tensor ``index`` straight into ``live``'s memory
        (its backup is in the journal already): the old bits are then kept for a
        StatefulBackup of ``live`` to take."""
        if self.prewrites is None:
            return False
        target = _live_local(live)
        old = self.prewrites.backup_of(index, target)
        if old is None:
            return False
        self.copies.keep(target, old)
        return True

    def _adopt(self, live: torch.Tensor, new: torch.Tensor, path: str) -> None:
        """Give ``live`` the restored memory: no copy, and its old memory is the backup."""
        self.journal.append(AdoptedBackup(live, path))
        with torch.no_grad():
            live.set_(new.untyped_storage(), new.storage_offset(), new.shape, new.stride())

    def _load_stateful(self, obj: Any, node: Any, path: str) -> None:
        if OptimizerBackup.applies_to(obj):
            self.journal.append(OptimizerBackup(obj, path))
            obj.load_state_dict(materialize(node, self.tensors))
            return
        adopt = self._adoptions(obj, node) if isinstance(obj, torch.nn.Module) else []
        tensors = self.tensors
        if isinstance(obj, torch.nn.Module) and isinstance(node, dict):
            # Large parameters and buffers that do not own their memory (an FSDP2 shard, a
            # view): their bits are exchanged with the restored ones, which then hold the
            # backup; load_state_dict is given the live tensor itself for them.
            adopted = {id(live) for live, _new, _key in adopt}
            for key, live in obj.state_dict(keep_vars=True).items():
                ref = node.get(key)
                if (isinstance(live, torch.Tensor) and isinstance(ref, TensorRef)
                        and id(live) not in adopted
                        and self._swap(live, ref.index, join_path(path, key))):
                    tensors = tensors if tensors is not self.tensors else list(tensors)
                    tensors[ref.index] = live
        for live, _new, _key in adopt:  # their old memory is their backup: not copied
            self.copies.keep(live, live.detach())
        self.journal.append(StatefulBackup(obj, path, self.copies))
        for live, new, key in adopt:
            self._adopt(live, new, join_path(path, key))
        # load_state_dict still runs (its hooks, its checks); for an adopted or exchanged
        # tensor it copies the memory onto itself.
        obj.load_state_dict(materialize(node, tensors))

    def _adoptions(self, module: torch.nn.Module, node: Any
                   ) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
        """The module's parameters and buffers that can take the restored memory."""
        if not isinstance(node, dict):
            return []
        out = []
        for key, live in module.state_dict(keep_vars=True).items():
            ref = node.get(key)
            if isinstance(live, torch.Tensor) and isinstance(ref, TensorRef):
                new = self.tensors[ref.index]
                if adoptable(live, new):
                    out.append((live, new, key))
        return out

    @staticmethod
    def _guarded(path: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as exc:
            raise StateError(f"loading {path} failed: {type(exc).__name__}: {exc}",
                             path=path) from exc


def _live_local(t: torch.Tensor) -> torch.Tensor:
    """The memory a live tensor is loaded into: a DTensor's local shard, or the tensor."""
    return restored_local(t).detach()


def _refs(node: Any, depth: int = 0) -> Iterator[int]:
    """The tensor index of every TensorRef in a decoded tree, once per reference."""
    if isinstance(node, TensorRef):
        yield node.index
    elif depth < 256 and isinstance(node, dict):
        for value in node.values():
            yield from _refs(value, depth + 1)
    elif depth < 256 and isinstance(node, (list, tuple)):
        for value in node:
            yield from _refs(value, depth + 1)


def apply_state(live: MutableMapping[str, Any], tree: dict[str, Any],
                tensors: Sequence[torch.Tensor], *, step: int, rank: int | None = None,
                rng: RNGState | None = None, copies: BackupCopies | None = None,
                keep_missing: bool = False, prewrites: Prewrites | None = None
                ) -> AppliedState:
    """Load the checkpoint into the live objects in place, and ``rng`` into the global
    generators; on any failure undo every change and raise (StateError for the state,
    RestoreError for the RNG states or a failed rollback). The returned ``AppliedState`` can
    undo it all later. ``copies``: backups prefetched while the checkpoint was read.
    ``prewrites``: live tensors a reshard read straight into; the journal holds their backups
    from the start, so that whatever fails puts them back too.

    The caller validates first (``validate_state``; recovery does it before the ranks vote on
    the load): this does not check again, and whatever changed since still fails into the
    rollback, never into a half-applied state.
    """
    journal: list[Backup] = [] if prewrites is None else list(prewrites.journal())
    applier = _Applier(tree, tensors, journal, copies if copies is not None else BackupCopies(),
                       prewrites)
    stage = "state"
    try:
        for name in list(live):
            if keep_missing and name not in tree:  # new since the save: left as it is
                continue
            applier.slot(live, name, tree[name], name)
        if rng is not None:
            stage = "rng"
            journal.append(RNGBackup(rng))
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
