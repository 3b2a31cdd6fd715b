"""A training process with one kind of logging set-up, for ``tests/test_logging.py``.

Usage: ``python tests/children/logging_child.py MODE ROOT RESULT``. It saves steps 1..5 (waiting for
each commit) and restores once, then writes ``ok <latest step>`` to RESULT. Modes:

- ``silent``: no logging configured at all (the library must print nothing);
- ``stdout-basic``: ``logging.basicConfig(stream=sys.stdout, level=DEBUG)`` (the test gives
  it a stdout whose reader is gone: ``python train.py | head``);
- ``stdout-enabled``: ``ckpt_pipeline.enable_logging("DEBUG", stream=sys.stdout)``, same;
- ``full-disk``: both a basicConfig file handler and ``enable_logging`` on ``/dev/full``
  (every write fails with ENOSPC);
- ``raising-handler``: a handler whose ``emit`` raises, and a subscriber that raises;
- ``failing-saves``: no logging configured, and the disk reports itself full for steps 2, 3
  and 4 (the README's loop: each save's handle is only waited for, never asked to raise);
  with ``max_failures_in_row=3`` the save of step 5 raises, and RESULT gets ``raised <step>``.
"""

from __future__ import annotations

import errno
import logging
import sys
from pathlib import Path

import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import Fault, FaultyStorage


class _Raising(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("this handler is broken")


def _configure(mode: str) -> None:
    if mode == "stdout-basic":
        logging.basicConfig(stream=sys.stdout, level=logging.DEBUG)
    elif mode == "stdout-enabled":
        cp.enable_logging("DEBUG", stream=sys.stdout)
    elif mode == "full-disk":
        logging.basicConfig(filename="/dev/full", level=logging.DEBUG)
        cp.enable_logging("DEBUG", stream=open("/dev/full", "w"))  # noqa: SIM115
    elif mode == "raising-handler":
        logger = logging.getLogger("ckpt_pipeline")
        logger.addHandler(_Raising())
        logger.setLevel(logging.DEBUG)
    elif mode not in ("silent", "failing-saves"):
        raise SystemExit(f"unknown mode {mode}")


def _failing_saves(root: str, result: Path) -> int:
    storage = FaultyStorage(root)
    state = {"w": torch.zeros(64)}
    with cp.CheckpointPipeline(root, storage=storage, max_failures_in_row=3) as pipe:
        for step in range(1, 6):
            if step in (2, 3, 4):
                storage.arm(Fault("free_bytes", 1, errno.ENOSPC))
            state["w"].fill_(float(step))
            try:
                handle = pipe.save(step, state)
            except cp.SaveError:
                result.write_text(f"raised {step}\n")
                return 0
            handle.exception(30)  # settled, failed or not
    result.write_text("no save raised\n")
    return 0


def main() -> int:
    mode, root, result = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    _configure(mode)
    if mode == "failing-saves":
        return _failing_saves(root, result)
    torch.set_num_threads(1)
    state = {"w": torch.zeros(64)}
    with cp.CheckpointPipeline(root, keep_last=2) as pipe:
        if mode == "raising-handler":
            pipe.subscribe(lambda event: 1 / 0)
        for step in range(1, 6):
            state["w"].fill_(float(step))
            pipe.save(step, state).result(30)
        state["w"].zero_()
        restored = pipe.restore_latest(state)
    assert restored is not None and float(state["w"][0]) == 5.0
    result.write_text(f"ok {restored.step}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
