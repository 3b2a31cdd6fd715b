"""The process that ``tests/pipeline/test_shutdown.py`` ends in every way a training process ends.

Usage::

    python tests/children/shutdown_child.py '{"case": "sigint", "root": "...", "fsync_delay": 1.0}'

The orders (one JSON argument): ``case`` (below), ``root``, ``fsync_delay`` and optionally
``exit_timeout`` (``CheckpointPipeline(exit_timeout_s=...)``) and ``sigterm_handler``.

Every case saves step ``ACKED`` and waits for its commit, then saves step ``IN_FLIGHT`` and
does not wait, and overwrites the live state with the values of step ``IN_FLIGHT + 1`` (the
training goes on: the saved copy must still hold the step's own values). The disk is slow
for that save (``SlowStorage``): its shard's fsync waits until the process begins to end, then
``fsync_delay`` seconds more, then really fsyncs; so the save is surely in flight, in its
fsync, whatever the load of the machine. Then:

- ``normal``: leaves the ``with`` block; ``raise``: raises RuntimeError inside it;
- ``exit``: never closes the pipeline (no ``with``) and returns: the atexit hook closes it;
- ``sigint`` / ``sigterm``: trains (sleeps in a loop) inside the block until a signal ends
  it; ``sigterm_handler`` installs a handler of the application's that raises
  SystemExit(143) (the pipeline's own SIGTERM policy is ``orders["sigterm"]``, default
  ``"finish"``);
- ``sigint_in_save`` / ``sigterm_in_save``: a subscriber sends SIGINT (SIGTERM) to the
  process from inside ``save()``;
- ``sigterm_flag``: ``sigterm="flag"``; trains until ``pipe.preempted``, then saves step
  ``IN_FLIGHT + 1`` (the preemption save) and leaves the block;
- ``async``: ``AsyncCheckpointPipeline`` under four cancellations, one root each below
  ``root`` (``anyio``: a cancel scope, in the fsync; ``asyncio``: ``Task.cancel()``, in the
  fsync; ``early``: a cancel scope right after ``save()`` returned; ``shielded``: a cancel
  scope, with the pending saves waited for in a shielded ``finally``); prints a RESULT line.

It prints ``ACKED step``, ``IN_FLIGHT step``, ``WRITING step unix-time`` (the slow fsync
began), ``TRAINING``, ``RETURNING`` and ``CLOSED seconds handle`` to stdout as it gets
there, and the library's log as JSON lines (with a ``unix`` time) to stderr. The test imports
this module for ``make_state``, ``mismatches`` and the constants.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch

import ckpt_pipeline as cp

ACKED, IN_FLIGHT = 1, 2
SAMPLES_PER_STEP = 64
KEEP_LAST = 2
ASYNC_KINDS = ("anyio", "asyncio", "early", "shielded")

_ROWS, _COLS = 512, 512  # 1 MiB of float32 per matrix
_IDS = 128 * 1024  # 1 MiB of int64
_HALF = 512 * 1024  # 1 MiB of bfloat16


def make_state() -> dict[str, Any]:
    """A model-and-optimizer-like state of ~5 MiB, holding the values of no step."""
    weight = torch.zeros(_ROWS, _COLS)
    return {
        "model": {"weight": weight, "bias": torch.zeros(_ROWS)},
        "optimizer": {"exp_avg": torch.zeros_like(weight), "exp_avg_sq": torch.zeros_like(weight),
                      "step": -1},
        "data": {"ids": torch.zeros(_IDS, dtype=torch.int64),
                 "half": torch.zeros(_HALF, dtype=torch.bfloat16)},
    }


def _live(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"weight": state["model"]["weight"], "bias": state["model"]["bias"],
            "exp_avg": state["optimizer"]["exp_avg"],
            "exp_avg_sq": state["optimizer"]["exp_avg_sq"],
            "ids": state["data"]["ids"], "half": state["data"]["half"]}


def expected_tensors(step: int) -> dict[str, torch.Tensor]:
    """Values that are a function of the step alone, exact in their dtypes."""
    base = torch.arange(_ROWS * _COLS, dtype=torch.float32).view(_ROWS, _COLS)
    return {
        "weight": base.add(step).mul_(0.25),
        "bias": torch.arange(_ROWS, dtype=torch.float32).sub_(step),
        "exp_avg": base.sub(step).mul_(0.5),
        "exp_avg_sq": base.mul(step + 1),
        "ids": torch.arange(_IDS, dtype=torch.int64).mul_(step + 3).add_(step << 40),
        "half": torch.arange(_HALF).remainder_(89).add_(step % 151).to(torch.bfloat16),
    }


def set_step(state: dict[str, Any], step: int) -> None:
    live = _live(state)
    for name, value in expected_tensors(step).items():
        live[name].copy_(value)
    state["optimizer"]["step"] = step


def mismatches(state: dict[str, Any], step: int) -> list[str]:
    """What in ``state`` differs from the values of ``step``; empty when all is exact."""
    live = _live(state)
    out = [name for name, value in expected_tensors(step).items()
           if not torch.equal(live[name], value)]
    if state["optimizer"]["step"] != step:
        out.append(f"optimizer.step is {state['optimizer']['step']!r}")
    return out


def train_state(step: int) -> cp.TrainState:
    return cp.TrainState(step=step, consumed_train_samples=step * SAMPLES_PER_STEP,
                         extra={"tag": f"s{step}"})


class SlowStorage(cp.LocalStorage):
    """A disk whose shard fsync is slow from step ``slow_from`` on.

    Such an fsync waits until ``ending`` is set (the process has begun to end: so the save
    is surely still in flight then, however loaded the machine), then ``delay`` seconds
    more, then calls the real fsync: it changes the timing, never the result.
    """

    def __init__(self, root: str, delay: float, ending: threading.Event,
                 slow_from: int = IN_FLIGHT, on_slow: Callable[[], None] | None = None) -> None:
        super().__init__(root)
        self.delay = delay
        self.ending = ending
        self.slow_from = slow_from
        self.on_slow = on_slow  # called (in the worker thread) as a slow fsync begins
        self._slow_fds: set[int] = set()

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        fd, name = super().create_temp(rel_dir, final_name)
        step = int(rel_dir.rsplit("-", 1)[-1]) if rel_dir.startswith("step-") else -1
        if final_name.endswith(".shard") and step >= self.slow_from:
            self._slow_fds.add(fd)
        else:
            self._slow_fds.discard(fd)
        return fd, name

    def fsync(self, fd: int) -> None:
        if fd in self._slow_fds:
            if self.on_slow is not None:
                self.on_slow()
            self.ending.wait(60)
            time.sleep(self.delay)
        super().fsync(fd)


def _say(*words: object) -> None:
    """One line to stdout in one write: the pipeline's thread says things too."""
    os.write(sys.stdout.fileno(), (" ".join(map(str, words)) + "\n").encode())


_writing = threading.Event()
_ending = threading.Event()


def _announce_writing() -> None:
    """Say WRITING (and the wall-clock time) as the in-flight shard's slow fsync begins."""
    _writing.set()
    _say("WRITING", IN_FLIGHT, f"{time.time():.6f}")


def _first_steps(pipe: cp.CheckpointPipeline, state: dict[str, Any]) -> cp.SaveHandle:
    set_step(state, ACKED)
    pipe.save(ACKED, state, train_state(ACKED)).result(60)
    _say("ACKED", ACKED)
    set_step(state, IN_FLIGHT)
    handle = pipe.save(IN_FLIGHT, state, train_state(IN_FLIGHT))
    _say("IN_FLIGHT", IN_FLIGHT)
    set_step(state, IN_FLIGHT + 1)  # training goes on; the save holds its own copy
    if not _writing.wait(60):  # the save is now surely in flight: in its shard's fsync
        _say("NEVER WRITING")
        sys.exit(4)
    return handle


def _train_until_signalled() -> None:
    _say("TRAINING")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.005)
    _say("NOT SIGNALLED")
    sys.exit(3)


def _train_until_preempted(pipe: cp.CheckpointPipeline, state: dict[str, Any]) -> None:
    _say("TRAINING")
    deadline = time.monotonic() + 60
    while not pipe.preempted:
        if time.monotonic() > deadline:
            _say("NOT SIGNALLED")
            sys.exit(3)
        time.sleep(0.005)
    step = IN_FLIGHT + 1  # the live state holds this step's values (training went on)
    pipe.save(step, state, train_state(step))
    _say("PREEMPTION_SAVE", step)


def run_sync(orders: dict[str, Any]) -> int:
    case = orders["case"]
    state = make_state()
    storage = SlowStorage(orders["root"], orders["fsync_delay"], _ending,
                          on_slow=_announce_writing)
    pipe = cp.CheckpointPipeline(orders["root"], storage=storage, keep_last=KEEP_LAST,
                                 exit_timeout_s=orders.get("exit_timeout", 60.0),
                                 sigterm=orders.get("sigterm", "finish"))
    if case == "exit":
        pipe.open()
        _first_steps(pipe, state)
        _say("RETURNING")
        _ending.set()
        return 0  # no close(): the interpreter's exit finishes (or abandons) the save
    if case in ("sigint_in_save", "sigterm_in_save"):
        signum = signal.SIGINT if case == "sigint_in_save" else signal.SIGTERM

        def interrupt(event: cp.Event) -> None:
            if isinstance(event, cp.SaveRequested) and event.step == IN_FLIGHT:
                os.kill(os.getpid(), signum)

        pipe.subscribe(interrupt)
    if orders.get("sigterm_handler"):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    with pipe:
        try:
            handle = _first_steps(pipe, state)
            if case == "raise":
                raise RuntimeError("boom in the training loop")
            if case in ("sigint", "sigterm", "sigint_in_save", "sigterm_in_save"):
                _train_until_signalled()
            if case == "sigterm_flag":
                _train_until_preempted(pipe, state)
        finally:  # leaving the block (KeyboardInterrupt, SystemExit, ... included)
            _ending.set()
        started = time.monotonic()
    _say("CLOSED", f"{time.monotonic() - started:.3f}", repr(handle))
    return 0


async def _async_case(kind: str, root: Path, delay: float) -> dict[str, Any]:
    """One cancellation with a save in flight; what the handles and the disk say after it."""
    state = make_state()
    in_flight = anyio.Event()
    ending = threading.Event()  # set as the cancellation is requested
    storage = SlowStorage(str(root), delay, ending, on_slow=(
        None if kind == "early" else lambda: anyio.from_thread.run_sync(in_flight.set)))
    handles: list[cp.SaveHandle] = []
    out: dict[str, Any] = {}

    async def body() -> None:
        async with cp.AsyncCheckpointPipeline(root, storage=storage,
                                              keep_last=KEEP_LAST) as pipe:
            try:
                set_step(state, ACKED)
                handles.append(await pipe.save(ACKED, state, train_state(ACKED)))
                await pipe.wait(60)
                set_step(state, IN_FLIGHT)
                handles.append(await pipe.save(IN_FLIGHT, state, train_state(IN_FLIGHT)))
                set_step(state, IN_FLIGHT + 1)
                if kind == "early":  # the save has only just been queued
                    in_flight.set()
                await anyio.sleep(60)
            finally:
                if kind == "shielded":  # the recipe to finish them under cancellation
                    with anyio.CancelScope(shield=True), anyio.move_on_after(60):
                        await pipe.wait()

    if kind == "asyncio":
        task = asyncio.get_running_loop().create_task(body())
        await in_flight.wait()
        cancelled_at = time.monotonic()
        ending.set()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            out["raised"] = "CancelledError"
    else:
        stamps: list[float] = []

        async def cancel_when_in_flight(scope: anyio.CancelScope) -> None:
            await in_flight.wait()
            stamps.append(time.monotonic())
            ending.set()
            scope.cancel()

        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_when_in_flight, scope)
                await body()
        cancelled_at = stamps[0]
    out["seconds_to_exit"] = round(time.monotonic() - cancelled_at, 3)
    out["handles"] = {h.step: _outcome(h) for h in handles}
    out["files"] = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                          if not p.name.startswith(".lock-"))
    return out


def _outcome(handle: cp.SaveHandle) -> str:
    if not handle.done():
        return "pending"
    error = handle.exception(0)
    return "committed" if error is None else type(error).__name__


async def run_async(orders: dict[str, Any]) -> int:
    results = {}
    for kind in ASYNC_KINDS:
        results[kind] = await _async_case(kind, Path(orders["root"]) / kind,
                                          orders["fsync_delay"])
    _say("RESULT", json.dumps(results))
    return 0


def main() -> int:
    # This process is the application: it may configure logging (the library never does).
    cp.enable_logging(logging.INFO, fmt="json")
    torch.set_num_threads(1)
    # Ctrl-C as an interactive Python has it, however the tests were started: a shell that
    # starts a job in the background without job control leaves SIGINT ignored in it and its
    # children, and Python then never raises KeyboardInterrupt (the SIGINT cases hung so).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    orders = json.loads(sys.argv[1])
    if orders["case"] == "async":
        return asyncio.run(run_async(orders))
    return run_sync(orders)


if __name__ == "__main__":
    sys.exit(main())
