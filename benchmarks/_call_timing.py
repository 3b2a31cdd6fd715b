"""What the integration benchmarks measure around a framework's checkpoint call (issue 27).

``bench_lightning.py``, ``bench_transformers.py`` and ``bench_accelerate.py`` time the same
thing: how long the framework's checkpoint call holds the training thread, with
ckpt_pipeline's integration and with the framework's default, on the CPU or on one CUDA
device. Each save is timed by :class:`CallTimer`, and :func:`comparison` reduces both
methods' saves to medians and the ratios ours / default, against issue 27's goal (ours at most
10% of the default's on a state of at least 100 MB).

On CUDA the default's call returns once its device-to-host copies are done (``torch.save`` and
safetensors copy each tensor to the host before writing it); ours returns once its copies are
queued on a side stream. The GPU is idle at the start of every timed call (the device is
synchronised first, outside the figure), and after our call three figures are kept apart:

- ``call``: the framework's checkpoint call alone;
- ``wait_snapshot``: the ``wait_snapshot()`` the integration makes before the next optimizer
  step, called right after (a GPU-side wait: the caller's stream waits for the copies);
- ``until_copies_done``: from the call's start until the caller's stream, after that wait, is
  done, i.e. the copies have finished on the GPU. Training pays at most this: in a real loop
  the next step's forward and backward overlap the copies, and only its optimizer step waits.

For the default the third figure is its call plus a synchronisation after it (nothing left).
``python benchmarks/_call_timing.py RESULT.json ...`` prints the table of one or more results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = ("DEVICES", "GOAL_MAX_RATIO", "GOAL_MIN_STATE_BYTES", "CallTimer", "comparison",
           "print_table", "resolve_device")

DEVICES = ("cpu", "cuda")
GOAL_MAX_RATIO = 0.10
"""Issue 27: our blocking time at most 10% of the default's ..."""
GOAL_MIN_STATE_BYTES = 100e6
"""... on a state of at least 100 MB."""

T = TypeVar("T")


def resolve_device(name: str) -> torch.device:
    """``--device``'s value as a device; exits with a message when CUDA is asked for and absent."""
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    return torch.device(name)


def settle(device: torch.device) -> None:
    """Wait until the GPU has finished everything queued (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class CallTimer:
    """Seconds of each save of one method, in save order (see the module)."""

    device: torch.device
    call: list[float] = field(default_factory=list)
    wait_snapshot: list[float] = field(default_factory=list)
    until_copies_done: list[float] = field(default_factory=list)
    committed: list[float] = field(default_factory=list)
    _started: float = 0.0

    def time_call(self, call: Callable[[], T],
                  wait_snapshot: Callable[[], object] | None = None) -> T:
        """Run ``call`` (the framework's checkpoint call) on an idle GPU and time it, then
        ``wait_snapshot`` (ours) and the caller's stream until it is done."""
        settle(self.device)
        self._started = time.perf_counter()
        result = call()
        called = time.perf_counter()
        if wait_snapshot is not None:
            wait_snapshot()
            self.wait_snapshot.append(time.perf_counter() - called)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        done = time.perf_counter()
        self.call.append(called - self._started)
        self.until_copies_done.append(done - self._started)
        return result

    def mark_committed(self) -> None:
        """The last timed save is committed now (after waiting for it)."""
        self.committed.append(time.perf_counter() - self._started)

    def record(self) -> dict[str, Any]:
        """Every save's seconds, by figure (those this method has)."""
        figures = {"call_s": self.call, "wait_snapshot_s": self.wait_snapshot,
                   "until_copies_done_s": self.until_copies_done, "committed_s": self.committed}
        return {name: values for name, values in figures.items() if values}


def _later(values: list[float]) -> float | None:
    """The median of the saves after the first (the first allocates buffers), else of all."""
    if not values:
        return None
    return statistics.median(values[1:] or values)


def _ratio(ours: float | None, default: float | None) -> float | None:
    return None if ours is None or not default else ours / default


def comparison(ours: CallTimer, default: CallTimer, *, ours_name: str, default_name: str,
               state_bytes: int) -> dict[str, Any]:
    """Both methods' saves, their medians (saves after the first) and the ratios ours /
    default, with issue 27's goal; the common block of the three benchmarks' JSON."""
    waits = ours.wait_snapshot or [0.0] * len(ours.call)
    ours_blocking = [c + w for c, w in zip(ours.call, waits)]
    medians = {
        "ours": {"call_s": _later(ours.call), "call_plus_wait_snapshot_s": _later(ours_blocking),
                 "until_copies_done_s": _later(ours.until_copies_done),
                 "committed_s": _later(ours.committed)},
        "default": {"call_s": _later(default.call),
                    "until_copies_done_s": _later(default.until_copies_done)},
    }
    ratios = {
        "call": _ratio(medians["ours"]["call_s"], medians["default"]["call_s"]),
        "call_plus_wait_snapshot": _ratio(medians["ours"]["call_plus_wait_snapshot_s"],
                                          medians["default"]["call_s"]),
        "until_copies_done": _ratio(medians["ours"]["until_copies_done_s"],
                                    medians["default"]["until_copies_done_s"]),
    }
    big_enough = state_bytes >= GOAL_MIN_STATE_BYTES
    return {
        "device": ours.device.type,
        "state_bytes": state_bytes,
        "ours_name": ours_name,
        "default_name": default_name,
        "medians_over": "saves after the first (the first allocates buffers: *_first_s)",
        "ours": ours.record() | {"call_first_s": ours.call[0] if ours.call else None,
                                 "committed_first_s": ours.committed[0] if ours.committed
                                 else None},
        "default": default.record() | {"call_first_s": default.call[0] if default.call
                                       else None},
        "medians": medians,
        "ratios_ours_over_default": ratios,
        "goal": {"max_ratio": GOAL_MAX_RATIO, "min_state_bytes": GOAL_MIN_STATE_BYTES,
                 "state_big_enough": big_enough}
                | {f"pass_{name}": (big_enough and ratio is not None
                                    and ratio <= GOAL_MAX_RATIO)
                   for name, ratio in ratios.items()},
    }


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def print_table(rows: list[tuple[str, dict[str, Any]]]) -> None:
    """One line per benchmark: medians in ms and the ratios ours / default."""
    print(f"{'benchmark':<20}{'dev':<5}{'MB':>6}{'default':>10}{'ours call':>11}"
          f"{'+wait_snap':>11}{'copies done':>12}{'committed':>11}"
          f"{'r call':>8}{'r +wait':>8}{'r done':>8}  goal<=0.10")
    for name, comp in rows:
        med, ratios = comp["medians"], comp["ratios_ours_over_default"]
        goal = comp["goal"]
        verdict = ("state < 100 MB" if not goal["state_big_enough"] else
                   f"call {'pass' if goal['pass_call'] else 'FAIL'}, "
                   f"+wait {'pass' if goal['pass_call_plus_wait_snapshot'] else 'FAIL'}")
        print(f"{name:<20}{comp['device']:<5}{comp['state_bytes'] / 1e6:>6.0f}"
              f"{_ms(med['default']['call_s']):>10}{_ms(med['ours']['call_s']):>11}"
              f"{_ms(med['ours']['call_plus_wait_snapshot_s']):>11}"
              f"{_ms(med['ours']['until_copies_done_s']):>12}"
              f"{_ms(med['ours']['committed_s']):>11}"
              f"{_x(ratios['call']):>8}{_x(ratios['call_plus_wait_snapshot']):>8}"
              f"{_x(ratios['until_copies_done']):>8}  {verdict}")
    print("medians in ms over the saves after the first; r = ours / default; 'copies done': "
          "from our call's start until the training stream, after wait_snapshot, is done; "
          "'committed': until the step is durable (fsync; the default makes none)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The table of integration benchmark results.")
    parser.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args(argv)
    rows: list[tuple[str, dict[str, Any]]] = []
    for path in args.results:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"{path}: {exc}")
            continue
        if "comparison" not in report:
            print(f"{path}: no 'comparison' block")
            continue
        rows.append((report.get("benchmark", path.stem), report["comparison"]))
    if rows:
        print_table(rows)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
