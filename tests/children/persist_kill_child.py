"""A training process killed while it uploads to a directory tier, for the leftovers test
of ``tests/persist/test_availability.py``.

Usage: ``python tests/children/persist_kill_child.py ROOT TIER``. Saves step 10 and prints
``committed 10``; its upload then stops for good after writing the shard's first part into
its temporary (a fault injected into ``tier_dir._flush_range``, so that the test's SIGKILL
lands mid-upload without timing), printing ``uploading``.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

import ckpt_pipeline as cp
from ckpt_pipeline._persist import tier_dir


def main() -> None:
    root, tier = sys.argv[1], sys.argv[2]
    flush = tier_dir._flush_range

    def hold(fd: int) -> None:
        flush(fd)
        print("uploading", flush=True)
        threading.Event().wait()

    tier_dir._flush_range = hold  # type: ignore[assignment]
    pipe = cp.CheckpointPipeline(root, persistent=tier, direct_io=False, sigterm="off")
    pipe.open()
    state: dict[str, Any] = {"w": torch.randn(1_000_000)}  # 4 MB: a whole part
    pipe.save(10, state, cp.TrainState(step=10)).result(60)
    print("committed 10", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
