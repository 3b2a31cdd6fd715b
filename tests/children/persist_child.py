"""A training process promoting to a persistent tier, for the SIGKILL test of
``tests/persist/test_persist.py``.

Usage: ``python tests/children/persist_child.py ROOT URL`` with the fsspec options as JSON in
``CKPT_TEST_PERSIST_OPTIONS``. Saves step 10 (a few MB, so that the upload takes several
requests), prints ``committed 10`` once it is committed, then keeps the process alive (its
upload goes on in the background) until the test kills it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import ckpt_pipeline as cp


def main() -> None:
    root, url = sys.argv[1], sys.argv[2]
    options = json.loads(os.environ["CKPT_TEST_PERSIST_OPTIONS"])
    pipe = cp.CheckpointPipeline(root, persistent=url, persistent_options=options,
                                 direct_io=False, sigterm="off")
    pipe.open()
    state = {"w": torch.randn(3_000_000)}  # 12 MB: three parts of 5 MiB
    pipe.save(10, state, cp.TrainState(step=10)).result(60)
    print("committed 10", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
