"""A training process with one kind of logging set-up, for ``tests/test_logging.py``.

Usage: ``python tests/children/logging_child.py MODE ROOT RESULT``. It saves steps 1..5 (waiting for
each commit) and restores once, then writes ``ok <latest step>`` to RESULT. Modes:

- ``silent``: no logging configured at all (the library must print nothing);
- ``stdout-basic``: ``logging.basicConfig(stream=sys.stdout, level=DEBUG)`` (the test gives
  it a stdout whose reader is gone: ``python train.py | head``);
- ``stdout-enabled``: ``ckpt_pipeline.enable_logging("DEBUG", stream=sys.stdout)``, same;
- ``full-disk``: both a basicConfig file handler and ``enable_logging`` on ``/dev/full``
  (every write fails with ENOSPC);
- ``raising-handler``: a handler whose ``emit`` raises, and a subscriber that raises.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

import ckpt_pipeline as cp


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
    elif mode != "silent":
        raise SystemExit(f"unknown mode {mode}")


def main() -> int:
    mode, root, result = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    _configure(mode)
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
