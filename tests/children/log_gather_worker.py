"""One rank of tests/coordination/test_log_gather.py: ``log_gather`` (the leaders' stage of
the per-node control plane) over gloo groups of the first k ranks, k = 1..world, each member
with payloads of its own (empty ones among them, and sizes whose message ends just before,
at and after a first frame's 1,020 bytes: ``_hierarchy._FRAME_BYTES``); ``--absent R``: rank R never takes part,
and the others report how they ended. Writes ``--out``/rank-R.json."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch.distributed as dist

from ckpt_pipeline.coordination._hierarchy import log_gather
from tests._support.children import exit_without_teardown


def payload(rank: int, members: int, trial: int) -> bytes:
    rnd = random.Random(f"{rank}/{members}/{trial}")
    return bytes(rnd.randrange(256) for _ in range(rnd.choice([0, 1, 7, 300, 1011, 1012, 1013, 5000])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--absent", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict[str, object] = {}
    if args.absent < 0:
        wrong = []
        for k in range(1, world + 1):
            group = dist.new_group(list(range(k)), backend="gloo")
            for trial in range(3):
                if rank < k:
                    got = log_gather(dist, group, list(range(k)), payload(rank, k, trial),
                                     args.timeout)
                    if got != [payload(r, k, trial) for r in range(k)]:
                        wrong.append([k, trial])
        report["wrong"] = wrong
    elif rank == args.absent:
        time.sleep(args.timeout + 3)
    else:
        started = time.monotonic()
        try:
            log_gather(dist, dist.group.WORLD, list(range(world)), b"x", args.timeout)
            report["error"] = None
        except Exception as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
        report["after_s"] = time.monotonic() - started
    (args.out / f"rank-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    exit_without_teardown()
