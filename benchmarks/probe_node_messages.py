"""What one message of the per-node control plane's node stage costs: a vote-sized payload
(100 bytes) sent by a rank to its leader and answered, over gloo point to point (the node
stage before ``68f6bd3``: ``_hierarchy._send`` and ``_receive_all``, one 1,024-byte frame a
message, on a gloo group of the two) against the local sockets it uses now
(``_node_links.NodeLinks``), in the same two processes, in turns.

Two processes of one host (forked here, a gloo process group on a free port); each round
times ``--messages`` round trips each way, the rank sending and the leader answering;
``--rounds`` rounds, the two channels alternating. Prints the median round trip of each and
writes JSON to ``--out``::

    python benchmarks/probe_node_messages.py --messages 2000 --rounds 5 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PAYLOAD = bytes(range(100))


def _rank(rank: int, port: int, messages: int, rounds: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    import torch.distributed as dist

    from ckpt_pipeline.coordination._control_plane import default_store
    from ckpt_pipeline.coordination._hierarchy import _receive_all, _send, _wait
    from ckpt_pipeline.coordination._node_links import NodeLinks

    dist.init_process_group("gloo")
    group = dist.new_group(ranks=[0, 1], backend="gloo")
    links = NodeLinks(store=default_store(dist), key="probe/node/0", rank=rank, node=(0, 1),
                      deadline=time.monotonic() + 60)
    peer = 1 - rank

    def gloo_trip() -> None:
        deadline = time.monotonic() + 30
        if rank == 1:
            for work in _send(dist, group, PAYLOAD, peer, 0):
                _wait(work, deadline)
            _receive_all(dist, group, (peer,), 2, deadline)
        else:
            (got,) = _receive_all(dist, group, (peer,), 0, deadline)
            for work in _send(dist, group, got, peer, 2):
                _wait(work, deadline)

    def socket_trip() -> None:
        deadline = time.monotonic() + 30
        if rank == 1:
            links.send(peer, PAYLOAD, deadline)
            links.receive_all((peer,), deadline)
        else:
            (got,) = links.receive_all((peer,), deadline)
            links.send(peer, got, deadline)

    times: dict[str, list[float]] = {"gloo": [], "socket": []}
    for _ in range(rounds):
        for name, trip in (("gloo", gloo_trip), ("socket", socket_trip)):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(messages):
                trip()
            times[name].append((time.perf_counter() - started) / messages)
    links.close()
    dist.destroy_process_group()
    if rank == 1:
        out.put(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.messages, args.rounds, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    times = out.get(timeout=600)
    for p in procs:
        p.join(60)
    from _machine import machine_info

    medians = {name: statistics.median(v) for name, v in times.items()}
    result = {"benchmark": "probe_node_messages", "machine": machine_info(Path(".")),
              "payload_bytes": len(PAYLOAD), "messages": args.messages, "rounds": args.rounds,
              "round_trip_s": times, "median_round_trip_s": medians}
    args.out.write_text(json.dumps(result, indent=1))
    for name, v in times.items():
        print(f"{name:6s}: round trip median {medians[name] * 1e6:7.1f} us "
              f"({', '.join(f'{x * 1e6:.1f}' for x in v)})")
    print(f"socket / gloo: {medians['socket'] / medians['gloo']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
