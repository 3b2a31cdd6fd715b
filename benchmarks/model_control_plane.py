"""A discrete-event model of the control plane: today's flat protocol against the hierarchical
one that issue 28 asks for, from 8 to 16,000 ranks, calibrated on ``results/scale.json``.

    python benchmarks/model_control_plane.py                   # table; JSON to results/
    python benchmarks/model_control_plane.py --json            # JSON on stdout
    python benchmarks/model_control_plane.py --ranks-per-node 4,8,16 --out /tmp/model.json

**flat** is what ``coordination/_control_plane.py`` does today. Every exchange (one
``DistributedCoordinator._gather``) is, on every rank: one ``TCPStore.set`` to rank 0's store
(fire-and-forget: the client sends and goes on; rank 0's store serves the writes one after
another), a gloo all-gather of the 8-byte message sizes, a gloo all-gather of the messages
padded to the longest, then the handling of N answers (a tensor per answer, msgpack decode,
the tally in ``coordination/_agree.py``). A save's commit makes 2 exchanges (``commit``,
``commit confirm``: 4 all-gathers), a restore of the newest step 5 (``restore timeline``,
``restore candidates``, ``restore load``, ``restore apply``, ``restore done``: 10 all-gathers).

gloo's all-gather (``gloo/allgather.cc``, used by ``ProcessGroupGloo`` for CPU tensors of any
size) is a ring: N-1 steps, each passing one rank's segment (the padded message, in two
halves) to the right neighbour, a step starting only when the previous one is done. With step
cost ``alpha + beta * segment``, every rank finishes at the last rank's entry plus (N-1) steps
(``ring_allgather_finish`` simulates it step by step; the event loop uses that closed form).

**hier-sockets** is what ``coordination/_hierarchy.py`` does now: hier-runs below, with the
node stage over local sockets (``coordination/_node_links.py``, ``68f6bd3``): a rank's message
to its leader is one hop of ``node_hop_s`` (its length and bytes in one send), the relay back
one hop of ``node_hop_s``, each with ``message_s`` a message at the leader, where hier-runs
prices them at the gloo step ``alpha_s`` (two hops in, one out). The leaders' stage is
hier-runs' (gloo, ``log_gather``).

**hier-runs** (as built at ``3ba9993``): hier-p2p below, with every
rank's answers kept as runs of equal answers (``coordination/_runs.py``), so that the leader's
work beyond the decodes is ``per_node_s`` a node (reading its nodes' frames, joining their
runs) and a rank's is the decodes alone. **hier-p2p** (as built at e2dc8ef's parent). Per exchange: each rank of a node
sends its message to the node's leader (its length, then its bytes; the leader receives all
at once: two hops and ``message_s`` per message); the leaders all-gather their nodes' relays
in ceil(log2 nodes) rounds (``log_gather``, Bruck: segments doubling; a round's length and
bytes travel together, one step); each leader decodes the distinct messages (one on the good
path, one more a failure) and does the per-rank work of packing and tallying (``per_rank_s`` a
rank of the job); it sends the relay to each rank of its node (one hop and ``message_s`` a
rank), and every rank unpacks and tallies the same way. A relay is one run and one vote when
the ranks vote alike (100 bytes), plus a message and two runs a rank that differs. No store
write. **hier-log** (as built at eb84046, measured on the H200) has instead the two ring
all-gathers of ``gather_bytes`` in each node and two gloo broadcasts back; **hier** (39cf544,
measured too) has gloo's ring between the leaders as well (nodes - 1 steps, two all-gathers).

Not modelled: stragglers and the wait for the slowest shard, network topology and congestion,
failures (the good path only, unless ``failures`` is set), the store's other traffic. The
assumptions, the calibration and the table: docs/scale.md, "A model to 16,000 ranks".
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import statistics
import sys
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ("Params", "build_report", "calibrate", "log_allgather_s", "main",
           "ring_allgather_finish", "ring_allgather_s", "simulate")

HERE = Path(__file__).resolve().parent
SCALE_JSON = HERE / "results" / "scale.json"
DEFAULT_OUT = HERE / "results" / "control_plane_model.json"
SIZES = (8, 16, 32, 64, 128, 1000, 4000, 16000)
FIT_RANKS = (8, 16, 32)
GOAL_S = 0.100
"""Issue 28: a commit under 100 ms at 16,000 ranks."""

SIZE_BYTES = 8
"""The first all-gather of an exchange: one int64 (the message's length) per rank."""
SAVE_EXCHANGES = (("commit", 75), ("commit confirm", 75))
RESTORE_EXCHANGES = (("restore timeline", 76), ("restore candidates", 83),
                     ("restore load", 94), ("restore apply", 56), ("restore done", 1))
"""(what, bytes of one rank's message): traced at 2388dbc with a recording coordinator
(replicas=0, keep_last=2); the same on every rank, so the padding adds nothing."""
SUMMARY_HEADER_BYTES = 100
"""A node's (and the job's) relay when every rank votes alike: one run and one commit vote
(``pack_distinct``; 100 bytes measured by bench_vote_decode.py)."""
FAILURE_BYTES = 48 + 16
"""Each rank that votes otherwise: its message (about 48 bytes of error) and two runs."""
MESSAGE_S = 10e-6
"""hier-p2p: what a leader spends on each message of its node's ranks it receives or sends,
beyond the hop (assumed, not measured: about a gloo receive's bookkeeping and one copy of a
100-byte message)."""
PER_RANK_S = 0.18e-6
"""hier-p2p's work per rank of the job that is not a decode: the leader's packing (one dict
lookup a rank), a rank's unpacking (a list of shared references) and the tally's loop over
the answers; bench_vote_decode.py at a8d0de8, 16,000 ranks voting alike, 2.85 ms in all."""
PER_NODE_S = 0.60e-6
"""hier-runs (the answers kept as runs, ``Runs``): the leader's work per node of the job,
reading the nodes' frames (equal ones once) and joining their runs, then packing the result;
bench_vote_decode.py at b7f9b82+, 16,000 ranks in 2,000 nodes voting alike, 1.20 ms. A rank's
unpacking and tally are O(runs): 0.02 ms at 16,000 ranks, one decode included."""

NODE_HOP_S = 36.2e-6 / 2
"""hier-sockets: one message over a node's Unix-domain socket; half the median round trip of
``probe_node_messages.py`` on the 2-core development VM (36.2 us, 100 bytes,
results/probe_node_messages_cpu_2core.json)."""

# Measured on the 2-core development VM (torch 2.13 CPU, Python 3.11, under a CI load; the
# least of 7 repeats), not on the 32-core host of scale.json: see PARAMETER_SOURCES.
DECODE_S = 11.8e-6
STORE_SEND_S = 3.3e-6
STORE_SERVE_S = 6.4e-6
BETA_S_PER_BYTE = 1e-9

PARAMETER_SOURCES = {
    "alpha_s": "fitted: least squares of the flat model on the vote figure of scale.json "
               "(replicas=0, 8/16/32 ranks), the fixed part held >= 0",
    "beta_s_per_byte": "assumed (1 GB/s through gloo's TCP pair): the messages are 1-94 bytes, "
                       "so no measurement here can see it",
    "decode_s": "measured: gather_vote over N copies of a commit vote (5.9 us an answer: "
                "msgpack decode and tally) plus _gather's per-answer tensors, item() and "
                "bytes() (5.9 us), 64 vs 1,024 answers, dev VM",
    "store_send_s": "measured: TCPStore.set in a loop (torch's set waits for no reply), dev VM",
    "store_serve_s": "measured: 8 client threads setting against one TCPStore server, "
                     "wall time per write, dev VM",
    "fixed_commit_s": "fitted with alpha_s (held >= 0)",
    "fixed_restore_s": "fitted: median over the restore figures (replicas 0 and 1, 8/16/32 "
                       "ranks) of measured minus the exchanges at the fitted alpha_s (>= 0)",
    "alpha_leader_s": "alpha_s: a step of the leaders' all-gather costs what a step cost on "
                      "the benchmark's host (no extra for the network)",
    "per_rank_s": "measured: bench_vote_decode.py, 16,000 ranks voting alike, unpack and tally "
                  "2.85 ms and the leader's pack 1.26 ms, per rank (dev VM, under load)",
    "message_s": "a leader's cost per message of its node's ranks (hier-p2p, hier-runs), "
                 "beyond the hop: 10 us assumed by default; --message-s sets it (33 us: the "
                 "H100 host's commit grew 0.20 ms a rank added to a node, six messages)",
    "per_node_s": "measured: bench_vote_decode.py, 16,000 ranks in nodes of 8 voting alike, "
                  "the leader's merge_nodes and pack_relay 1.20 ms, per node (dev VM)",
    "node_hop_s": "hier-sockets: one message over a node's local socket, the sending to the "
                  "receiver's wake-up: half the round trip of probe_node_messages.py (18.1 us "
                  "on the dev VM) unless --node-hop-s sets it",
}


@dataclass(frozen=True, slots=True)
class Params:
    """The model's costs, in seconds (see ``PARAMETER_SOURCES``)."""

    alpha_s: float
    fixed_commit_s: float = 0.0
    fixed_restore_s: float = 0.0
    beta_s_per_byte: float = BETA_S_PER_BYTE
    decode_s: float = DECODE_S
    store_send_s: float = STORE_SEND_S
    store_serve_s: float = STORE_SERVE_S
    alpha_leader_s: float | None = None
    failures: int = 0
    per_rank_s: float = PER_RANK_S
    message_s: float = MESSAGE_S
    per_node_s: float = PER_NODE_S
    node_hop_s: float = NODE_HOP_S

    @property
    def alpha_leader(self) -> float:
        return self.alpha_s if self.alpha_leader_s is None else self.alpha_leader_s


# --- the event loop ------------------------------------------------------------------------------

DELAY, JOIN, POST = range(3)
Command = tuple[Any, ...]
Process = Generator[Command, None, None]


class Loop:
    """A heap of times, each with the processes to go on with then, in the order they were
    scheduled. A process yields commands: (DELAY, s), (JOIN, collective), (POST, server, s)
    (queued at the server, not waited for)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.last_done = 0.0
        self._heap: list[float] = []
        self._due: dict[float, list[Process]] = {}

    def resume(self, at: float, processes: list[Process]) -> None:
        """Go on with ``processes`` at ``at``, after those scheduled for then already."""
        due = self._due.get(at)
        if due is None:
            self._due[at] = list(processes)
            heapq.heappush(self._heap, at)
        else:
            due.extend(processes)

    def run(self) -> float:
        """Run to the end; the time the last process finished."""
        while self._heap:
            self.now = heapq.heappop(self._heap)
            for process in self._due.pop(self.now):
                self._advance(process)
        return self.last_done

    def _advance(self, process: Process) -> None:
        for command in process:
            op = command[0]
            if op == DELAY:
                self.resume(self.now + command[1], [process])
                return
            if op == JOIN:
                command[1].arrive(self, process)
                return
            if op == POST:
                command[1].serve(self.now, command[2])
        self.last_done = max(self.last_done, self.now)


class Collective:
    """A group operation of ``size`` participants that ends ``seconds`` after the last one
    entered, on every participant (a ring all-gather: ``ring_allgather_finish``)."""

    def __init__(self, size: int, seconds: float) -> None:
        self.size, self.seconds = size, seconds
        self._waiting: list[Process] = []

    def arrive(self, loop: Loop, process: Process) -> None:
        self._waiting.append(process)
        if len(self._waiting) == self.size:
            loop.resume(loop.now + self.seconds, self._waiting)
            self._waiting = []


class Server:
    """One queue served in arrival order (rank 0's store)."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def serve(self, now: float, seconds: float) -> float:
        self.free_at = max(now, self.free_at) + seconds
        self.busy_s += seconds
        return self.free_at


# --- the collectives -----------------------------------------------------------------------------


def ring_allgather_s(participants: int, segment: int, alpha: float, beta: float) -> float:
    """gloo's ring all-gather once every participant entered: N-1 dependent steps."""
    return max(participants - 1, 0) * (alpha + beta * segment)


def log_allgather_s(participants: int, segment: int, alpha: float, beta: float) -> float:
    """A Bruck all-gather: ceil(log2 N) rounds, round r passing min(2^r, N - 2^r) segments."""
    total, have = 0.0, 1
    while have < participants:
        total += alpha + beta * segment * min(have, participants - have)
        have *= 2
    return total


def ring_allgather_finish(entries: Sequence[float], step_s: float) -> list[float]:
    """Each rank's finish in gloo's ring, step by step: rank i's step k ends one step after
    both its own step k-1 and its left neighbour's step k-1 (whose segment it forwards)."""
    n = len(entries)
    done = list(entries)
    for _ in range(n - 1):
        done = [max(done[i], done[i - 1]) + step_s for i in range(n)]
    return done


# --- the protocols -------------------------------------------------------------------------------

Exchanges = Sequence[tuple[str, int]]


def simulate_flat(ranks: int, exchanges: Exchanges, fixed_s: float, p: Params
                  ) -> dict[str, float]:
    """Today's protocol: the last rank's finish, and rank 0's store's busy time."""
    loop, store = Loop(), Server()
    gathers = [(Collective(ranks, ring_allgather_s(ranks, SIZE_BYTES, p.alpha_s,
                                                   p.beta_s_per_byte)),
                Collective(ranks, ring_allgather_s(ranks, size, p.alpha_s, p.beta_s_per_byte)))
               for _, size in exchanges]

    def rank() -> Process:
        yield (DELAY, fixed_s)
        for sizes, messages in gathers:
            yield (DELAY, p.store_send_s)
            yield (POST, store, p.store_serve_s)
            yield (JOIN, sizes)
            yield (JOIN, messages)
            yield (DELAY, ranks * p.decode_s)

    loop.resume(0.0, [rank() for _ in range(ranks)])
    return {"seconds": loop.run(), "store_busy_s": store.busy_s}


def simulate_hierarchical(ranks: int, per_node: int, exchanges: Exchanges, fixed_s: float,
                          p: Params, *, log_depth: bool = False, p2p_node: bool = False,
                          runs: bool = False, sockets: bool = False) -> dict[str, float]:
    """The per-node protocol (module docstring): in each node ring all-gathers, or with
    ``p2p_node`` every rank's message straight to the leader; the leaders' all-gather (Bruck's
    with ``log_depth``, else gloo's ring); the relay back (two broadcasts, or with
    ``p2p_node`` the leader's message to each rank). ``runs``: the answers kept as runs, so
    that the leader's work beyond the decodes is ``per_node_s`` a node and a rank's none.
    ``sockets``: every rank's message straight to the leader and back, each one hop of
    ``node_hop_s`` (length and bytes in one send)."""
    loop = Loop()
    nodes = -(-ranks // per_node)
    sizes = [min(per_node, ranks - n * per_node) for n in range(nodes)]
    frame = SUMMARY_HEADER_BYTES + FAILURE_BYTES * p.failures
    if log_depth:  # one round: the length and the bytes, sent together
        across = [log_allgather_s(nodes, frame, p.alpha_leader, p.beta_s_per_byte)]
    else:
        across = [ring_allgather_s(nodes, seg, p.alpha_leader, p.beta_s_per_byte)
                  for seg in (SIZE_BYTES, frame)]
    leaders = [[Collective(nodes, seconds) for seconds in across] for _ in exchanges]
    decodes = (1 + p.failures) * p.decode_s
    tally = decodes + ranks * p.per_rank_s
    lead_tally = decodes + nodes * p.per_node_s if runs else tally
    rank_tally = decodes if runs else tally

    def rank(node_stage: list[list[Collective]], relay: list[Collective], leads: bool
             ) -> Process:
        yield (DELAY, fixed_s)
        for e in range(len(exchanges)):
            for collective in node_stage[e]:
                yield (JOIN, collective)
            if leads:
                for collective in leaders[e]:
                    yield (JOIN, collective)
                yield (DELAY, lead_tally)  # decode the relays, pack the node's
            yield (JOIN, relay[e])
            if not leads:
                yield (DELAY, rank_tally)

    for size in sizes:
        steps = max(size - 1, 0)
        if sockets:  # one send a message (length and bytes), each way
            node_stage = [[Collective(size, p.node_hop_s + steps * p.message_s)]
                          for _ in exchanges]
            relay = [Collective(size, p.node_hop_s + steps * p.message_s) for _ in exchanges]
        elif p2p_node:  # lengths, then messages, all at once; then one message to each rank
            node_stage = [[Collective(size, 2 * p.alpha_s + 2 * steps * p.message_s)]
                          for _ in exchanges]
            relay = [Collective(size, p.alpha_s + steps * p.message_s) for _ in exchanges]
        else:
            node_stage = [[Collective(size, steps * (p.alpha_s + p.beta_s_per_byte * seg))
                           for seg in (SIZE_BYTES, message)] for _, message in exchanges]
            hops = 2 * (size - 1).bit_length() * p.alpha_s  # two broadcasts down a tree
            relay = [Collective(size, hops) for _ in exchanges]
        loop.resume(0.0, [rank(node_stage, relay, leads=i == 0) for i in range(size)])
    return {"seconds": loop.run(), "nodes": nodes}


PROTOCOLS = ("flat", "hier", "hier-log", "hier-p2p", "hier-runs", "hier-sockets")


def simulate(protocol: str, ranks: int, per_node: int, operation: str, p: Params
             ) -> dict[str, float]:
    """One commit (``operation="commit"``) or restore of ``protocol`` at ``ranks``."""
    exchanges = SAVE_EXCHANGES if operation == "commit" else RESTORE_EXCHANGES
    fixed = p.fixed_commit_s if operation == "commit" else p.fixed_restore_s
    if protocol == "flat":
        return simulate_flat(ranks, exchanges, fixed, p)
    return simulate_hierarchical(ranks, per_node, exchanges, fixed, p,
                                 log_depth=protocol != "hier",
                                 p2p_node=protocol in ("hier-p2p", "hier-runs"),
                                 runs=protocol in ("hier-runs", "hier-sockets"),
                                 sockets=protocol == "hier-sockets")


# --- calibration ---------------------------------------------------------------------------------

FIGURES: dict[str, tuple[str, Callable[[dict[str, Any]], float]]] = {
    "vote": ("commit", lambda c: c["cross_rank"]["commit_after_last_shard_s"]["median"]),
    "commit_max": ("commit", lambda c: c["aggregates"]["commit_stage_s"]["max_over_ranks"]),
    "restore": ("restore", lambda c: c["aggregates"]["restore_s"]["max_over_ranks"]),
}
"""figure: (the model's operation, where scale.json has it). ``vote``: the last rank's
commit after the last rank's shard sealed, the median over saves 2-6 (what the model's commit
is: it starts with every shard sealed); ``commit_max``: the commit stage, max over ranks (it
also waits for the slowest shard, which the model does not); ``restore``: max over ranks."""


def measured_points(scale: dict[str, Any], control: str = "flat") -> list[dict[str, Any]]:
    """Every (figure, replicas, ranks, seconds) of the scale JSON's finished configurations of
    one control plane (``flat``, or ``hier``; a JSON from before there was a choice is all
    flat)."""
    points = []
    for config in scale["configs"]:
        if config.get("status") != "ok" or (config.get("control") or "flat") != control:
            continue
        for figure, (_, read) in FIGURES.items():
            points.append({"figure": figure, "replicas": config["replicas"],
                           "ranks": config["ranks"], "measured_s": read(config)})
    return points


def check_hierarchical(scale: dict[str, Any], p: Params, protocol: str = "hier-p2p"
                       ) -> list[dict[str, Any]]:
    """The per-node model (``protocol``: the one the run measured, ``hier`` for a checkout
    before log_gather), at the fitted parameters, against every per-node configuration the
    scale JSON measured (nodes of its ``--ranks-per-node``): not fitted, a check."""
    per_node = int(scale.get("args", {}).get("ranks_per_node") or 8)
    points = measured_points(scale, "hier")
    for pt in points:
        operation = FIGURES[pt["figure"]][0]
        used = protocol if pt["ranks"] > per_node else "flat"  # one node: flat
        pt["ranks_per_node"], pt["protocol"] = per_node, used
        pt["model_s"] = simulate(used, pt["ranks"], per_node, operation, p)["seconds"]
        pt["residual_s"] = pt["measured_s"] - pt["model_s"]
    return points


def _least_squares(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points (x, y)."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    return slope, my - slope * mx


def _flat_s(ranks: int, operation: str, p: Params) -> float:
    return simulate("flat", ranks, 1, operation, p)["seconds"]


def calibrate(scale: dict[str, Any], fit_ranks: Sequence[int] = FIT_RANKS,
              check_protocol: str = "hier-p2p", message_s: float = MESSAGE_S,
              node_hop_s: float = NODE_HOP_S) -> tuple[Params, dict[str, Any]]:
    """Fit alpha_s and the fixed parts of the flat model to scale.json (module docstring).

    The model is linear in alpha_s and in the fixed parts, so two runs of it per size give the
    least-squares fit in closed form; the residuals then come from runs at the fitted values.
    """
    points = measured_points(scale)
    base = Params(alpha_s=0.0, message_s=message_s, node_hop_s=node_hop_s)
    unit = 1e-3
    vote = [pt for pt in points if pt["figure"] == "vote" and pt["replicas"] == 0
            and pt["ranks"] in fit_ranks]
    if len(vote) < 2:
        raise SystemExit(f"the scale JSON lacks the flat vote figure at two of "
                         f"{list(fit_ranks)} ranks (replicas=0)")
    g = [_flat_s(pt["ranks"], "commit", base) for pt in vote]
    x = [(_flat_s(pt["ranks"], "commit", dataclasses.replace(base, alpha_s=unit)) - gi) / unit
         for pt, gi in zip(vote, g)]
    y = [pt["measured_s"] - gi for pt, gi in zip(vote, g)]
    slope, intercept = _least_squares(x, y)
    free = {"alpha_s": slope, "fixed_commit_s": intercept}
    if free["fixed_commit_s"] >= 0:
        alpha, fixed = free["alpha_s"], free["fixed_commit_s"]
    else:  # a negative fixed cost: hold it at 0 and fit the slope through the origin
        alpha, fixed = sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x), 0.0
    fitted = dataclasses.replace(base, alpha_s=alpha, fixed_commit_s=fixed)
    restore = [pt for pt in points if pt["figure"] == "restore" and pt["ranks"] in fit_ranks]
    offsets = [pt["measured_s"] - _flat_s(pt["ranks"], "restore", fitted) for pt in restore]
    fitted = dataclasses.replace(
        fitted, fixed_restore_s=max(0.0, statistics.median(offsets)) if offsets else 0.0)
    for pt in points:
        operation = FIGURES[pt["figure"]][0]
        pt["model_s"] = _flat_s(pt["ranks"], operation, fitted)
        pt["residual_s"] = pt["measured_s"] - pt["model_s"]
        pt["in_fit"] = (pt["figure"] == "vote" and pt["replicas"] == 0
                        and pt["ranks"] in fit_ranks)
    return fitted, {"unconstrained": free, "points": points, "fit_ranks": list(fit_ranks),
                    "hierarchical_check": check_hierarchical(scale, fitted, check_protocol)}


# --- the report ----------------------------------------------------------------------------------

SENSITIVE = ("alpha_leader_s", "decode_s", "per_rank_s", "message_s", "per_node_s",
             "node_hop_s")


def sensitivity(p: Params, ranks: int, per_node: int) -> dict[str, Any]:
    """The hierarchical commit at ``ranks`` with each uncertain parameter x0.5 and x2, and the
    leaders' step cost at which it would take GOAL_S."""
    out: dict[str, Any] = {"ranks": ranks, "ranks_per_node": per_node}
    for protocol in PROTOCOLS[1:]:
        row: dict[str, Any] = {"base_s": simulate(protocol, ranks, per_node, "commit", p)[
            "seconds"]}
        for name in SENSITIVE:
            value = {"alpha_leader_s": p.alpha_leader, "decode_s": p.decode_s,
                     "per_rank_s": p.per_rank_s, "message_s": p.message_s,
                     "per_node_s": p.per_node_s, "node_hop_s": p.node_hop_s}[name]
            for factor in (0.5, 2.0):
                changed: dict[str, Any] = {name: value * factor}
                varied = dataclasses.replace(p, **changed)
                row[f"{name}_x{factor:g}"] = simulate(protocol, ranks, per_node, "commit",
                                                      varied)["seconds"]
        row["alpha_leader_s_for_goal"] = _solve_alpha_leader(protocol, ranks, per_node, p)
        out[protocol] = row
    return out


def _solve_alpha_leader(protocol: str, ranks: int, per_node: int, p: Params) -> float | None:
    """The leaders' step cost that makes the commit GOAL_S (linear in it); None: not even 0."""
    def at(a: float) -> float:
        return simulate(protocol, ranks, per_node, "commit",
                        dataclasses.replace(p, alpha_leader_s=a))["seconds"]
    zero, one = at(0.0), at(1e-3)
    if zero >= GOAL_S:
        return None
    return (GOAL_S - zero) / ((one - zero) / 1e-3)


def build_report(scale: dict[str, Any], sizes: Sequence[int], per_node: Sequence[int],
                 scale_path: str, fit_ranks: Sequence[int] = FIT_RANKS,
                 check_protocol: str = "hier-p2p", message_s: float = MESSAGE_S,
                 node_hop_s: float = NODE_HOP_S) -> dict[str, Any]:
    p, fit = calibrate(scale, fit_ranks, check_protocol, message_s, node_hop_s)
    results: list[dict[str, Any]] = []
    for rpn in per_node:
        for ranks in sizes:
            row: dict[str, Any] = {"ranks": ranks, "ranks_per_node": rpn,
                                   "nodes": -(-ranks // rpn)}
            for protocol in PROTOCOLS:
                if protocol == "flat" and rpn != per_node[0]:
                    row["flat"] = results[sizes.index(ranks)]["flat"]  # no nodes in flat
                    continue
                commit = simulate(protocol, ranks, rpn, "commit", p)
                restore = simulate(protocol, ranks, rpn, "restore", p)
                row[protocol] = {"commit_s": commit["seconds"], "restore_s": restore["seconds"]}
                if protocol == "flat":
                    row[protocol]["store_busy_s_per_exchange"] = commit["store_busy_s"] / len(
                        SAVE_EXCHANGES)
            results.append(row)
    biggest = max(sizes)
    values = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    values.update(alpha_leader_s=p.alpha_leader)
    return {
        "benchmark": "control_plane_model",
        "calibrated_on": scale_path,
        "scale_machine": {k: scale.get("machine", {}).get(k)
                          for k in ("cpu_count", "torch", "git_commit", "date_utc")},
        "assumptions": {
            "gloo_allgather": "ring (gloo/allgather.cc): N-1 dependent steps of one segment "
                              "each; finish = last entry + (N-1)(alpha + beta*segment)",
            "flat_exchange": "store send (fire-and-forget, served FIFO at rank 0) + ring "
                             "all-gather of 8 B sizes + ring all-gather of the messages + "
                             "N x decode",
            "hier_exchange": "two ring all-gathers in each node (alpha_s a step) + the "
                             "leaders' all-gather (ring: two, nodes-1 steps each; "
                             "hier-log: Bruck, ceil(log2 nodes) rounds) + (1 + failures) x "
                             "decode + ranks x per_rank_s + two broadcasts back in the node "
                             "(ceil(log2 node size) steps each) + the same tally on each rank",
            "save_exchanges": [w for w, _ in SAVE_EXCHANGES],
            "restore_exchanges": [w for w, _ in RESTORE_EXCHANGES],
            "not_modelled": ["stragglers and the wait for the slowest shard",
                             "network topology, congestion, cross-node latency beyond alpha",
                             "failures (good path)", "CPU contention between ranks"],
        },
        "parameters": {name: {"value": values[name], "source": PARAMETER_SOURCES.get(
            name, "set")} for name in values},
        "calibration": fit,
        "results": results,
        "sensitivity": sensitivity(p, biggest, per_node[0] if 8 not in per_node else 8),
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}" if seconds < 10 else f"{seconds * 1e3:,.0f}"


def table(report: dict[str, Any]) -> str:
    params = report["parameters"]
    lines = ["calibrated: " + ", ".join(
        f"{name} {params[name]['value'] * 1e6:.1f} us" for name in
        ("alpha_s", "decode_s", "store_send_s", "store_serve_s", "per_rank_s"))
        + ", fixed " + ", ".join(f"{name} {params[name]['value'] * 1e3:.2f} ms" for name in
                                 ("fixed_commit_s", "fixed_restore_s")), "",
        "fit (flat model against the scale JSON, ms; * = in the fit):",
        f"{'figure':<11}{'repl':>5}{'ranks':>6}{'measured':>10}{'model':>9}{'resid':>8}"]
    for pt in report["calibration"]["points"]:
        lines.append(f"{pt['figure']:<11}{pt['replicas']:>5}{pt['ranks']:>6}"
                     f"{pt['measured_s'] * 1e3:>10.1f}{pt['model_s'] * 1e3:>9.1f}"
                     f"{pt['residual_s'] * 1e3:>+8.1f}{' *' if pt['in_fit'] else ''}")
    check = report["calibration"].get("hierarchical_check") or []
    if check:
        lines += ["", f"check ({check[-1]['protocol']} model against the measured per-node "
                      "runs, not fitted; flat where a run had one node; ms):",
                  f"{'figure':<11}{'ranks':>6}{'measured':>10}{'model':>9}{'resid':>8}"]
        lines += [f"{pt['figure']:<11}{pt['ranks']:>6}{pt['measured_s'] * 1e3:>10.1f}"
                  f"{pt['model_s'] * 1e3:>9.1f}{pt['residual_s'] * 1e3:>+8.1f}" for pt in check]
    free = report["calibration"]["unconstrained"]
    lines += ["", f"unconstrained fit: alpha_s {free['alpha_s'] * 1e6:.1f} us, fixed_commit_s "
                  f"{free['fixed_commit_s'] * 1e3:.2f} ms"
                  + (" (negative: held at 0)" if free["fixed_commit_s"] < 0 else "")]
    short = ("hier", "hier-log", "hier-p2p", "h-runs", "h-sock")
    lines += ["", f"{'ranks':>6}{'per node':>9}{'nodes':>6} | {'commit ms: flat':>16}"
              + "".join(f"{k:>9}" for k in short) + f" | {'restore ms: flat':>17}"
              + "".join(f"{k:>9}" for k in short)]
    for row in report["results"]:
        c = [_ms(row[k]["commit_s"]) for k in PROTOCOLS]
        r = [_ms(row[k]["restore_s"]) for k in PROTOCOLS]
        lines.append(f"{row['ranks']:>6}{row['ranks_per_node']:>9}{row['nodes']:>6} | "
                     f"{c[0]:>16}" + "".join(f"{v:>9}" for v in c[1:]) + f" | {r[0]:>17}"
                     + "".join(f"{v:>9}" for v in r[1:]))
    sens = report["sensitivity"]
    lines += ["", f"sensitivity of the commit at {sens['ranks']:,} ranks, "
                  f"{sens['ranks_per_node']} per node (ms):"]
    for protocol in PROTOCOLS[1:]:
        row = sens[protocol]
        parts = [f"{name} x{f:g} {_ms(row[f'{name}_x{f:g}'])}" for name in SENSITIVE
                 for f in (0.5, 2.0)]
        goal = row["alpha_leader_s_for_goal"]
        lines.append(f"  {protocol:<9} {_ms(row['base_s'])}: " + ", ".join(parts))
        lines.append(f"  {'':<9} 100 ms needs alpha_leader <= "
                     + ("(none: over 100 ms at 0)" if goal is None else f"{goal * 1e6:.1f} us"))
    return "\n".join(lines)


def fit_node_stage(probe: dict[str, Any]) -> dict[str, Any]:
    """``node_hop_s`` and ``message_s`` from ``probe_node_stage.py``'s JSON: an exchange of a
    node of N beside a node of one, less the same with N = 1 (no node stage), is the node
    stage and the relay, ``2 node_hop_s + 2 (N - 1) message_s`` by the hier-sockets model;
    least squares over every N >= 2 (held >= 0)."""
    rows = {row["n"]: row["median_s"] for row in probe["medians"].values()
            if row["layout"] == "one+N"}
    if 1 not in rows or len([n for n in rows if n >= 2]) < 2:
        raise SystemExit("the node-stage probe lacks one+N at N = 1 and at two N >= 2")
    slope, intercept = _least_squares([float(n - 1) for n in sorted(rows) if n >= 2],
                                      [rows[n] - rows[1] for n in sorted(rows) if n >= 2])
    return {"node_hop_s": max(intercept / 2, 0.0), "message_s": max(slope / 2, 0.0),
            "points": [{"n": n, "node_stage_s": rows[n] - rows[1]} for n in sorted(rows)
                       if n >= 2], "exchange_one_node_s": rows[1]}


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected e.g. 8,16,32")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=Path, default=SCALE_JSON,
                        help="the measurements to calibrate on (default: %(default)s)")
    parser.add_argument("--ranks", type=_int_list, default=list(SIZES))
    parser.add_argument("--ranks-per-node", type=_int_list, default=[8])
    parser.add_argument("--fit-ranks", type=_int_list, default=list(FIT_RANKS),
                        help="the flat configurations fitted (default 8,16,32; fewer than "
                             "the cores, or the fit takes in the wait for a core)")
    parser.add_argument("--check-protocol",
                        choices=PROTOCOLS[1:],
                        default="hier-p2p",
                        help="the per-node protocol the scale JSON measured: hier-sockets (as "
                             "built), hier-runs (3ba9993), hier-p2p (a8d0de8), hier-log (eb84046: rings in each node), hier (39cf544: "
                             "gloo's ring between the leaders too)")
    parser.add_argument("--message-s", type=float, default=MESSAGE_S,
                        help="a leader's cost per message of its node's ranks beyond the hop "
                             "(hier-p2p, hier-runs; default %(default)s s, assumed)")
    parser.add_argument("--node-hop-s", type=float, default=NODE_HOP_S,
                        help="one message over a node's local socket (hier-sockets; default "
                             "%(default)s s: half the dev VM's round trip)")
    parser.add_argument("--node-probe", type=Path, default=None,
                        help="probe_node_stage.py's JSON: node_hop_s and message_s fitted on "
                             "its node of N beside a node of one (overrides --node-hop-s and "
                             "--message-s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    args = parser.parse_args(argv)
    scale = json.loads(args.scale.read_text())
    try:
        shown = str(args.scale.resolve().relative_to(HERE.parent))
    except ValueError:
        shown = str(args.scale)
    node_fit = None
    if args.node_probe is not None:
        node_fit = fit_node_stage(json.loads(args.node_probe.read_text()))
        args.node_hop_s, args.message_s = node_fit["node_hop_s"], node_fit["message_s"]
    report = build_report(scale, args.ranks, args.ranks_per_node, shown, args.fit_ranks,
                          args.check_protocol, args.message_s, args.node_hop_s)
    if node_fit is not None:
        report["node_stage_fit"] = {"from": str(args.node_probe), **node_fit}
        for name in ("node_hop_s", "message_s"):
            report["parameters"][name]["source"] = (
                f"fitted on {args.node_probe}: a node of N beside a node of one, less N = 1")
    text = json.dumps(report, indent=1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

