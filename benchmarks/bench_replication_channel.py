"""Which channel should carry shard bytes between ranks: anyio TCP streams or a gloo group?

The replication issue asks for a data plane that neither uses the training's process group nor
blocks the control plane, and names two candidates. This measures both, between two processes
of one machine (rank 0 sends, rank 1 receives), in one run:

- ``gloo``: a process group of its own (``dist.new_group(backend="gloo")``), ``dist.send`` of
  a uint8 tensor piece by piece into ``dist.recv`` of a preallocated buffer;
- ``tcp_anyio``: an anyio TCP stream, the receiver's address exchanged through the job's c10d
  store (as the pipeline would), ``send`` of memoryviews, ``receive`` into the buffer (anyio
  returns bytes: one copy);
- ``tcp_threads``: a TCP connection on blocking sockets, as a worker thread of the pipeline
  would drive it: ``sendall`` of memoryviews, ``recv_into`` the buffer (no copy).

Each transfer also hashes what arrived (xxh3, per piece, as the receiver must before it
publishes): ``*_verified`` is the transfer including that. Piece sizes and total sizes are
options; throughput is reported in GB/s, median of the repeats, and each channel against the
best plain copy of the same bytes in memory (the floor of a local transfer).

    python benchmarks/bench_replication_channel.py                    # 256 MiB and 1 GiB, 3 repeats
    python benchmarks/bench_replication_channel.py --sizes-mb 64 --repeats 1   # smoke, seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash
from _machine import machine_info

MiB = 1 << 20
CHANNELS = ("gloo", "tcp_anyio", "tcp_threads")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pieces(total: int, piece: int) -> list[tuple[int, int]]:
    return [(at, min(at + piece, total)) for at in range(0, total, piece)]


def _hash_pieces(buffer: torch.Tensor, pieces: list[tuple[int, int]]) -> list[int]:
    view = memoryview(buffer.numpy())
    return [xxhash.xxh3_64_intdigest(view[a:b]) for a, b in pieces]


def _gloo(rank: int, group: Any, buffer: torch.Tensor, pieces: list[tuple[int, int]],
          verify: bool) -> float:
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for a, b in pieces:
        if rank == 0:
            dist.send(buffer[a:b], dst=1, group=group)
        else:
            dist.recv(buffer[a:b], src=0, group=group)
            if verify:
                xxhash.xxh3_64_intdigest(memoryview(buffer[a:b].numpy()))
    dist.barrier(group=group)
    return time.perf_counter() - t0


async def _tcp(rank: int, store: Any, buffer: torch.Tensor, pieces: list[tuple[int, int]],
               verify: bool, tag: str) -> float:
    """anyio streams on the event loop: ``receive`` returns bytes, copied into the buffer."""
    view = memoryview(buffer.numpy())
    if rank == 1:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        store.set(f"addr-{tag}", f"127.0.0.1:{port}")
        async with listener:
            stream = await listener.listeners[0].accept()
            async with stream:
                t0 = time.perf_counter()
                for a, b in pieces:
                    at = a
                    while at < b:
                        chunk = await stream.receive(b - at)
                        view[at:at + len(chunk)] = chunk
                        at += len(chunk)
                    if verify:
                        xxhash.xxh3_64_intdigest(view[a:b])
                await stream.send(b"k")
                return time.perf_counter() - t0
    host, port = store.get(f"addr-{tag}").decode().rsplit(":", 1)
    stream = await anyio.connect_tcp(host, int(port))
    async with stream:
        t0 = time.perf_counter()
        for a, b in pieces:
            await stream.send(view[a:b])
        await stream.receive(1)
        return time.perf_counter() - t0


def _tcp_threads(rank: int, store: Any, buffer: torch.Tensor, pieces: list[tuple[int, int]],
                 verify: bool, tag: str) -> float:
    """Blocking sockets (as in a worker thread): ``sendall`` and ``recv_into`` the buffer."""
    view = memoryview(buffer.numpy())
    if rank == 1:
        with socket.create_server(("127.0.0.1", 0)) as server:
            store.set(f"addr-{tag}", f"127.0.0.1:{server.getsockname()[1]}")
            conn, _ = server.accept()
            with conn:
                t0 = time.perf_counter()
                for a, b in pieces:
                    at = a
                    while at < b:
                        n = conn.recv_into(view[at:b])
                        if n == 0:
                            raise ConnectionError("the sender closed early")
                        at += n
                    if verify:
                        xxhash.xxh3_64_intdigest(view[a:b])
                conn.sendall(b"k")
                return time.perf_counter() - t0
    host, port = store.get(f"addr-{tag}").decode().rsplit(":", 1)
    with socket.create_connection((host, int(port))) as conn:
        t0 = time.perf_counter()
        for a, b in pieces:
            conn.sendall(view[a:b])
        conn.recv(1)
        return time.perf_counter() - t0


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")  # the data plane's own group, not the job's
    results: dict[str, Any] = {}
    for size_mb in args.sizes_mb:
        total = size_mb * MiB
        buffer = torch.empty(total, dtype=torch.uint8)
        if rank == 0:
            buffer.random_(0, 256, generator=torch.Generator().manual_seed(size_mb))
        else:
            buffer.zero_()
        pieces = _pieces(total, args.piece_mb * MiB)
        expected = _hash_pieces(buffer, pieces) if rank == 0 else None
        samples: dict[str, list[float]] = {}
        for repeat in range(args.repeats):
            for channel in CHANNELS:
                for verify in (False, True):
                    tag = f"{size_mb}-{repeat}-{channel}-{verify}"
                    if rank == 1:
                        buffer.zero_()
                    if channel == "gloo":
                        seconds = _gloo(rank, group, buffer, pieces, verify)
                    elif channel == "tcp_anyio":
                        seconds = anyio.run(_tcp, rank, store, buffer, pieces, verify, tag)
                    else:
                        seconds = _tcp_threads(rank, store, buffer, pieces, verify, tag)
                    name = f"{channel}_verified" if verify else channel
                    samples.setdefault(name, []).append(seconds)
                    if rank == 1:  # check what arrived, untimed
                        got = _hash_pieces(buffer, pieces)
                        store.set(f"sum-{tag}", json.dumps(got))
                    else:
                        got = json.loads(store.get(f"sum-{tag}"))
                        if got != expected:
                            raise AssertionError(f"{name}: the bytes that arrived differ")
                    dist.barrier(group=group)
        copy = []
        other = torch.empty_like(buffer)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            other.copy_(buffer)
            copy.append(time.perf_counter() - t0)
        samples["memory_copy"] = copy
        results[str(size_mb)] = {
            name: {"median_s": statistics.median(v), "min_s": min(v), "samples": v,
                   "gb_per_s": total / statistics.median(v) / 1e9}
            for name, v in samples.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--piece-mb", type=int, default=16,
                        help="bytes per send (and per checksum) in MiB; default 16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "replication_channel.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "r.json")
        mp.start_processes(_worker, args=(_free_port(), args, raw), nprocs=2,
                           start_method="spawn")
        results = json.loads(Path(raw).read_text())
    report = {"machine": machine_info(Path.cwd()), "config": {k: str(v) for k, v in
                                                             vars(args).items()},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"two processes on one machine, {args.piece_mb} MiB pieces, median of "
          f"{args.repeats}")
    print(f"{'MiB':>6}  {'channel':<24} {'GB/s':>7}  {'x memory copy time':>19}")
    for size, by_name in results.items():
        copy = by_name["memory_copy"]["median_s"]
        for name, r in by_name.items():
            print(f"{size:>6}  {name:<24} {r['gb_per_s']:7.2f}  {r['median_s'] / copy:19.2f}")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
