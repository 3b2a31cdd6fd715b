"""Child of the crash-point tests: save step 1, then crash at a labelled point during step 2.

Usage: crash_point_child.py ROOT LABEL. Writes ROOT.ack with each step whose result() returned.
For ``scrub.removed`` it only opens the pipeline (the test planted a leftover first).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import CRASH_ENV


def state_for(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 1024), float(step)), "b": torch.arange(100) * step}


def main() -> None:
    root, label = sys.argv[1], sys.argv[2]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    if label == "scrub.removed":
        os.environ[CRASH_ENV] = label
        with cp.CheckpointPipeline(root):
            pass
        return
    with cp.CheckpointPipeline(root, keep_last=1) as pipe, open(root + ".ack", "a") as ack:
        for step in (1, 2, 3):
            if step == 2:
                os.environ[CRASH_ENV] = label
            pipe.save(step, state_for(step), cp.TrainState(step=step)).result(60)
            ack.write(f"{step}\n")
            ack.flush()
            os.fsync(ack.fileno())


if __name__ == "__main__":
    main()
