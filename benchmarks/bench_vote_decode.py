"""What reading one commit vote costs, by the number of ranks: the per-node control plane's
leader (``merge_nodes`` of its nodes' frames, ``--ranks-per-node`` ranks a node, then
``pack_relay`` of the result), a rank's ``unpack_relay`` and its tally (``gather_vote``:
decoding the answers and their parts), in one process, no gloo.

Three votes at each size: every rank alike (the good path: replication's part is "every
holder acknowledged"), one rank in 100 with an error, and every rank different (each answer
carries its own rank number, which is what every vote cost before each distinct answer was
decoded once). The timings are the least of ``--repeats`` runs, on this machine, the machine
recorded beside them.

Then the commit votes in which the ranks' persistent-tier uploads finish (``persist`` in the
JSON): every rank reporting step 30's upload done, and every other rank doing so (alternate
ranks: the most runs such a vote can have). Each report names its three objects' checksums
and stamps. Until ``e8b68fc`` those rode in every rank's report, so every answer differed;
since, every rank reads which steps finished and rank 0 alone gets the checksums: it splits
them off on its event loop (in the rank 0 column) and reads them in its commit-object thread
(timed apart, "sums thr").

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
from ckpt_pipeline._tiers.persistent.objects import ObjectSum
from ckpt_pipeline._tiers.persistent.reports import PersistReport, UploadReport
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
    """Rank ``rank``'s coordinator, handed the relay's bytes as a leader broadcast them (and,
    rank 0, the pieces for it that the leaders passed on)."""

    def __init__(self, relayed: bytes, world: int, rank: int = 0,
                 pieces: dict[int, bytes] | None = None) -> None:
        self.rank, self.world_size, self.relayed = rank, world, relayed
        self.pieces = pieces or {}

    async def all_gather(self, payload: bytes, *, what: str, step: int | None = None
                         ) -> Runs[bytes]:
        items, failure = unpack_relay(self.relayed)
        assert items is not None and failure is None
        return items

    async def all_gather_root(self, payload: bytes, for_root: bytes, *, what: str,
                              step: int | None = None) -> tuple[Runs[bytes], dict[int, bytes]]:
        return await self.all_gather(payload, what=what), self.pieces


_ROOTED = "uploads" in PersistReport.__dataclass_fields__
"""Whether the tree measured sends the checksums to rank 0 alone (since ``e8b68fc``, as
pieces of bytes since ``0d4a0ed``)."""
if _ROOTED:
    from ckpt_pipeline.coordination._agree import _pack_pieces, encode_piece, read_piece


def _upload(rank: int) -> UploadReport:
    names = [f"rank_{rank:05d}.{kind}" for kind in ("shard", "manifest", "commit")]
    return UploadReport({n: ObjectSum(64 << 20, 8 << 20, tuple(range(rank, rank + 8)))
                         for n in names}, {n: f"{rank:08x}-etag" for n in names})


def measure_persist(ranks: int, kind: str, repeats: int, per_node: int) -> dict[str, Any]:
    """Rank 1's and rank 0's reading of a commit vote in which ranks report finished
    uploads (module docstring)."""
    def report(rank: int) -> Any:
        if kind == "persist_half" and rank % 2:
            return PersistReport(1, reachable=True)
        if _ROOTED:
            return PersistReport(0, (30,), reachable=True, uploads={30: _upload(rank)})
        return PersistReport(0, {30: _upload(rank)}, reachable=True)  # type: ignore[arg-type]

    reports = [report(rank) for rank in range(ranks)]
    payloads = [encode_message({"step": STEP, "save_id": SAVE, "error": None, "fatal": False,
                                "parts": {"persist": r.to_msg()}}) for r in reports]
    pieces = ({rank: _pack_pieces({"persist": encode_piece(r.root_msg())})
               for rank, r in enumerate(reports) if r.root_msg() is not None}
              if _ROOTED else {})
    relayed = _relayed(payloads, per_node)
    ballot = Ballot(reports[0], PersistReport.from_msg, True, *((True,) if _ROOTED else ()))

    def timed(rank: int, sums: bool = False) -> float:
        mine = pieces if rank == 0 else {}

        async def run() -> float:
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                tally = await gather_vote(_Relayed(relayed, ranks, rank, mine), STEP, SAVE,
                                          None, what="commit", ballots={"persist": ballot})
                if sums:  # what rank 0's commit-object thread then reads (_read_uploads)
                    started = time.perf_counter()
                    for piece in tally.roots["persist"].values():
                        PersistReport.uploads_from_msg(read_piece(piece, "uploads"))
                best = min(best, time.perf_counter() - started)
            return best
        return anyio.run(run)

    return {"ranks": ranks, "exchange": kind, "ranks_per_node": per_node,
            "checksums_to_rank_0_alone": _ROOTED, "relay_bytes": len(relayed),
            "pieces_bytes": sum(map(len, pieces.values())),
            "rank_1_unpack_and_tally_s": timed(1), "rank_0_unpack_and_tally_s": timed(0),
            "rank_0_sums_thread_s": timed(0, sums=True) if _ROOTED else None}


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
    persist = [measure_persist(int(n), kind, args.repeats, args.ranks_per_node)
               for n in args.ranks.split(",") for kind in ("persist_all", "persist_half")]
    exchanges = [measure_exchange(int(n), kind, args.repeats, args.ranks_per_node)
                 for n in args.ranks.split(",")
                 for kind in ("candidates", "candidates_copies", "open",
                              "open_ids_per_rank")]
    import ckpt_pipeline

    report = {"benchmark": "vote_decode", "machine": machine_info(HERE),
              "ckpt_pipeline_from": str(Path(ckpt_pipeline.__file__).parent),
              "repeats": args.repeats, "rows": rows, "persist": persist,
              "exchanges": exchanges}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'ranks':>6} {'votes':>9} {'fail':>5} {'relay B':>9} {'pack ms':>8} "
          f"{'unpack ms':>10} {'unpack+tally ms':>16}")
    for r in rows:
        print(f"{r['ranks']:>6} {r['votes']:>9} {r['failures']:>5} {r['relay_bytes']:>9} "
              f"{r['leader_pack_s'] * 1e3:>8.2f} {r['rank_unpack_s'] * 1e3:>10.2f} "
              f"{r['rank_unpack_and_tally_s'] * 1e3:>16.2f}")
    print(f"{'ranks':>6} {'persist vote':>18} {'relay B':>9} {'rank 1 ms':>10} {'rank 0 ms':>10} "
          f"{'sums thr ms':>12}")
    for r in persist:
        sums = r["rank_0_sums_thread_s"]
        print(f"{r['ranks']:>6} {r['exchange']:>18} {r['relay_bytes']:>9} "
              f"{r['rank_1_unpack_and_tally_s'] * 1e3:>10.2f} "
              f"{r['rank_0_unpack_and_tally_s'] * 1e3:>10.2f} "
              f"{'-' if sums is None else f'{sums * 1e3:.2f}':>12}")
    print(f"{'ranks':>6} {'exchange':>18} {'relay B':>9} {'unpack+read ms':>15}")
    for r in exchanges:
        print(f"{r['ranks']:>6} {r['exchange']:>18} {r['relay_bytes']:>9} "
              f"{r['rank_unpack_and_read_s'] * 1e3:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
