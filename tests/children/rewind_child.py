"""A process that rewinds a run with a persistent tier, for the crash test of
``tests/persist/test_rewind.py``.

Usage: ``python tests/children/rewind_child.py ROOT TIER STEP``: opens a pipeline on ROOT with
the directory TIER as its persistent tier and calls ``restore(state, step=STEP)``; the test arms
``CKPT_PIPELINE_CRASH_AT`` so that the process is killed inside it. Prints ``restored STEP``
if it ever returns.
"""

from __future__ import annotations

import sys

import torch

import ckpt_pipeline as cp


def main() -> None:
    root, tier, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    state = {"w": torch.zeros(1000), "meta": {"v": 0.0}}
    with cp.CheckpointPipeline(root, persistent=cp.PersistentConfig(tier, every=1, keep=None),
                               keep_last=10, direct_io=False, sigterm="off") as pipe:
        result = pipe.restore(state, step=step)
        print(f"restored {None if result is None else result.step}", flush=True)


if __name__ == "__main__":
    main()
