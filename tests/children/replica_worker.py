"""One rank of the replication tests in ``tests/replicate/test_replication.py``.

Usage (one process per rank, the environment set as ``torchrun`` would set it)::

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python tests/children/replica_worker.py --phase PHASE --root ROOT --nodes N \\
            --replicas K --steps 10,20 --out OUT.json [--scenario S]

It joins a gloo process group and opens a ``cp.CheckpointPipeline`` on ``ROOT/rank-r`` with
``ReplicationConfig(copies=K, node_name=f"node{r // (n // N)}")`` (ranks 0 .. n/N-1 on node0,
and so on). Phases:

- ``save``: saves each of ``--steps`` and waits for its result; records per step the
  ``CommitInfo`` (or the error), and the replication events;
- ``restore``: restores into a state of zeros (``restore_latest``, or ``restore(step=N)`` with
  ``--restore-step N``); records the result (step, ``fetched``, TrainState) and which values
  differ from those saved at that step by this rank, or the error;
- ``save-restore``: ``restore``, then ``save`` of ``--steps`` (the next save after a restore).

``--variant V`` shifts every saved value by ``7 V``: another run's root, with the same step
numbers and other values. ``--wait-copies``: after the restore, wait (bounded) until this
rank's copies sent again (``RestoreResult.resending``) are each settled by an event, then for
every rank (a barrier, so that each holder's copy server is still up), before the pipeline
closes.

With ``--persistent URL`` the pipelines also promote every ``--persist-every``-th step there
(``tests/replicate/test_persist_ranks.py``). With ``--memory BASE`` they keep each save in a
memory tier at ``BASE/rank-r`` (``disk_every=--disk-every``, ``keep=1``), and the ``save``
phase records per step the memory commit and what became durable on disk (with its copies);
``--crash-after-save`` then ends each rank with SIGKILL once every rank has settled its saves
(a process crash: no close, so the newest memory-only step is not written through).

Scenarios (``--scenario``, default ``plain``) inject what a test needs:

- ``slow-holder``: in ``save``, every rank's copy server takes ``--delay`` seconds per data
  frame it receives (a slow network or disk at the holder);
- ``refuse-copies``: rank ``--target`` runs a copy server that drops every push (its disk
  refuses the copies); its own saves work.

Every value saved is a function of (step, rank), so the test can check restores exactly. After
the phase, the results are written to ``OUT`` as JSON (atomically); errors as type, message,
step, rank.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ckpt_pipeline as cp

W_NUMEL = 300_000  # 1.2 MB of float32: several checksum chunks, so copies go in many frames
"""Elements of the large tensor (``--numel`` sets another number)."""
SAMPLES_PER_STEP = 16
ARGS: argparse.Namespace | None = None


def make_state() -> dict[str, Any]:
    global W_NUMEL
    W_NUMEL = ARGS.numel if ARGS is not None else W_NUMEL
    model = nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    return {"w": torch.zeros(W_NUMEL), "model": model, "meta": {"step": -1, "rank": -1}}


def expected(step: int, rank: int) -> dict[str, torch.Tensor]:
    variant = ARGS.variant if ARGS is not None else 0
    return {
        "w": torch.arange(W_NUMEL, dtype=torch.float32).add_(step * 16 + rank + variant * 7),
        "model.weight": torch.arange(32, dtype=torch.float32).add_(step - rank).view(4, 8),
        "model.bias": torch.full((4,), float(step * 100 + rank)),
    }


def _live(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"w": state["w"], "model.weight": state["model"].weight,
            "model.bias": state["model"].bias}


def set_step(state: dict[str, Any], step: int, rank: int) -> None:
    with torch.no_grad():
        for name, value in expected(step, rank).items():
            _live(state)[name].copy_(value)
    state["meta"] = {"step": step, "rank": rank}


def mismatches(state: dict[str, Any], step: int, rank: int) -> list[str]:
    out = [name for name, value in expected(step, rank).items()
           if not torch.equal(_live(state)[name], value)]
    if state["meta"] != {"step": step, "rank": rank}:
        out.append(f"meta is {state['meta']!r}")
    return out


def train_state(step: int) -> cp.TrainState:
    return cp.TrainState(step=step, consumed_train_samples=step * SAMPLES_PER_STEP,
                         extra={"tag": f"s{step}"})


def rng_digest() -> str:
    """The CPU generator's state, as a short digest (restored RNG must equal the saved one)."""
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def _error(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc),
            "step": getattr(exc, "step", None), "rank": getattr(exc, "rank", None),
            "traceback": traceback.format_exc()}


def _patch_scenario(args: argparse.Namespace, rank: int) -> None:
    """Install the scenario's fault in this process's copy server."""
    from ckpt_pipeline._tiers.replica import server as copy_server
    from ckpt_pipeline._tiers.replica import wire

    if args.scenario == "slow-holder":
        original = wire.recv_data

        def slow(*a: Any, **k: Any) -> None:
            time.sleep(args.delay)
            original(*a, **k)

        copy_server.recv_data = slow  # type: ignore[assignment]
    elif args.scenario == "refuse-copies" and rank == args.target:
        def refuse(self: Any, conn: Any, hello: dict[str, Any]) -> None:
            raise wire.ProtocolError(f"rank {rank} refuses copies (injected)")

        copy_server.CopyServer._receive = refuse  # type: ignore[method-assign]


def run_save(args: argparse.Namespace, rank: int, out: dict[str, Any]) -> None:
    events: list[dict[str, Any]] = []
    saves: dict[str, Any] = {}
    with cp.CheckpointPipeline(args.root_of_rank, **_options(args, rank)) as pipe:
        pipe.subscribe(lambda e: events.append({"type": type(e).__name__, **_plain(e)})
                       if isinstance(e, (cp.ShardReplicated, cp.ReplicaStored,
                                         cp.ReplicationDegraded, cp.ShardUploaded,
                                         cp.StepPersisted, cp.PersistFailed,
                                         cp.PersistSkipped)) else None)
        state = make_state()
        handles: dict[int, tuple[cp.SaveHandle, float, str]] = {}
        memory: list[int] = []
        rss: list[int] = []
        for step in args.steps:
            set_step(state, step, rank)
            torch.rand(7)  # the RNG moves on between saves: each save captures another state
            rng = rng_digest()
            started = time.monotonic()
            try:
                handle = pipe.save(step, state, train_state(step))
            except cp.CheckpointError as exc:  # the failure policy raising in save()
                saves[str(step)] = {"ok": False, "raised_in_save": True, "error": _error(exc)}
                continue
            blocking = time.monotonic() - started
            pipe.wait_snapshot()
            handles[step] = (handle, blocking, rng)
            if not args.no_wait:
                _settle(handle, step, blocking, rng, started, saves, args)
            memory.append(pipe.host_memory_bytes)
            rss.append(_rss_bytes())
        for step, (handle, blocking, rng) in handles.items():
            if str(step) not in saves:
                _settle(handle, step, blocking, rng, time.monotonic(), saves, args)
        out["host_memory_bytes"] = memory
        out["rss_bytes"] = rss
        if args.crash_after_save:
            out["saves"], out["events"] = saves, events
            dist.barrier()  # every rank has settled its saves
            write_out(args, out)
            os.kill(os.getpid(), signal.SIGKILL)
    out["saves"] = saves
    out["events"] = events


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _settle(handle: cp.SaveHandle, step: int, blocking: float, rng: str, started: float,
            saves: dict[str, Any], args: argparse.Namespace) -> None:
    try:
        info = handle.result(args.max_seconds)
        saves[str(step)] = {"ok": True, "replica_holders": list(info.replica_holders),
                            "missing": [list(m) for m in info.missing_replicas],
                            "seconds": time.monotonic() - started, "blocking": blocking,
                            "rng": rng, "tier": info.tier}
        if args.memory is not None:
            durable = handle.durable(args.max_seconds)
            saves[str(step)]["durable_holders"] = (
                None if durable is None else list(durable.replica_holders))
    except cp.CheckpointError as exc:
        saves[str(step)] = {"ok": False, "error": _error(exc), "blocking": blocking}


def run_restore(args: argparse.Namespace, rank: int, out: dict[str, Any]) -> None:
    state = make_state()
    events: list[dict[str, Any]] = []
    with cp.CheckpointPipeline(args.root_of_rank, **_options(args, rank)) as pipe:
        resent = threading.Condition()

        def record(e: cp.Event) -> None:
            if isinstance(e, (cp.ShardFetched, cp.CheckpointRejected, cp.ShardDownloaded,
                              cp.ForeignFilesSetAside, cp.ReplicaRestored,
                              cp.ReplicaRestoreFailed, cp.ReplicaStored)):
                with resent:
                    events.append({"type": type(e).__name__, **_plain(e)})
                    resent.notify_all()

        pipe.subscribe(record)
        try:
            result = (pipe.restore_latest(state) if args.restore_step is None
                      else pipe.restore(state, step=args.restore_step))
        except cp.CheckpointError as exc:
            out["restore"] = {"ok": False, "error": _error(exc)}
        else:
            if result is None:
                out["restore"] = {"ok": True, "step": None}
            else:
                # What the result says is still being sent, as the restore returned.
                resending = {str(h): list(s) for h, s in result.resending.items()}
                out["restore"] = {
                    "ok": True, "step": result.step, "save_id": result.save_id,
                    "resending": resending,
                    "foreign": {str(k): list(v) for k, v in result.foreign.items()},
                    "fetched": {str(k): v for k, v in result.fetched.items()},
                    "downloaded": list(result.downloaded),
                    "from_memory": list(result.from_memory),
                    "train_state": {"step": result.train_state.step,
                                    "consumed": result.train_state.consumed_train_samples,
                                    "extra": dict(result.train_state.extra)},
                    "mismatches": mismatches(state, result.step, rank),
                    "rng": rng_digest(),
                }
        if args.wait_copies and out["restore"].get("ok") and out["restore"]["step"] is not None:
            # This rank's re-sends: wait (bounded) for each one's event before closing.
            mine = sorted(int(h) for h, s in out["restore"]["resending"].items() if rank in s)

            def settled() -> bool:
                return sorted(e["holder"] for e in events if e["type"] in (
                    "ReplicaRestored", "ReplicaRestoreFailed")) == mine

            with resent:
                out["copies_settled"] = resent.wait_for(settled, timeout=args.max_seconds)
            # Holders stay open (their copy servers) until every source's copies settled.
            dist.barrier()
    out["restore_events"] = events


def _plain(event: cp.Event) -> dict[str, Any]:
    return json.loads(json.dumps(event.fields(), default=str))


def _options(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    per_node = max(1, args.world_size // args.nodes)
    replication = cp.ReplicationConfig(copies=args.replicas,
                                       node_name=f"node{rank // per_node}",
                                       timeout_s=args.replication_timeout)
    options = {"replication": replication,
               "keep_last": args.keep_last, "coordination_timeout_s": args.coordination_timeout,
               "io_threads": 2, "direct_io": False, "max_failures_in_row": args.max_failures}
    if args.memory is not None:
        options["memory"] = cp.MemoryConfig(str(args.memory / f"rank-{rank}"), keep=1,
                                            disk_every=args.disk_every)
    if args.persistent:
        options["persistent"] = cp.PersistentConfig(
            args.persistent, every=args.persist_every,
            options=json.loads(os.environ.get("CKPT_TEST_PERSIST_OPTIONS", "null")))
    return options


def write_out(args: argparse.Namespace, out: dict[str, Any]) -> None:
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1, default=str))
    tmp.replace(args.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", required=True,
                        choices=("save", "restore", "save-restore"))
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--steps", default="10,20")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--scenario", default="plain",
                        choices=("plain", "slow-holder", "refuse-copies"))
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--numel", type=int, default=W_NUMEL)
    parser.add_argument("--max-failures", type=int, default=3)
    parser.add_argument("--no-wait", action="store_true",
                        help="save every step without waiting for the previous one's result")
    parser.add_argument("--target", type=int, default=1)
    parser.add_argument("--coordination-timeout", type=float, default=60.0)
    parser.add_argument("--replication-timeout", type=float, default=20.0)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--persistent", default=None,
                        help="a persistent tier (its fsspec options as JSON in the environment "
                             "variable CKPT_TEST_PERSIST_OPTIONS)")
    parser.add_argument("--persist-every", type=int, default=1)
    parser.add_argument("--variant", type=int, default=0,
                        help="another run's values: every saved value is shifted by it")
    parser.add_argument("--wait-copies", action="store_true",
                        help="after a restore, wait for this rank's copies sent again")
    parser.add_argument("--restore-step", type=int, default=None)
    parser.add_argument("--memory", default=None, type=Path,
                        help="a memory tier per rank under this directory")
    parser.add_argument("--disk-every", type=int, default=2)
    parser.add_argument("--crash-after-save", action="store_true")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    args.steps = [int(s) for s in args.steps.split(",") if s]
    global ARGS
    ARGS = args
    faulthandler.dump_traceback_later(args.max_seconds + 30, exit=True)
    rank = int(os.environ["RANK"])
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.root_of_rank = args.root / f"rank-{rank}"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(1234 + rank)
    _patch_scenario(args, rank)
    out: dict[str, Any] = {"rank": rank}
    try:
        if args.phase == "save":
            run_save(args, rank, out)
        elif args.phase == "restore":
            run_restore(args, rank, out)
        else:
            run_restore(args, rank, out)
            run_save(args, rank, out)
    except BaseException as exc:
        out["fatal"] = _error(exc)
    write_out(args, out)
    dist.destroy_process_group()
    sys.exit(1 if "fatal" in out else 0)


if __name__ == "__main__":
    main()
