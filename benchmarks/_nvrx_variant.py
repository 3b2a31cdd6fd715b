"""The ``nvrx_local`` variant of the training benchmarks: NVIDIA's resiliency extension (NVRx,
PyPI ``nvidia-resiliency-ext``), its local checkpoint manager, saving asynchronously.

Used as its own example and docs use it (``examples/checkpointing/local_ckpt.py`` of the NVRx
repository): every save wraps the state dicts in a ``BasicTensorAwareStateDict``, calls
``LocalCheckpointManager.save(..., is_async=True)`` (device-to-host copies into new CPU tensors,
then ``torch.cuda.synchronize()``), and hands the returned ``AsyncRequest`` to an
``AsyncCallsQueue(persistent=False)``, which forks a process that ``torch.save``-s the state to
``<root>/<session>/<rank>/iter_<step>_<rank>_local.pt.dirty`` and renames it. The training loop
polls ``maybe_finalize_async_calls(blocking=False)`` before every optimizer step (as Megatron-LM
does each iteration); a finished save is finalized there (NVRx's finalize function finds the
newest complete checkpoint across ranks and removes the older ones: it keeps one). A save waits
for the previous one to be finalized first, as ``dcp_async_save`` does, so host memory stays
bounded.

What is measured per save: ``blocking_s`` (the wait for the previous save, the copy and
synchronize, the fork, and the finalization later done on the training thread),
``written_s`` (from the save call until the forked writer exited: file written and renamed).
NVRx does not fsync its files, so ``durable_s`` is that same time, and the report says
``fsync: False``: the bytes may still be in the page cache.

The import is lazy: this module imports without NVRx; the variant then fails in ``prepare()``
with a message that says what to install. It needs CUDA (``BasicTensorAwareStateDict`` accepts
CUDA tensors only, the async save calls ``torch.cuda.synchronize()``) and an initialized
``torch.distributed`` group (the forked caller asks for the rank; the finalization gathers the
ranks' checkpoint lists).
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import wait as wait_for_sentinels
from pathlib import Path
from typing import Any

import torch
from _training_variants import Variant
from _training_workload import Workload

__all__ = ("NVRX_PIN", "NvrxLocal", "NvrxUnavailableError", "import_nvrx")

NVRX_PIN = "nvidia-resiliency-ext==0.4.1"
SESSION_ID = "bench"


class NvrxUnavailableError(RuntimeError):
    """NVRx is not installed, or it cannot run here (no CUDA, no process group)."""


def import_nvrx() -> dict[str, Any]:
    """The three NVRx classes this variant uses, or NvrxUnavailableError saying what to do."""
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
            BasicTensorAwareStateDict,
        )
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )
    except ImportError as exc:
        raise NvrxUnavailableError(
            f"nvrx_local needs NVIDIA's resiliency extension ({exc}); install {NVRX_PIN} "
            "(on the GPU machine: its wheel in .whl/, see benchmarks/README.md), or leave "
            "nvrx_local out of --variants") from exc
    return {"AsyncCallsQueue": AsyncCallsQueue,
            "BasicTensorAwareStateDict": BasicTensorAwareStateDict,
            "LocalCheckpointManager": LocalCheckpointManager}


def _fresh_containers(obj: Any) -> Any:
    """The same tree with new dicts and lists and the same leaves.

    ``BasicTensorAwareStateDict`` replaces the tensors of the dicts it is given in place (by
    their CPU copies); ``optimizer.state_dict()`` hands out the optimizer's own per-parameter
    state dicts, so without new containers the live optimizer would lose its CUDA state.
    """
    if isinstance(obj, dict):
        return {key: _fresh_containers(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_fresh_containers(value) for value in obj]
    return obj


def _leaf_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _leaf_tensors(value)]
    if isinstance(obj, list):
        return [t for value in obj for t in _leaf_tensors(value)]
    return [obj] if isinstance(obj, torch.Tensor) else []


class NvrxLocal(Variant):
    """NVRx ``LocalCheckpointManager`` with asynchronous saves (see the module docstring).

    Untimed before the loop, like ``ckpt_pipeline``'s: a first save at step 0, finalized
    (``first_save``: its blocking time includes the first pinned host allocation).
    """

    name = "nvrx_local"
    uses_before_update = True

    def __init__(self, work: Workload, root: Path, args: Any) -> None:
        super().__init__(work, root, args)
        self.pending: list[dict[str, Any]] = []  # saves scheduled, not finalized yet (oldest first)
        self.watchers: list[threading.Thread] = []
        self.polls: list[float] = []  # seconds of each poll that finalized nothing

    def check_runnable(self) -> None:
        """NvrxUnavailableError unless this machine can run the variant (CUDA, a group)."""
        if self.work.device.type != "cuda":
            raise NvrxUnavailableError(
                "nvrx_local needs CUDA: NVRx's BasicTensorAwareStateDict accepts CUDA tensors "
                "only and its async save calls torch.cuda.synchronize(); leave it out of "
                "--variants on a CPU run")
        if not torch.distributed.is_initialized():
            raise NvrxUnavailableError(
                "nvrx_local needs an initialized torch.distributed group (its async caller asks "
                "for the rank, its finalization gathers every rank's checkpoints); call "
                "bench_training.init_process_group(device) first")
        cpu = [t for t in _leaf_tensors(self.work.state_dicts()) if t.device.type != "cuda"]
        if cpu:
            raise NvrxUnavailableError(
                f"nvrx_local: {len(cpu)} state tensors are not on the GPU (the optimizer keeps "
                "its step counts on the CPU unless AdamW is fused); BasicTensorAwareStateDict "
                "takes CUDA tensors only: run with --fused")

    def prepare(self) -> None:
        nvrx = import_nvrx()
        self.check_runnable()
        self.nvrx = nvrx
        self.root.mkdir(parents=True, exist_ok=True)
        self.manager = nvrx["LocalCheckpointManager"](str(self.root), session_id=SESSION_ID)
        self.queue = nvrx["AsyncCallsQueue"](persistent=False)
        self.extra.update({"library": NVRX_PIN, "fsync": False, "kept_on_disk": 1,
                           "async_caller": "AsyncCallsQueue(persistent=False): a fork per save",
                           "durable_s_is": "written_s (NVRx renames without fsync)"})
        self.work.sync()
        self.save(0)
        self._finalize(blocking=True)
        first = self.saves.pop()
        self.extra["first_save"] = first
        self.extra["first_save_s"] = first["blocking_s"]

    def _finalize(self, *, blocking: bool) -> float:
        """Finalize the saves that are done (all of them with ``blocking``); the seconds spent
        are added to each finalized save's ``blocking_s`` (they are on the training thread)."""
        t0 = time.perf_counter()
        done = self.queue.maybe_finalize_async_calls(blocking=blocking, no_dist=True)
        seconds = time.perf_counter() - t0
        if done:
            share = seconds / len(done)
            for _ in done:
                record = self.pending.pop(0)
                record["finalize_s"] = share
                record["blocking_s"] += share
                record["finalized_s"] = time.perf_counter() - record["_t0"]
        return seconds if done else -seconds

    def before_update(self) -> None:
        if self.pending:
            seconds = self._finalize(blocking=False)
            if seconds < 0:
                self.polls.append(-seconds)

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        waited = 0.0
        if self.pending:  # the previous save first: one copy of the state in host memory
            self._finalize(blocking=True)
            waited = time.perf_counter() - t0
        t1 = time.perf_counter()
        state = self.nvrx["BasicTensorAwareStateDict"](_fresh_containers(self.work.state_dicts()))
        request = self.manager.save(state, step, is_async=True)
        t2 = time.perf_counter()
        self.queue.schedule_async_request(request)
        t3 = time.perf_counter()
        record: dict[str, Any] = {"step": step, "wait_previous_s": waited, "save_call_s": t2 - t1,
                                  "schedule_s": t3 - t2, "blocking_s": t3 - t0, "_t0": t1}
        self.saves.append(record)
        self.pending.append(record)
        self._watch(record)

    def _watch(self, record: dict[str, Any]) -> None:
        """Record when the forked writer of this save exits (``written_s``), from a thread that
        waits on the process's sentinel (it neither joins nor reaps: NVRx does that).

        Only the process's ``Popen`` is held (its pid, sentinel and exit code): the ``Process``
        object holds the save's arguments, and with them its host copy of the state."""
        calls = getattr(self.queue, "async_calls", None)
        process = None
        if calls:
            process = getattr(getattr(calls[-1], "async_caller", None), "process", None)
        popen = getattr(process, "_popen", None)
        if popen is None or getattr(popen, "sentinel", None) is None:
            record["written_s"] = None
            return
        started = record["_t0"]
        record["_popen"] = popen  # its exit code is read once NVRx has joined the process

        def watch(sentinel: int = popen.sentinel) -> None:
            wait_for_sentinels([sentinel])
            record["written_s"] = time.perf_counter() - started
            record["durable_s"] = record["written_s"]

        thread = threading.Thread(target=watch, name="bench-nvrx-watch", daemon=True)
        thread.start()
        self.watchers.append(thread)

    def finish(self) -> None:
        if self.pending:
            self._finalize(blocking=True)

    def after_finish(self) -> None:
        for thread in self.watchers:
            thread.join(timeout=60)
        for record in [*self.saves, self.extra.get("first_save", {})]:
            record.pop("_t0", None)
            popen = record.pop("_popen", None)
            if popen is not None:
                record["exitcode"] = popen.returncode
        files = sorted(p.name for p in (self.root / SESSION_ID).rglob("*") if p.is_file()) \
            if (self.root / SESSION_ID).exists() else []
        self.extra["files_at_end"] = files
        self.extra["polls_without_finalize"] = {"calls": len(self.polls),
                                                "total_s": sum(self.polls)}

    def close(self) -> None:
        queue = getattr(self, "queue", None)
        if queue is not None:
            queue.close()
        for thread in self.watchers:
            thread.join(timeout=60)
        super().close()
