"""A training process whose persistent tier hangs during an upload, for the "process never
exits" test of ``tests/persist/test_availability.py``.

Usage: ``python tests/children/persist_hang_child.py ROOT URL`` with the S3 options as JSON
in ``CKPT_TEST_PERSIST_OPTIONS``. Opens (the store answers its listing), saves step 10 (whose
upload the test's proxy holds unanswered), prints ``committed 10``, closes with
``PersistentConfig(timeout_s=1)``, prints ``closed`` and each PersistFailed step as ``failed STEP``,
then returns from ``main``: the process must exit although the upload's request never ends.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import ckpt_pipeline as cp


def main() -> None:
    root, url = sys.argv[1], sys.argv[2]
    options = json.loads(os.environ["CKPT_TEST_PERSIST_OPTIONS"])
    events: list[cp.Event] = []
    pipe = cp.CheckpointPipeline(root, persistent=cp.PersistentConfig(url, options=options,
                                                                      timeout_s=1.0,
                                                                      on_close=False),
                                 direct_io=False, sigterm="off")
    pipe.subscribe(events.append)
    pipe.open()
    pipe.save(10, {"w": torch.randn(1000)}, cp.TrainState(step=10)).result(60)
    print("committed 10", flush=True)
    pipe.close()
    print("closed", flush=True)
    for event in events:
        if isinstance(event, cp.PersistFailed):
            print(f"failed {event.step}", flush=True)


if __name__ == "__main__":
    main()
