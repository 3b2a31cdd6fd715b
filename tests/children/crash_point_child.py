"""Child of the crash-point tests: save steps until a labelled crash point kills it.

Usage::

    CKPT_PIPELINE_CRASH_AT=LABEL:N python crash_point_child.py ROOT FIRST LAST
    CKPT_PIPELINE_CRASH_AT=scrub.removed:N python crash_point_child.py ROOT --open-only

The first form opens ``CheckpointPipeline(ROOT, keep_last=1)`` (the test saved step
``FIRST - 1`` there already, so every save has an older step to prune) and saves steps
``FIRST..LAST``, waiting for each commit; once ``result()`` returned it appends the step to
``ROOT.ack`` and fsyncs it: the ack file is what the test knows to be acknowledged. It then
waits for the save's retention (``pipe.wait``), which otherwise runs on after ``result()``
and, on a loaded machine, can reach its crash point after the next save was acknowledged.
The crash point is armed from the start of the process, so ``LABEL:N`` dies during the N-th save (every
label but ``scrub.removed`` is reached once per save). ``--open-only`` only opens the pipeline:
its start-up scrub removes the leftovers the test planted, and ``scrub.removed:N`` dies after
the N-th removal.

The test imports this module for ``state_for``, ``train_state_for`` and ``KEEP_LAST``.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

import ckpt_pipeline as cp

KEEP_LAST = 1
SAMPLES_PER_STEP = 32


def state_for(step: int) -> dict[str, torch.Tensor]:
    """Every value a function of the step: a restore of a mix of two steps cannot pass."""
    return {"w": torch.full((64, 1024), float(step)), "b": torch.arange(100) * step}


def train_state_for(step: int) -> cp.TrainState:
    return cp.TrainState(step=step, consumed_train_samples=step * SAMPLES_PER_STEP,
                         extra={"tag": f"step-{step}"})


def main(argv: list[str]) -> int:
    cp.enable_logging(logging.ERROR)
    torch.set_num_threads(1)
    root = argv[0]
    if argv[1:] == ["--open-only"]:
        with cp.CheckpointPipeline(root):
            pass
        return 0
    first, last = int(argv[1]), int(argv[2])
    with cp.CheckpointPipeline(root, keep_last=KEEP_LAST) as pipe, \
            open(root + ".ack", "a") as ack:
        for step in range(first, last + 1):
            pipe.save(step, state_for(step), train_state_for(step)).result(60)
            ack.write(f"{step}\n")
            ack.flush()
            os.fsync(ack.fileno())
            pipe.wait(60)  # its retention too, so that the N-th save's crash is in that save
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's teardown; reaching here means no crash point fired
