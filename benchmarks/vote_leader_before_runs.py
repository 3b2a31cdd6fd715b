"""The per-node leader's work on one commit vote as it was before the answers were kept as runs
(``a8d0de8``'s ``HierarchicalCoordinator._across_nodes`` after ``log_gather``: unpack each
node's frame, put each rank's payload in its place, pack the whole list), timed against a
checkout of that commit, for ``docs/scale.md``'s table beside ``bench_vote_decode.py``. The
votes are that benchmark's (every rank alike, one in 100 failed, every rank different), nodes
of 8, the least of 7::

    git worktree add --detach /tmp/before a8d0de8
    python benchmarks/vote_leader_before_runs.py /tmp/before
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    sys.path.insert(0, sys.argv[1])  # the checkout before runs
    from ckpt_pipeline._format.documents import encode_message
    from ckpt_pipeline._tiers.replica.vote import CopiesAcked
    from ckpt_pipeline.coordination._hierarchy import pack_relay, unpack_relay

    def message(rank: int, kind: str) -> bytes:
        error = "disk full on /local/ckpt" if kind == "1pct" and rank % 100 == 7 else None
        part = CopiesAcked((rank,) if kind == "distinct" else (1,)).to_msg()
        return encode_message({"step": 42, "save_id": "0123456789abcdef", "error": error,
                               "fatal": False, "parts": {"replicas": part}})

    for ranks in (1000, 4000, 16000):
        for kind in ("alike", "1pct", "distinct"):
            payloads = [message(r, kind) for r in range(ranks)]
            nodes = [tuple(range(a, a + 8)) for a in range(0, ranks, 8)]
            frames = [pack_relay(payloads[n[0]:n[-1] + 1]) for n in nodes]

            def leader(ranks: int = ranks, nodes: list[tuple[int, ...]] = nodes,
                       frames: list[bytes] = frames) -> bytes:
                result = [b""] * ranks
                for node, frame in zip(nodes, frames, strict=True):
                    items, _failed = unpack_relay(frame)
                    assert items is not None
                    for rank, item in zip(node, items, strict=True):
                        result[rank] = item
                return pack_relay(result)

            best = float("inf")
            for _ in range(7):
                started = time.perf_counter()
                leader()
                best = min(best, time.perf_counter() - started)
            print(f"{ranks:>6} {kind:>9} leader {best * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
