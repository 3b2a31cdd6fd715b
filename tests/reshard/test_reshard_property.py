"""Resharding through the whole pipeline, for random tensors, meshes and placements: saved by N
gloo ranks into real files, restored by ``restore_latest`` on M ranks, every live rank's local
shard is its slice of the full tensor.

Starting a gloo job per example would take seconds each, so one pool of four long-lived ranks
(``tests/children/reshard_property_worker.py``) serves every example: ranks ``0..N-1`` save on a
mesh of N ranks (a sub-job with a coordinator over its own group), then ranks ``0..M-1`` restore
on a mesh of M. Hypothesis draws the examples in this process and sends each to the ranks as a
JSON line; the expected slice is what ``distribute_tensor`` of the full tensor gives the rank.
"""

from __future__ import annotations

import itertools
import json
import math
import queue
import shutil
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, note, seed, settings
from hypothesis import strategies as st

from tests._support.children import child_script, free_port, spawn_child

WORKER = child_script("reshard_property_worker.py")
POOL = 4
STEP = 3  # the worker's
READY_TIMEOUT_S = 120.0
PHASE_TIMEOUT_S = 60.0  # one save or restore of one example; the ranks' own bound is 20 s
MIB = 1024 * 1024

# A passing run takes about 35 s on two cores, a failing one about as long again to shrink;
# the bound leaves room for failures that cost a pool restart or a phase timeout each.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class RanksFailed(AssertionError):
    """A rank of the pool raised, died or did not answer."""


class RankPool:
    """``POOL`` gloo ranks of the worker, started again after a failure that may have left a
    collective half done: a rank that died or did not answer, or an error that not every rank
    asked raised, or that was a ``CoordinationError`` (the worker's ``clean``). A pool that
    fails to start is not tried again: every later request fails at once."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.generation = 0
        self.procs: list[subprocess.Popen[str]] = []
        self.replies: list[queue.Queue[str | None]] = []
        self.ids = itertools.count()
        self.unstartable: str | None = None

    def ask(self, ranks: Sequence[int], request: dict[str, Any]) -> list[dict[str, Any]]:
        """Send ``request`` to each of ``ranks`` and return their replies, in rank order."""
        if self.unstartable is not None:
            raise RanksFailed(self.unstartable)
        if not self.procs:
            self.start()
        request = {**request, "id": next(self.ids)}
        try:
            for rank in ranks:
                stdin = self.procs[rank].stdin
                assert stdin is not None
                stdin.write(json.dumps(request) + "\n")
                stdin.flush()
            replies = [self.reply(rank, PHASE_TIMEOUT_S, request["id"]) for rank in ranks]
        except (OSError, RanksFailed) as exc:
            self.stop()
            raise RanksFailed(f"{request['op']} on ranks {list(ranks)}: {exc}\n{self.tails()}"
                              ) from None
        errors = {rank: r["error"] for rank, r in zip(ranks, replies) if "error" in r}
        if errors:
            if len(errors) < len(replies) or not all(r.get("clean") for r in replies):
                self.stop()
            raise RanksFailed(f"{request['op']} on ranks {list(ranks)} raised:\n" + "\n".join(
                f"rank {rank}: ...{error[-1500:]}" for rank, error in errors.items()))
        return replies

    def reply(self, rank: int, timeout: float, want: int | None) -> dict[str, Any]:
        try:
            line = self.replies[rank].get(timeout=timeout)
        except queue.Empty:
            raise RanksFailed(f"rank {rank} did not answer within {timeout:g} s") from None
        if line is None:
            raise RanksFailed(f"rank {rank} exited ({self.procs[rank].poll()})")
        reply: dict[str, Any] = json.loads(line)
        if want is not None and reply.get("id") != want:
            raise RanksFailed(f"rank {rank} answered request {reply.get('id')}, not {want}")
        return reply

    def start(self) -> None:
        self.generation += 1
        port = free_port()
        self.procs, self.replies = [], []
        for rank in range(POOL):
            env = {"RANK": str(rank), "WORLD_SIZE": str(POOL), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            proc = spawn_child(WORKER, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=self.log(rank), text=True)
            self.procs.append(proc)
            replies: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=_read_lines, args=(proc, replies), daemon=True).start()
            self.replies.append(replies)
        try:
            for rank in range(POOL):
                assert self.reply(rank, READY_TIMEOUT_S, None) == {"ready": rank}
        except RanksFailed as exc:
            self.stop()
            self.unstartable = f"the pool did not start: {exc}\n{self.tails()}"
            raise RanksFailed(self.unstartable) from None

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(timeout=30)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        self.procs = []

    def log(self, rank: int) -> Path:
        return self.logs / f"pool-{self.generation}-rank-{rank}.log"

    def tails(self) -> str:
        return "\n".join(f"--- rank {rank}'s stderr:\n{self.log(rank).read_text()[-2000:]}"
                         for rank in range(POOL) if self.log(rank).exists())


def _read_lines(proc: subprocess.Popen[str], into: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        into.put(line)
    into.put(None)


@contextmanager
def rank_pool(logs: Path) -> Iterator[RankPool]:
    logs.mkdir(parents=True, exist_ok=True)
    pool = RankPool(logs)
    try:
        pool.start()
        yield pool
    finally:
        pool.stop()


WORLDS = [(saved, live) for saved in range(1, POOL + 1) for live in range(1, POOL + 1)]
"""Every pair of world sizes, saved and live: another world size 12 times in 16. Each pair gets
its own examples: drawn from one strategy, hypothesis would repeat a few pairs and leave
others out."""
EXAMPLES_PER_WORLDS = 3


def _meshes(world: int) -> st.SearchStrategy[tuple[int, ...]]:
    """A mesh of ``world`` ranks: 1-D, or 2-D of any factors."""
    return st.sampled_from([(world,)] + [(rows, world // rows) for rows in range(1, world + 1)
                                         if world % rows == 0])


@st.composite
def _placements(draw: st.DrawFn, ndim: int, mesh: tuple[int, ...]) -> list[str]:
    """One placement per mesh dimension; on a 2x2 mesh, one tensor dimension split by both
    mesh dimensions half the time (drawn independently, that would be rare)."""
    if min(mesh) > 1 and draw(st.booleans()):
        dim = draw(st.sampled_from(range(ndim)))
        return [f"S{dim}"] * len(mesh)
    return [draw(st.sampled_from(["R", *(f"S{d}" for d in range(ndim))])) for _ in mesh]


@st.composite
def examples(draw: st.DrawFn, saved_world: int, live_world: int) -> dict[str, Any]:
    """A saved mesh, a live mesh, and one to three tensors placed on each. (``sampled_from``
    rather than ``integers``: near uniform, where ``integers`` favours its bounds and empty
    tensors would crowd out the rest; a size shrinks towards 1.)"""
    saved_mesh, live_mesh = draw(_meshes(saved_world)), draw(_meshes(live_world))
    tensors = []
    for i in range(draw(st.sampled_from([1, 2, 3]))):
        shape = draw(st.lists(st.sampled_from([*range(1, 10), 0]), min_size=1, max_size=3))
        tensors.append({
            "name": "abc"[i], "shape": shape, "base": 1000 * i + 1,
            "dtype": draw(st.sampled_from(["float32", "int64", "int32", "float64"])),
            "saved": draw(_placements(len(shape), saved_mesh)),
            "live": draw(_placements(len(shape), live_mesh)),
        })
    return {"saved_mesh": saved_mesh, "live_mesh": live_mesh, "tensors": tensors,
            # 4 KiB checksum blocks: a tensor's ranges cross block boundaries
            "chunk_bytes": draw(st.sampled_from([4096, 64 * MIB])),
            # a few bytes a span: a box is read in many ranges
            "reshard_bytes_in_flight": draw(st.sampled_from([8, 40, 64 * MIB]))}


def _save_and_restore(pool: RankPool, root: Path, example: dict[str, Any]) -> None:
    """Save ``example`` on its saved mesh, restore it on its live mesh, and check every live
    rank's reply: the step, ``resharded_from`` (None only where nothing of the layout
    changed) and its local shards."""
    saved_world = math.prod(example["saved_mesh"])
    live_world = math.prod(example["live_mesh"])
    pool.ask(range(saved_world), {
        "op": "save", "root": str(root), "mesh": example["saved_mesh"],
        "tensors": example["tensors"], "chunk_bytes": example["chunk_bytes"]})
    replies = pool.ask(range(live_world), {
        "op": "restore", "root": str(root), "mesh": example["live_mesh"],
        "tensors": example["tensors"],
        "reshard_bytes_in_flight": example["reshard_bytes_in_flight"]})
    shutil.rmtree(root)
    same_layout = example["saved_mesh"] == example["live_mesh"] and all(
        t["saved"] == t["live"] for t in example["tensors"])
    resharded_from = None if same_layout else saved_world
    wrong = []
    for rank, reply in enumerate(replies):
        note(f"rank {rank}: {reply}")
        if reply["step"] != STEP:
            wrong.append(f"rank {rank} restored step {reply['step']}, not {STEP}")
        if reply["resharded_from"] != resharded_from:
            wrong.append(f"rank {rank}: resharded_from {reply['resharded_from']}, "
                         f"not {resharded_from}")
        wrong += [f"rank {rank}: {d}" for d in reply["differ"]]
    assert not wrong, "\n".join(wrong)


def test_every_live_shard_is_its_slice_of_the_saved_tensor(tmp_path: Path) -> None:
    """For random DTensors saved on one mesh and restored on another (every pair of world
    sizes from 1 to 4, 1-D and 2-D meshes, uneven and empty shards, a dimension split by both
    mesh dimensions), each live rank's local shard equals its slice of the full tensor,
    element for element, and the restore reports the step and, where the layout changed, the
    number of ranks that saved it."""
    roots = (tmp_path / f"example-{i}" for i in itertools.count())
    with rank_pool(tmp_path / "logs") as pool:
        for saved_world, live_world in WORLDS:
            # A seed per pair and no database: every run draws the same examples. Shrinking
            # stays on: every example saves into a root of its own, and a failure that may
            # have left a collective half done stops the pool, so that the next example
            # starts on fresh ranks.
            @seed(10 * saved_world + live_world)
            @settings(max_examples=EXAMPLES_PER_WORLDS, deadline=None, database=None)
            @given(example=examples(saved_world, live_world))
            def check(example: dict[str, Any]) -> None:
                _save_and_restore(pool, next(roots), example)

            check()
