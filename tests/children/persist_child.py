"""A training process promoting to a persistent tier, for the SIGKILL test of
``tests/persist/test_persist.py``.

Usage: ``python tests/children/persist_child.py ROOT URL`` with the fsspec options as JSON in
``CKPT_TEST_PERSIST_OPTIONS``. Saves step 10 (a few MB, so that the upload takes several
requests), prints ``committed 10`` once it is committed, then keeps the process alive (its
upload goes on in the background) until the test kills it.

``CKPT_TEST_PERSIST_LEASE`` sets ``persistent_lease_s`` (so that the next job takes the URL
over soon after the kill). With ``CKPT_TEST_HOLD_UPLOAD`` set, the upload of the shard stops
for good after two of its 4 MiB chunks are in the tier's temporary (a disk that stalls) and
``uploading`` is printed: the kill then comes in the middle of an upload.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time

import torch

import ckpt_pipeline as cp


def main() -> None:
    root, url = sys.argv[1], sys.argv[2]
    options = json.loads(os.environ.get("CKPT_TEST_PERSIST_OPTIONS", "null"))
    lease = float(os.environ.get("CKPT_TEST_PERSIST_LEASE", "60"))
    if os.environ.get("CKPT_TEST_HOLD_UPLOAD"):
        _hold_upload()
    pipe = cp.CheckpointPipeline(root, persistent=cp.PersistentConfig(url, options=options,
                                                                      lease_s=lease),
                                 direct_io=False, sigterm="off")
    pipe.open()
    state = {"w": torch.randn(3_000_000)}  # 12 MB: three parts of 5 MiB
    pipe.save(10, state, cp.TrainState(step=10)).result(60)
    print("committed 10", flush=True)
    time.sleep(120)


def _hold_upload() -> None:
    """The upload's gate (called before each part and between its 4 MiB chunks) stops for
    good at its third call: two chunks of the shard are in the temporary."""
    from ckpt_pipeline._tiers.persistent.promote import Promoter

    calls = itertools.count(1)
    gate = Promoter._wait_for_quiet

    def held(self: Promoter) -> None:
        if next(calls) == 3:
            print("uploading", flush=True)
            threading.Event().wait()
        gate(self)

    Promoter._wait_for_quiet = held  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
