"""What reading one commit vote costs, by the number of ranks: the per-node control plane's
leader (``merge_nodes`` of its nodes' frames, ``--ranks-per-node`` ranks a node, then
``pack_relay`` of the result), a rank's ``unpack_relay`` and its tally (``gather_vote``:
decoding the answers and their parts), in one process, no gloo.

Three votes at each size: every rank alike (the good path: replication's part is "every
holder acknowledged"), one rank in 100 with an error, and every rank different (each answer
carries its own rank number, which is what every vote cost before each distinct answer was
decoded once). The timings are the least of ``--repeats`` runs, on this machine, the machine
recorded beside them.

Then the two exchanges a job makes once (``exchanges`` in the JSON), read the same way from a
leader's relay: the restore's candidates (``agree_candidates``: every rank holding the same
three steps; and every rank also holding a copy of a shard of the node before its own, as the
placement puts them: sent as source ranks, every answer was distinct; sent as offsets from the
sender, from ``candidates_message`` where the tree has it, they are alike) and the opening (``agree_open``: rank 0's run id, every rank's node name, no
copy servers; and ``open_ids_per_rank``, every rank sending a run id and token of its own, as
every rank did before ``fbbed5c``). Run against another tree (``PYTHONPATH=that/tree``) for a
before and after.

    python benchmarks/bench_vote_decode.py                    # 1,000, 4,000 and 16,000 ranks
    python benchmarks/bench_vote_decode.py --ranks 1000 --repeats 3 --out /tmp/v.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from _machine import machine_info

from ckpt_pipeline._format.documents import encode_message
from ckpt_pipeline._tiers.replica.vote import CopiesAcked
from ckpt_pipeline.coordination._agree import (
    Ballot,
    agree_candidates,
    agree_open,
    gather_vote,
)
from ckpt_pipeline.coordination._hierarchy import (
    NodeLayout,
    merge_nodes,
    pack_relay,
    unpack_relay,
)
from ckpt_pipeline.coordination._runs import Runs

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "vote_decode_cpu_2core.json"
STEP, SAVE = 42, "0123456789abcdef"


def _message(rank: int, kind: str) -> bytes:
    error = "disk full on /local/ckpt" if kind == "1pct" and rank % 100 == 7 else None
    part = CopiesAcked((rank,) if kind == "distinct" else None).to_msg()
    return encode_message({"step": STEP, "save_id": SAVE, "error": error, "fatal": False,
                           "parts": {"replicas": part}})


class _Relayed:
    """Rank 0's coordinator, handed the relay's bytes as a leader broadcast them."""

    def __init__(self, relayed: bytes, world: int) -> None:
        self.rank, self.world_size, self.relayed = 0, world, relayed

    async def all_gather(self, payload: bytes, *, what: str, step: int | None = None
                         ) -> Runs[bytes]:
        items, failure = unpack_relay(self.relayed)
        assert items is not None and failure is None
        return items


def _least(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure(ranks: int, kind: str, repeats: int, per_node: int) -> dict[str, Any]:
    payloads = [_message(rank, kind) for rank in range(ranks)]
    layout = NodeLayout(tuple(tuple(range(at, min(at + per_node, ranks)))
                              for at in range(0, ranks, per_node)))
    frames = [pack_relay(payloads[node[0]:node[-1] + 1]) for node in layout.nodes]
    relayed = pack_relay(merge_nodes(layout, frames))
    ballot = Ballot(CopiesAcked(None), CopiesAcked.from_msg)

    async def vote() -> Any:
        return await gather_vote(_Relayed(relayed, ranks), STEP, SAVE, None, what="commit",
                                 ballots={"replicas": ballot})

    async def votes() -> tuple[int, float]:  # one event loop, as in the pipeline
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            tally = await vote()
            best = min(best, time.perf_counter() - started)
        return len(tally.failures), best

    failures, tally_s = anyio.run(votes)
    return {"ranks": ranks, "votes": kind, "failures": failures, "ranks_per_node": per_node,
            "relay_bytes": len(relayed), "payload_bytes_each": len(payloads[0]),
            "leader_pack_s": _least(lambda: pack_relay(merge_nodes(layout, frames)), repeats),
            "rank_unpack_s": _least(lambda: unpack_relay(relayed), repeats),
            "rank_unpack_and_tally_s": tally_s}


def _relayed(payloads: list[bytes], per_node: int) -> bytes:
    layout = NodeLayout(tuple(tuple(range(at, min(at + per_node, len(payloads))))
                              for at in range(0, len(payloads), per_node)))
    frames = [pack_relay(payloads[node[0]:node[-1] + 1]) for node in layout.nodes]
    return pack_relay(merge_nodes(layout, frames))


def _candidates(rank: int, ranks: int, per_node: int, steps: list[list[Any]], kind: str
                ) -> dict[str, Any]:
    """Rank ``rank``'s candidates message, in the format of the tree measured."""
    copies = ([(30, (rank - per_node) % ranks, "run-30", ranks)]
              if kind == "candidates_copies" else [])
    try:
        from ckpt_pipeline.coordination._agree import candidates_message
    except ImportError:  # a tree before it: copies were sent by source rank
        return {"valid": steps, "persisted": [], "held_any": True,
                "copies": [list(c) for c in copies]}
    message: dict[str, Any] = candidates_message(
        rank, ranks, {s: (sid, ws) for s, sid, ws in steps}, held_any=True, copies=copies)
    return message


def measure_exchange(ranks: int, kind: str, repeats: int, per_node: int) -> dict[str, Any]:
    """One of the once-a-job exchanges (module docstring), read by rank 0 from the relay."""
    steps = [[10, "run-10", ranks], [20, "run-20", ranks], [30, "run-30", ranks]]
    if kind.startswith("open"):
        own = kind == "open_ids_per_rank"
        payloads = [encode_message({"run_id": f"{r:016x}" if own or r == 0 else None,
                                    "token": f"{r:032x}" if own or r == 0 else None,
                                    "node": f"node-{r // per_node}", "address": None})
                    for r in range(ranks)]
    else:
        payloads = [encode_message(_candidates(r, ranks, per_node, steps, kind))
                    for r in range(ranks)]
    relayed = _relayed(payloads, per_node)

    async def once() -> Any:
        coordinator = _Relayed(relayed, ranks)
        if kind.startswith("open"):
            return await agree_open(coordinator, "node-0", None)
        return await agree_candidates(coordinator, {}, held_any=True)

    async def timed() -> float:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            await once()
            best = min(best, time.perf_counter() - started)
        return best

    return {"ranks": ranks, "exchange": kind, "ranks_per_node": per_node,
            "relay_bytes": len(relayed), "rank_unpack_and_read_s": anyio.run(timed)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1000,4000,16000")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rows = [measure(int(n), kind, args.repeats, args.ranks_per_node)
            for n in args.ranks.split(",")
            for kind in ("alike", "1pct", "distinct")]
    exchanges = [measure_exchange(int(n), kind, args.repeats, args.ranks_per_node)
                 for n in args.ranks.split(",")
                 for kind in ("candidates", "candidates_copies", "open",
                              "open_ids_per_rank")]
    import ckpt_pipeline

    report = {"benchmark": "vote_decode", "machine": machine_info(HERE),
              "ckpt_pipeline_from": str(Path(ckpt_pipeline.__file__).parent),
              "repeats": args.repeats, "rows": rows, "exchanges": exchanges}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'ranks':>6} {'votes':>9} {'fail':>5} {'relay B':>9} {'pack ms':>8} "
          f"{'unpack ms':>10} {'unpack+tally ms':>16}")
    for r in rows:
        print(f"{r['ranks']:>6} {r['votes']:>9} {r['failures']:>5} {r['relay_bytes']:>9} "
              f"{r['leader_pack_s'] * 1e3:>8.2f} {r['rank_unpack_s'] * 1e3:>10.2f} "
              f"{r['rank_unpack_and_tally_s'] * 1e3:>16.2f}")
    print(f"{'ranks':>6} {'exchange':>18} {'relay B':>9} {'unpack+read ms':>15}")
    for r in exchanges:
        print(f"{r['ranks']:>6} {r['exchange']:>18} {r['relay_bytes']:>9} "
              f"{r['rank_unpack_and_read_s'] * 1e3:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
