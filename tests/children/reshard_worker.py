"""One rank of the reshard tests (tests/reshard/test_reshard_restore.py, one process a rank).

``save``: build a small model (FSDP2 on a 1-D mesh of the world, or DDP), train two steps on a
fixed global batch split over the ranks, save step 2 into the shared ``--root``; rank 0 writes
the full parameters and optimizer moments (``saved.npz``) and the full parameters after one
more step on the same global batch (``next.npz``).

``restore``: build the model fresh (other initial values, FSDP2 or DDP on this world size),
``restore_latest``, and write to ``--out``: what the restore reported, whether every full
parameter and moment equals ``saved.npz`` bit for bit, and the largest difference from
``next.npz`` after one more step on the same global batch.

``mesh-save`` / ``mesh-restore``: DTensors of several placements, uneven sizes included, on a
2-D mesh (``--mesh 2x2``), restored onto another mesh shape and placements.

``volume-save`` / ``volume-restore``: a row-split matrix and a replicated one on a 1-D mesh,
restored onto another world size (``--live S0`` or ``S1`` for the matrix) through a storage
that counts every byte read; ``--out`` gets, per saved shard file, the ranges read inside its
data region, with each tensor's byte range there and the checksum block.

``volume-damaged-restore``: the same onto 2 ranks whose live tensors hold other values, when a
checksum block near the end of a saved shard is damaged: the restore fails on every rank after
it read ranges straight into the live tensors, and puts them back (``--out``: the error, whether
every live bit is as it was, and the bytes put back, from the library's log).

``values-save`` / ``values-restore``: per-rank plain values (a loader position, TrainState
counts and extra) and per-rank RNG streams beside a DTensor, restored onto another world size
(or the same one on a mesh of another shape, ``--mesh 2x2``, or on the saved mesh with another
placement, ``--live S1``, or with its dimensions named otherwise, ``--names``; the save takes
``--mesh`` and ``--names`` too) with ``--choice``: ``none`` (refused), ``exclude`` (the loader kept,
the TrainState values mapped by a hook, rank 0's RNG streams), ``hook`` (everything mapped by
a hook, the live RNG streams kept).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ckpt_pipeline as cp
from tests._support.children import exit_without_teardown

BATCH = 12  # divisible by 1, 2, 3 and 4 ranks: the same global batch at every world size


def build(kind: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(30, 50), torch.nn.ReLU(), torch.nn.Linear(50, 7))  # uneven shards
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.children():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """What is saved: DDP's inner module (its state_dict keys have no ``module.`` prefix, as
    FSDP2's have none)."""
    inner = getattr(model, "module", model)
    assert isinstance(inner, torch.nn.Module)
    return inner


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(BATCH, 30, generator=torch.Generator().manual_seed(seed))
    part = x[rank * BATCH // world:(rank + 1) * BATCH // world]
    opt.zero_grad()
    model(part).pow(2).mean().backward()
    opt.step()


def full(t: torch.Tensor) -> np.ndarray:
    whole = t.full_tensor() if hasattr(t, "full_tensor") else t
    return np.array(whole.detach().cpu().numpy(), copy=True)


def params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k.removeprefix("module."): full(v) for k, v in model.state_dict().items()}


def moments(opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    out = {}
    for i, group_params in enumerate(p for g in opt.param_groups for p in g["params"]):
        for name, value in opt.state[group_params].items():
            out[f"{i}.{name}"] = full(value)
    return out


PLACEMENTS = {  # name: (shape, placements on the saved 2-D mesh)
    "rows_and_cols": ((7, 5), ("S0", "S1")),
    "hsdp": ((9, 3), ("R", "S0")),
    "cols_only": ((4, 6), ("S1", "R")),
    "twice": ((11, 2), ("S0", "S0")),
}


def placements(spec: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split(",")]


def mesh_state(mesh_shape: tuple[int, ...], live: dict[str, str] | None,
               shrink: str = "") -> dict[str, Any]:
    """The tensors of PLACEMENTS on a mesh: their saved values (``live`` None) or zeros placed
    as ``live`` says ({name: "S0,R"}); ``shrink``: that one a row shorter than saved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    state = {}
    for name, (shape, saved) in PLACEMENTS.items():
        value = torch.arange(float(np.prod(shape))).reshape(shape) * (len(name) + 1)
        spec = ",".join(saved) if live is None else live[name]
        zeros = torch.zeros((shape[0] - (name == shrink), *shape[1:]))
        state[name] = distribute_tensor(value if live is None else zeros, mesh,
                                        placements(spec))
    return state


VOLUME = {"rows": (4099, 1024), "rep": (1500, 1024)}  # rows: uneven over 4 and 2 ranks


def volume_state(live: str | None, mesh_shape: tuple[int, ...] = (),
                 names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """VOLUME's tensors: their saved values (rows Shard(0), rep Replicate), or zeros with
    rows placed as ``live`` says; on a 1-D mesh of the world, or of ``mesh_shape`` (rows
    placed as ``live`` on its first dimension, replicated on the others), its dimensions
    named ``names``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape or (dist.get_world_size(),),
                            mesh_dim_names=names)
    rest = ",R" * (len(mesh_shape) - 1) if mesh_shape else ""
    out = {}
    for name, shape in VOLUME.items():
        value = torch.arange(float(np.prod(shape))).reshape(shape) + len(name)
        spec = ("R" if name == "rep" else (live or "S0")) + rest
        out[name] = distribute_tensor(value if live is None else torch.zeros(shape), mesh,
                                      placements(spec))
    return out


class CountingStorage(cp.LocalStorage):
    """``LocalStorage`` that records every read: (file, offset, bytes)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.names: dict[int, str] = {}
        self.reads: list[tuple[str, int, int]] = []

    def open_read(self, rel: str, expected_size: int | None = None) -> tuple[int, int]:
        fd, got = super().open_read(rel, expected_size)
        self.names[fd] = rel
        return fd, got

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> None:
        super().pread_into(fd, buf, offset)
        self.reads.append((self.names.get(fd, "?"), offset, len(buf)))


def volume_report(storage: CountingStorage, live: dict[str, Any]) -> dict[str, Any]:
    """Per saved shard file read: the ranges read in its data region, its tensors' byte
    ranges and its checksum block; and the bytes this rank needed."""
    from ckpt_pipeline._format.names import shard_name
    from ckpt_pipeline._format.scan import scan

    files: dict[str, Any] = {}
    for saved_rank in range(4):
        for status in scan(storage, saved_rank):
            header = status.header
            assert header is not None
            rel = os.path.join(status.dir_name, status.shard_file or shard_name(saved_rank))
            tensors = {}
            for record in header.tensors:
                start = header.storages[record.storage].offset + record.byte_offset
                tensors[record.path] = [start, start + 4 * int(np.prod(record.shape))]
            files[rel] = {"block": header.chunk_bytes, "tensors": tensors,
                          "data": [header.data_offset, header.data_offset + header.data_length],
                          "reads": []}
    for rel, offset, n in storage.reads:
        entry = files.get(rel)
        if entry is not None and entry["data"][0] <= offset and offset + n <= entry["data"][1]:
            entry["reads"].append([offset, offset + n])
    needed = {name: 4 * t.to_local().numel() for name, t in live.items()}
    return {"files": {k: v for k, v in files.items() if v["reads"]}, "needed": needed,
            "all_files": sorted(files)}


class Events(logging.Handler):
    """The library's log events at INFO and above, (name, fields), kept in memory."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.events: list[tuple[str, dict[str, Any]]] = []
        logger = logging.getLogger("ckpt_pipeline")
        logger.addHandler(self)
        logger.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        name = getattr(record, "ckpt_event", None)
        if name:
            self.events.append((name, dict(getattr(record, "ckpt_fields", {}))))

    def field(self, event: str, key: str) -> list[Any]:
        return [fields.get(key) for name, fields in self.events if name == event]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "restore", "mesh-save", "mesh-restore",
                                         "volume-save", "volume-restore",
                                         "volume-damaged-restore", "values-save",
                                         "values-restore"))
    parser.add_argument("--root", required=True)
    parser.add_argument("--kind", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--mesh", default="")
    parser.add_argument("--names", default="", help="values-*: the mesh dimensions' names")
    parser.add_argument("--live", default="", help='mesh-restore: {"name": "S0,R", ...}')
    parser.add_argument("--out", default="")
    parser.add_argument("--shrink", default="", help="mesh-restore: one tensor a row shorter")
    parser.add_argument("--choice", default="none", help="values-restore: none, exclude, hook")
    parser.add_argument("--tier", default="", help="save, restore: a persistent tier's URL")
    parser.add_argument("--own-roots", action="store_true",
                        help="save, restore: each rank its own root, ROOT/rank-R (node-local)")
    parser.add_argument("--copies", type=int, default=0,
                        help="save, restore: replication copies, each rank on a node of its "
                             "own (node-r)")
    parser.add_argument("--inplace-min", type=int, default=-1,
                        help="restore: read live DTensor shards of at least this many bytes "
                             "straight into them (default: the library's threshold, 1 MiB, "
                             "which this worker's small models stay under)")
    args = parser.parse_args()
    if args.inplace_min >= 0:
        import ckpt_pipeline._restore.inplace as inplace

        inplace.INPLACE_MIN_BYTES = args.inplace_min
    cp.enable_logging(logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    here = os.path.dirname(args.root)
    if args.own_roots:
        args.root = os.path.join(args.root, f"rank-{rank}")
    tier: dict[str, Any] = {}
    if args.tier:
        tier["persistent"] = cp.PersistentConfig(args.tier, every=1, takeover=True)
    if args.copies:
        tier["replication"] = cp.ReplicationConfig(copies=args.copies, node_name=f"node-{rank}")
    if args.mode == "save":
        model, opt = build(args.kind, seed=0)
        with cp.CheckpointPipeline(args.root, coordination_timeout_s=60, **tier) as pipe:
            for step in (1, 2):
                train_step(model, opt, seed=step)
                pipe.save(step, {"model": unwrapped(model), "optim": opt},
                          cp.TrainState(step=step)).result(120)
        saved = {**{f"p.{k}": v for k, v in params(model).items()},
                 **{f"m.{k}": v for k, v in moments(opt).items()}}
        train_step(model, opt, seed=3)
        after = params(model)
        if rank == 0:
            np.savez(os.path.join(here, "saved.npz"), **saved)  # type: ignore[arg-type]
            np.savez(os.path.join(here, "next.npz"), **after)  # type: ignore[arg-type]
    elif args.mode == "restore":
        model, opt = build(args.kind, seed=7)
        events = Events()
        try:
            with cp.CheckpointPipeline(args.root, coordination_timeout_s=60, **tier) as pipe:
                result = pipe.restore_latest({"model": unwrapped(model), "optim": opt})
        except cp.CheckpointError as exc:
            with open(args.out, "w") as f:
                json.dump({"error": str(exc), "type": type(exc).__name__}, f)
            exit_without_teardown()
        assert result is not None
        saved = np.load(os.path.join(here, "saved.npz"))
        now = {**{f"p.{k}": v for k, v in params(model).items()},
               **{f"m.{k}": v for k, v in moments(opt).items()}}
        differ = sorted(set(now) ^ set(saved.files)) + [
            k for k in saved.files if k in now and not np.array_equal(now[k], saved[k])]
        equal = not differ
        train_step(model, opt, seed=3)
        expected = np.load(os.path.join(here, "next.npz"))
        diff = max(float(np.abs(v - expected[k]).max(initial=0.0))
                   for k, v in params(model).items())
        out: dict[str, Any] = {"step": result.step, "resharded_from": result.resharded_from,
               "bytes": result.bytes, "equal": equal, "next_step_max_diff": diff,
               "differ": differ,
               "in_place": events.field("ckpt.recovery.resharded", "read_in_place"),
               "tier_read": events.field("ckpt.recovery.reshard_tier_read", "bytes"),
               "tier_sizes": events.field("ckpt.recovery.reshard_tier_read", "sizes"),
               "peer_read": events.field("ckpt.recovery.reshard_peer_read", "bytes"),
               "peer_sizes": events.field("ckpt.recovery.reshard_peer_read", "sizes"),
               "failed": events.field("ckpt.recovery.reshard_failed", "failures")}
        with open(args.out, "w") as f:
            json.dump(out, f)
    elif args.mode == "volume-save":
        with cp.CheckpointPipeline(args.root, coordination_timeout_s=60) as pipe:
            pipe.save(1, {"t": volume_state(None)}, cp.TrainState(step=1)).result(120)
    elif args.mode == "volume-restore":
        live = volume_state(args.live)
        storage = CountingStorage(args.root)
        events = Events()
        with cp.CheckpointPipeline(args.root, storage=storage, coordination_timeout_s=60,
                                   reshard_bytes_in_flight=1 << 20) as pipe:
            result = pipe.restore_latest({"t": live})
        assert result is not None and result.resharded_from == 4
        report = volume_report(storage, live)
        report["in_place"] = events.field("ckpt.recovery.resharded", "read_in_place")
        report["equal"] = all(torch.equal(
            live[name].full_tensor(), torch.arange(float(np.prod(shape))).reshape(shape)
            + len(name)) for name, shape in VOLUME.items())
        with open(args.out, "w") as f:
            json.dump(report, f)
    elif args.mode == "volume-damaged-restore":
        live = volume_state(args.live)
        for t in live.values():
            local = t.to_local()
            local.copy_(torch.randn(local.shape, generator=torch.Generator().manual_seed(rank)))
        before = {name: t.to_local().clone() for name, t in live.items()}
        events = Events()
        report = {}
        try:
            with cp.CheckpointPipeline(args.root, coordination_timeout_s=60,
                                       reshard_bytes_in_flight=1 << 20) as pipe:
                pipe.restore_latest({"t": live})
        except cp.CheckpointError as exc:
            report["error"] = str(exc)
        report["untouched"] = all(torch.equal(live[name].to_local(), before[name])
                                  for name in live)
        report["put_back"] = events.field("ckpt.recovery.reshard_put_back", "bytes")
        with open(args.out, "w") as f:
            json.dump(report, f)
    elif args.mode == "values-save":
        torch.manual_seed(100 + rank)
        mesh = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else ()
        state = {"t": volume_state(None, mesh, tuple(args.names.split(",")) if args.names else None),
                 "loader": {"position": 10 * rank, "epoch": 1}}
        ts = cp.TrainState(step=3, consumed_train_samples=5 * (rank + 1),
                           extra={"seen": rank, "lr": 0.5})
        with cp.CheckpointPipeline(args.root, coordination_timeout_s=60) as pipe:
            pipe.save(3, state, ts).result(120)
        if rank == 0:  # what rank 0's stream draws next
            np.save(os.path.join(here, "rank0_draw.npy"), torch.rand(4).numpy())
    elif args.mode == "values-restore":
        torch.manual_seed(7 + rank)
        live_draw = torch.rand(4)
        torch.manual_seed(7 + rank)
        mesh = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else ()
        live = {"t": volume_state(args.live or "S0", mesh,
                                  tuple(args.names.split(",")) if args.names else None),
                "loader": {"position": -1, "epoch": -1}}
        calls: list[str] = []

        def per_rank(path: str, values: tuple[Any, ...]) -> Any:
            calls.append(path)
            return sum(values) if isinstance(values[0], int) else values[0]

        choices = {"none": None,
                   "exclude": cp.Reshard(rng="rank0", exclude=("loader",), per_rank=per_rank),
                   "hook": cp.Reshard(per_rank=per_rank)}[args.choice]
        try:
            with cp.CheckpointPipeline(args.root, coordination_timeout_s=60) as pipe:
                result = pipe.restore_latest(live, reshard=choices)
            assert result is not None
            out = {"loader": live["loader"], "excluded": list(result.excluded),
                   "consumed": result.train_state.consumed_train_samples,
                   "extra": dict(result.train_state.extra), "calls": sorted(calls),
                   "rank0_stream": bool(np.array_equal(
                       torch.rand(4).numpy(), np.load(os.path.join(here, "rank0_draw.npy")))),
                   "rows_equal": bool(torch.equal(live["t"]["rows"].full_tensor(),
                                                  torch.arange(float(np.prod(VOLUME["rows"])))
                                                  .reshape(VOLUME["rows"]) + 4))}
            torch.manual_seed(7 + rank)
            out["live_stream"] = out["rank0_stream"] is False and bool(
                torch.equal(torch.rand(4), live_draw))
        except cp.CheckpointError as exc:
            out = {"error": str(exc), "type": type(exc).__name__, "loader": live["loader"],
                   "untouched": bool(torch.equal(live["t"]["rows"].to_local(),
                                                 torch.zeros_like(live["t"]["rows"].to_local())))}
        with open(args.out, "w") as f:
            json.dump(out, f)
    elif args.mode == "mesh-save":
        mesh_shape = tuple(int(n) for n in args.mesh.split("x"))
        with cp.CheckpointPipeline(args.root, coordination_timeout_s=60) as pipe:
            pipe.save(5, {"t": mesh_state(mesh_shape, None)}, cp.TrainState(step=5)).result(120)
    else:
        mesh_shape = tuple(int(n) for n in args.mesh.split("x"))
        live = mesh_state(mesh_shape, json.loads(args.live), args.shrink)
        before = {k: v.to_local().clone() for k, v in live.items()}
        try:
            with cp.CheckpointPipeline(args.root, coordination_timeout_s=60) as pipe:
                result = pipe.restore_latest({"t": live})
            out = {"resharded_from": result and result.resharded_from}
            for name, (shape, _) in PLACEMENTS.items():
                expected = torch.arange(float(np.prod(shape))).reshape(shape) * (len(name) + 1)
                out[name] = bool(torch.equal(live[name].full_tensor(), expected))
        except cp.CheckpointError as exc:
            out = {"error": str(exc), "untouched": all(
                torch.equal(v.to_local(), before[k]) for k, v in live.items())}
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
