"""Upload and download throughput of the persistent tier against plain copies of the same files.

A step is saved once with the pipeline (a state of ``--size-mb``), and its files (shard,
manifest, commit record) are then uploaded and downloaded, ``--repeats`` times each, in turns:

- ``ckpt_pipeline``: ``Remote.upload`` / ``Remote.download`` (S3 through obstore; parallel
  parts, every part hashed, the object checked after upload and each part on download);
- ``fsspec``: a plain ``fs.put`` / ``fs.get`` of the same files (s3fs: its own concurrent
  multipart upload; no checks of ours): the baseline of the issue's goal;
- ``obstore``: a plain ``obstore.put`` / ``obstore.get`` of the files, no checks: what the
  client the tier uses gives without the tier's work around it.

Against a real S3-speaking server in another process (``moto_server``, which keeps objects in
memory: the numbers say what each client costs against a server on the same machine, not what
a cloud store gives), and against a directory standing in for a shared file system (there,
ours writes with fsync and plain fsspec does not: ``fsspec_fsync`` is the plain copy followed
by an fsync of each file and the directory). Ratios are against the plain copy, same run.
Needs the test extras and s3fs (``pip install -e '.[test]' s3fs``).

    python benchmarks/bench_persist.py                     # 256 MB, 5 repeats -> results/persist.json
    python benchmarks/bench_persist.py --size-mb 32 --repeats 1 --out /tmp/p.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from _machine import machine_info  # noqa: E402

import ckpt_pipeline as cp  # noqa: E402
from ckpt_pipeline._tiers.persistent.layout import ObjectSum  # noqa: E402
from ckpt_pipeline._tiers.persistent.urls import open_remote  # noqa: E402
from ckpt_pipeline.storage import LocalStorage  # noqa: E402

KEY, SECRET, REGION = "bench", "bench-secret", "us-east-1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, endpoint
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)


def make_step(workdir: Path, size_mb: int) -> tuple[Path, list[Path]]:
    root = workdir / "local"
    state = {"w": torch.randn(size_mb * 1_000_000 // 4)}
    with cp.CheckpointPipeline(root, direct_io=False) as pipe:
        pipe.save(1, state, cp.TrainState(step=1)).result(600)
    step_dir = root / "step-0000000001"
    return step_dir, sorted(p for p in step_dir.iterdir() if p.is_file())


def timed(fn: Callable[[], None]) -> float:
    """Wall time of ``fn``, from a state with no dirty pages (each method pays its own
    flushes, not those of the method before it)."""
    os.sync()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def bench_s3(endpoint: str, files: list[Path], repeats: int, threads: int,
             part_mb: int, workdir: Path) -> dict[str, Any]:
    import fsspec

    fs = fsspec.filesystem("s3", key=KEY, secret=SECRET, endpoint_url=endpoint,
                           client_kwargs={"region_name": REGION}, skip_instance_cache=True)
    fs.call_s3("create_bucket", Bucket="bench")
    remote = open_remote("s3://bench/ours", threads=threads, part_bytes=part_mb * 2**20,
                         options={"access_key_id": KEY, "secret_access_key": SECRET,
                                  "endpoint": endpoint, "region": REGION})
    store = _obstore(endpoint)
    total = sum(f.stat().st_size for f in files)
    times: dict[str, list[float]] = {}
    sums: dict[str, ObjectSum] = {}
    down = workdir / "down"

    def ours_up(i: int) -> None:
        for f in files:
            sums[f.name] = remote.upload(LocalStorage(f.parent), f.name, f"r{i}/{f.name}")

    def ours_down(i: int) -> None:
        down.mkdir(exist_ok=True)
        for f in files:
            fd = os.open(down / f.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                remote.download(f"r{i}/{f.name}", LocalStorage(down), fd, sums[f.name])
            finally:
                os.close(fd)

    def plain_up(i: int) -> None:
        fs.put([str(f) for f in files], f"bench/plain/r{i}/")

    def plain_down(i: int) -> None:
        down.mkdir(exist_ok=True)
        fs.get([f"bench/plain/r{i}/{f.name}" for f in files], str(down) + "/")

    def obstore_up(i: int) -> None:
        import obstore

        for f in files:
            obstore.put(store, f"obstore/r{i}/{f.name}", f, chunk_size=part_mb * 2**20,
                        max_concurrency=threads)

    def obstore_down(i: int) -> None:
        import obstore

        down.mkdir(exist_ok=True)
        for f in files:
            with open(down / f.name, "wb") as out:
                for chunk in obstore.get(store, f"obstore/r{i}/{f.name}").stream():
                    out.write(chunk)

    methods = {"ckpt_pipeline": (ours_up, ours_down), "fsspec": (plain_up, plain_down)}
    if store is not None:
        methods["obstore"] = (obstore_up, obstore_down)
    for i in range(repeats + 1):  # round 0 warms the server and the clients up
        for name, (up, dn) in methods.items():
            t_up = timed(lambda up=up, i=i: up(i))
            t_down = timed(lambda dn=dn, i=i: dn(i))
            shutil.rmtree(down, ignore_errors=True)
            if i:
                times.setdefault(f"{name}.upload", []).append(t_up)
                times.setdefault(f"{name}.download", []).append(t_down)
    remote.close()
    return _summary(times, total, options_shown={"endpoint": endpoint})


def _obstore(endpoint: str) -> Any:
    try:
        from obstore.store import S3Store
    except ImportError:
        return None
    return S3Store("bench", endpoint=endpoint, access_key_id=KEY, secret_access_key=SECRET,
                   region=REGION, client_options={"allow_http": True})


def bench_dir(files: list[Path], repeats: int, threads: int, part_mb: int,
              workdir: Path) -> dict[str, Any]:
    import fsspec

    fs = fsspec.filesystem("file")
    remote = open_remote(str(workdir / "shared" / "ours"), threads=threads,
                         part_bytes=part_mb * 2**20)
    total = sum(f.stat().st_size for f in files)
    times: dict[str, list[float]] = {}
    for i in range(repeats + 1):
        t = timed(lambda i=i: [remote.upload(LocalStorage(f.parent), f.name, f"r{i}/{f.name}")
                               for f in files])
        target = workdir / "shared" / "plain" / f"r{i}"
        target.mkdir(parents=True, exist_ok=True)
        t_plain = timed(lambda target=target: fs.put([str(f) for f in files],
                                                     str(target) + "/"))
        shutil.rmtree(workdir / "shared" / "plain", ignore_errors=True)
        target.mkdir(parents=True, exist_ok=True)
        t_synced = timed(lambda target=target: _put_and_fsync(fs, files, target))
        if i:
            times.setdefault("ckpt_pipeline.upload", []).append(t)
            times.setdefault("fsspec.upload", []).append(t_plain)
            times.setdefault("fsspec_fsync.upload", []).append(t_synced)
        shutil.rmtree(workdir / "shared" / "plain", ignore_errors=True)
    remote.close()
    return _summary(times, total, options_shown={"dir": str(workdir / "shared")})


def _put_and_fsync(fs: Any, files: list[Path], target: Path) -> None:
    """The plain copy made as durable as ours: fsync of every file and of the directory."""
    fs.put([str(f) for f in files], str(target) + "/")
    for f in files:
        fd = os.open(target / f.name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _summary(times: dict[str, list[float]], total: int,
             options_shown: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"bytes": total, **options_shown, "seconds": times,
                           "median_gb_s": {k: total / statistics.median(v) / 1e9
                                           for k, v in times.items()}}
    rates = out["median_gb_s"]
    out["ratio_vs_fsspec"] = {
        f"{who}.{op}": rates[f"{who}.{op}"] / rates[f"fsspec.{op}"]
        for who in ("ckpt_pipeline", "obstore", "fsspec_fsync") for op in ("upload", "download")
        if f"{who}.{op}" in rates and f"fsspec.{op}" in rates}
    if "fsspec_fsync.upload" in rates:
        out["ratio_vs_fsspec_fsync"] = {
            "ckpt_pipeline.upload": rates["ckpt_pipeline.upload"] / rates["fsspec_fsync.upload"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--part-mb", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" /
                        "persist.json")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-persist-", dir=REPO))
    server, endpoint = start_server()
    try:
        _, files = make_step(workdir, args.size_mb)
        result = {
            "machine": machine_info(workdir),
            "args": {k: str(v) for k, v in vars(args).items()},
            "s3": bench_s3(endpoint, files, args.repeats, args.threads, args.part_mb, workdir),
            "dir": bench_dir(files, args.repeats, args.threads, args.part_mb, workdir),
        }
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'target':<5} {'method':<28} {'GB/s':>7} {'vs fsspec':>9} {'vs +fsync':>9}")
    for target in ("s3", "dir"):
        r = result[target]
        for name, rate in sorted(r["median_gb_s"].items()):
            ratio = r["ratio_vs_fsspec"].get(name)
            synced = r.get("ratio_vs_fsspec_fsync", {}).get(name)
            print(f"{target:<5} {name:<28} {rate:7.3f} "
                  f"{'' if ratio is None else f'{ratio:9.2f}'} "
                  f"{'' if synced is None else f'{synced:9.2f}'}")


if __name__ == "__main__":
    main()
