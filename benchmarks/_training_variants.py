"""The checkpointing variants of ``bench_training.py`` and the timed training loop they share.

Every variant sees the same loop: ``steps`` training steps, a save after the optimizer step of
every ``every``-th one, the training stream synchronized at the end. A variant hooks in at three
points: ``before_update()`` (just before ``optimizer.step()``: where the training thread must
wait for a snapshot or a staging copy before the state is updated in place), ``save(step)``
(after the update), and ``finish()`` (after the loop, timed apart: until the last save is
durable). ``prepare()`` and ``close()`` are untimed.

Peers keep at most ``keep`` checkpoints plus the one being written: once save ``k`` is durable, a
background thread deletes save ``k - keep`` (ckpt_pipeline does the same with ``keep_last``).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from _baselines import torch_save
from _training_floors import drop_page_cache_tree
from _training_workload import (
    Workload,
    host_memory_stats,
    release_cached_pinned_memory,
    rss_bytes,
    state_tensors,
)

__all__ = (
    "VARIANTS",
    "CkptPipeline",
    "DcpAsyncSave",
    "DcpSave",
    "NoCheckpoint",
    "TorchSave",
    "Variant",
    "make_variant",
    "memory_config",
    "memory_tier_path",
    "restore_check",
    "run_loop",
)

VARIANTS = (
    "none",
    "ckpt_pipeline",
    "ckpt_pipeline_staged",
    "ckpt_pipeline_2slots",
    "ckpt_pipeline_streamed",
    "ckpt_pipeline_persist",
    "ckpt_pipeline_persist_shm",
    "torch_save",
    "dcp_save",
    "dcp_async_save",
    "dcp_async_save_pinned",
    "ckpt_pipeline_memory",
    "ckpt_pipeline_memory_sized",
    "ckpt_pipeline_memory_staged",
    "ckpt_pipeline_memory_staged_fresh",
    "nvrx_local",
)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class Retainer:
    """Deletes old checkpoints of a peer in a background thread, keeping the newest ``keep``."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.paths: list[Path] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-retain")
        self._lock = threading.Lock()

    def add(self, path: Path) -> int:
        with self._lock:
            self.paths.append(path)
            return len(self.paths) - 1

    def durable(self, index: int) -> None:
        """Save ``index`` is durable: delete save ``index - keep``. Callable from any thread."""
        old = index - self.keep
        if old >= 0:
            self._pool.submit(_remove, self.paths[old])

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class Variant:
    """No checkpointing: the baseline. Subclasses add saves."""

    name = "none"
    uses_before_update = False

    def __init__(self, work: Workload, root: Path, args: Any) -> None:
        self.work = work
        self.root = root
        self.args = args
        self.saves: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.loop_started: float | None = None  # set by run_loop when the timed loop starts

    def prepare(self) -> None:
        """Untimed set-up before the loop."""

    def before_update(self) -> None:
        """Just before ``optimizer.step()`` in every step."""

    def save(self, step: int) -> None:
        """After ``optimizer.step()`` of a save step."""

    def finish(self) -> None:
        """After the loop: wait until the last save is durable (timed apart)."""

    def after_finish(self) -> None:
        """Untimed, after ``finish()``: collect results, extra measurements."""

    def close(self) -> None:
        """Untimed clean-up: stop the peer's retention thread, if it has one."""
        retain = getattr(self, "retain", None)
        if retain is not None:
            retain.close()

    def report(self) -> dict[str, Any]:
        return {"saves": self.saves, **self.extra}


NoCheckpoint = Variant


class TorchSave(Variant):
    """``torch.save({model, optim state dicts})`` to a temp file, fsync, rename, fsync the dir."""

    name = "torch_save"

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.retain = Retainer(self.args.keep)

    def save(self, step: int) -> None:
        path = self.root / f"step-{step}.pt"
        index = self.retain.add(path)
        t0 = time.perf_counter()
        torch_save(self.work.state_dicts(), path)
        seconds = time.perf_counter() - t0
        self.saves.append({"step": step, "blocking_s": seconds, "durable_s": seconds})
        self.retain.durable(index)

class DcpSave(Variant):
    """``torch.distributed.checkpoint.save`` (synchronous; FileSystemWriter fsyncs its files)."""

    name = "dcp_save"

    def prepare(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.root.mkdir(parents=True, exist_ok=True)
        self.retain = Retainer(self.args.keep)

    def save(self, step: int) -> None:
        path = self.root / f"step-{step}"
        index = self.retain.add(path)
        t0 = time.perf_counter()
        self.dcp.save(self.work.state_dicts(), checkpoint_id=str(path))
        seconds = time.perf_counter() - t0
        self.saves.append({"step": step, "blocking_s": seconds, "durable_s": seconds})
        self.retain.durable(index)

def _split_response(response: Any) -> tuple[Future[Any] | None, Future[Any]]:
    """(staging future or None, upload future) of what ``dcp.async_save`` returned."""
    upload = getattr(response, "upload_completion", None)
    if upload is None:
        return None, response
    return getattr(response, "staging_completion", None), upload


class DcpAsyncSave(Variant):
    """``dcp.async_save``; the previous save is awaited before the next one.

    ``pinned``: with ``async_stager=DefaultStager(StagingOptions(True, True, True, True))``, a
    new stager per save (torch 2.11 cannot reuse one after a save), closed once its upload is
    done. Its staging copies run on the stager's own stream from a thread; that stream is made
    to wait for the training stream first, and the staging future is awaited before the next
    ``optimizer.step()``, as the in-place update would otherwise race with the copies.
    """

    def __init__(self, work: Workload, root: Path, args: Any, *, pinned: bool) -> None:
        super().__init__(work, root, args)
        self.pinned = pinned
        self.name = "dcp_async_save_pinned" if pinned else "dcp_async_save"
        self.upload: Future[Any] | None = None
        self.uploaded = threading.Event()
        self.staging: tuple[Future[Any], dict[str, Any]] | None = None
        self.uses_before_update = True

    def prepare(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.root.mkdir(parents=True, exist_ok=True)
        self.retain = Retainer(self.args.keep)
        self.extra["return_types"] = []
        self.extra["stream_ordering"] = []
        if self.pinned:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.make_stager = lambda: DefaultStager(
                StagingOptions(True, self.args.dcp_shared_memory, True, True))
            self.extra["staging_options"] = {
                "use_pinned_memory": True, "use_shared_memory": self.args.dcp_shared_memory,
                "use_async_staging": True, "use_non_blocking_copy": True}

    def _order_stager_stream(self, stager: Any) -> str:
        if self.work.device.type != "cuda":
            return "none (cpu)"
        stream = getattr(stager, "_staging_stream", None)
        if stream is not None and hasattr(stream, "wait_stream"):
            stream.wait_stream(torch.cuda.current_stream())
            return "staging_stream.wait_stream(current_stream)"
        torch.cuda.current_stream().synchronize()
        return "current_stream.synchronize()"

    def _wait_staging(self) -> None:
        if self.staging is None:
            return
        future, record = self.staging
        self.staging = None
        t0 = time.perf_counter()
        future.result()
        record["staging_wait_s"] = time.perf_counter() - t0
        record["blocking_s"] += record["staging_wait_s"]

    def before_update(self) -> None:
        self._wait_staging()

    def save(self, step: int) -> None:
        path = self.root / f"step-{step}"
        index = self.retain.add(path)
        t0 = time.perf_counter()
        if self.upload is not None:
            self.upload.result()
        t1 = time.perf_counter()
        kwargs: dict[str, Any] = {}
        stager = None
        if self.pinned:
            stager = self.make_stager()
            ordering = self._order_stager_stream(stager)
            if ordering not in self.extra["stream_ordering"]:
                self.extra["stream_ordering"].append(ordering)
            kwargs["async_stager"] = stager
        t2 = time.perf_counter()
        response = self.dcp.async_save(self.work.state_dicts(), checkpoint_id=str(path),
                                       **kwargs)
        t3 = time.perf_counter()
        kind = type(response).__name__
        if kind not in self.extra["return_types"]:
            self.extra["return_types"].append(kind)
        staging, upload = _split_response(response)
        record: dict[str, Any] = {
            "step": step,
            "wait_previous_s": t1 - t0,
            "stager_init_s": t2 - t1,
            "call_s": t3 - t2,
            "staging_wait_s": 0.0,
            "blocking_s": t3 - t0,
        }
        self.saves.append(record)
        if staging is not None:
            staging.add_done_callback(
                lambda _f, r=record: r.__setitem__("staged_s", time.perf_counter() - t2))
            self.staging = (staging, record)
        done = threading.Event()
        upload.add_done_callback(lambda f, r=record, s=stager, i=index, d=done: self._uploaded(
            f, r, t2, s, i, d))
        self.upload = upload
        self.uploaded = done

    def _uploaded(self, future: Future[Any], record: dict[str, Any], started: float,
                  stager: Any, index: int, done: threading.Event) -> None:
        try:
            record["durable_s"] = time.perf_counter() - started
            error = future.exception()
            if error is not None:
                record["error"] = f"{type(error).__name__}: {error}"
            if stager is not None:
                t0 = time.perf_counter()
                try:
                    stager.close()
                except Exception as exc:
                    record["stager_close_error"] = f"{type(exc).__name__}: {exc}"
                record["stager_close_s"] = time.perf_counter() - t0
            if error is None:
                self.retain.durable(index)
        finally:
            done.set()  # close() waits for this callback, not only for the future

    def finish(self) -> None:
        self._wait_staging()
        if self.upload is not None:
            self.upload.result()

    def close(self) -> None:
        if self.upload is not None:
            self.upload.exception()  # wait; an error was recorded by the callback
            self.uploaded.wait()  # the callback runs after the future is done
        super().close()


class CkptPipeline(Variant):
    """``cp.CheckpointPipeline(root, keep_last=keep)``: ``wait_snapshot()`` before the optimizer
    step, ``save()`` after it, ``wait()`` at the end.

    Untimed around the loop: a first save at step 0 (it allocates the pinned pool: reported as
    ``first_save``), and after ``finish()`` one more save with the GPU idle (its snapshot stage
    is the copy speed without the queued training step in front of it).
    """

    name = "ckpt_pipeline"
    uses_before_update = True
    isolated_save = True  # after_finish: one more save with the GPU idle (False: skip it)

    def __init__(self, work: Workload, root: Path, args: Any, cp: Any,
                 **overrides: Any) -> None:
        super().__init__(work, root, args)
        self.cp = cp
        self.overrides = overrides  # PipelineConfig fields of this variant (over the flags)
        self.event_times: list[tuple[float, str, int]] = []
        self.events: list[Any] = []
        self.pending: dict[str, Any] | None = None
        self.handles: dict[int, Any] = {}
        self.idle_waits: list[float] = []

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"keep_last": self.args.keep}
        if self.args.io_threads is not None:
            options["io_threads"] = self.args.io_threads
        if self.args.buffer_slots is not None:
            options["buffer_slots"] = self.args.buffer_slots
        if self.args.pipeline_chunk_mb is not None:
            options["chunk_bytes"] = self.args.pipeline_chunk_mb << 20
        options.update({k: v for k, v in self.overrides.items() if not k.startswith("_")})
        if self.args.pipeline_coordinator == "local":
            options["coordinator"] = self.cp.LocalCoordinator()
        return options

    def _record(self, event: Any) -> None:
        """Keep every event with the time it was emitted (for the timeline of the loop)."""
        self.events.append(event)
        self.event_times.append((time.perf_counter(), type(event).__name__, event.step))

    def _memory(self) -> dict[str, Any]:
        return {"host_memory_bytes": self.pipe.host_memory_bytes,
                "host_memory_pinned": self.pipe.host_memory_pinned,
                "rss": rss_bytes(), "torch_host_memory_stats": host_memory_stats()}

    def _untimed_save(self, step: int, *, block_cpu: bool = False) -> dict[str, Any]:
        """One save with the GPU idle, awaited until settled. With ``block_cpu``, the
        ``wait_snapshot`` returns once the copies are done, so ``blocking_s`` is the wall time
        from ``save()`` to the snapshot in host memory."""
        self.work.sync()
        t0 = time.perf_counter()
        handle = self.pipe.save(step, self.work.state(), self.cp.TrainState(step=step))
        t1 = time.perf_counter()
        self.pipe.wait_snapshot(block_cpu=block_cpu)
        t2 = time.perf_counter()
        info = handle.result()
        self.pipe.wait()
        t3 = time.perf_counter()
        return {"step": step, "save_call_s": t1 - t0, "wait_snapshot_s": t2 - t1,
                "blocking_s": t2 - t0, "durable_s": info.seconds, "settled_s": t3 - t0}

    def prepare(self) -> None:
        options = self._options()
        settings = {k: v for k, v in options.items() if k != "coordinator"}
        settings["coordinator"] = self.args.pipeline_coordinator
        self.extra["options"] = settings
        self.pipe = self.cp.CheckpointPipeline(self.root, **options)
        self.pipe.open()
        self.pipe.subscribe(self._record)
        self.extra["memory_before_first_save"] = {"rss": rss_bytes(),
                                                  "torch_host_memory_stats":
                                                      host_memory_stats()}
        self.extra["first_save"] = self._untimed_save(0)
        self.extra["first_save_s"] = self.extra["first_save"]["blocking_s"]
        self.extra["memory_after_first_save"] = self._memory()

    def before_update(self) -> None:
        t0 = time.perf_counter()
        self.pipe.wait_snapshot()
        seconds = time.perf_counter() - t0
        if self.pending is not None:
            self.pending["wait_snapshot_s"] = seconds
            self.pending["blocking_s"] += seconds
            self.pending = None
        else:
            self.idle_waits.append(seconds)

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        handle = self.pipe.save(step, self.work.state(), self.cp.TrainState(step=step))
        seconds = time.perf_counter() - t0
        record = {"step": step, "save_call_s": seconds, "wait_snapshot_s": None,
                  "blocking_s": seconds}
        self.handles[step] = handle
        self.saves.append(record)
        self.pending = record

    def finish(self) -> None:
        self.before_update()  # the last save's wait_snapshot, had training gone on
        self.pipe.wait()

    def after_finish(self) -> None:
        """Untimed: memory after the timed saves, then the save with the GPU idle."""
        for record in self.saves:
            try:
                info = self.handles[record["step"]].result(0)
            except Exception as exc:  # a skipped or failed save: counted, not fatal
                record["error"] = f"{type(exc).__name__}: {exc}"
                continue
            record["durable_s"] = info.seconds
            record["bytes"] = info.bytes
        self.extra["memory_after_timed_saves"] = self._memory()
        last = self.saves[-1]["step"] if self.saves else 0
        if not self.isolated_save:
            self.extra["last_step"] = last
            return
        self.extra["isolated_save"] = self._untimed_save(last + 1, block_cpu=True)
        self.extra["memory_at_end"] = self._memory()
        self.extra["last_step"] = last + 1

    def close(self) -> None:
        pipe = getattr(self, "pipe", None)
        if pipe is not None:
            pipe.close()
        for path in self.overrides.get("_remove_after", ()):
            shutil.rmtree(path, ignore_errors=True)

    def report(self) -> dict[str, Any]:
        stages: dict[int, dict[str, Any]] = {}
        for event in list(self.events):
            kind = type(event).__name__
            row = stages.setdefault(event.step, {})
            if kind == "SaveRequested":
                row["save_call_s"] = event.blocking_seconds
                row["bytes"] = event.bytes
            elif kind in ("SnapshotTaken", "ShardDataWritten", "ShardSealed",
                          "CheckpointCommitted"):
                row[{"SnapshotTaken": "snapshot_s", "ShardDataWritten": "serialize_s",
                     "ShardSealed": "write_s", "CheckpointCommitted": "commit_s"}[kind]] = \
                    event.seconds
            elif kind == "CheckpointPruned":  # this step was pruned after a later commit
                row["pruned_s"] = event.seconds
            elif kind == "SaveFailed":
                row["failed"] = f"{event.stage}: {event.error}"
        for record in self.saves:
            record["stages"] = stages.get(record["step"], {})
        for key in ("first_save", "isolated_save"):
            if key in self.extra:
                self.extra[key]["stages"] = stages.get(self.extra[key]["step"], {})
        start = self.loop_started
        timeline = [[round(t - start, 4), kind, step] for t, kind, step in self.event_times
                    ] if start is not None else []
        persist = [{"event": type(e).__name__, "step": e.step,
                    **{k: getattr(e, k) for k in ("bytes", "seconds", "reason", "error")
                       if hasattr(e, k)}}
                   for e in list(self.events)
                   if type(e).__name__ in ("ShardUploaded", "StepPersisted", "PersistSkipped",
                                           "PersistFailed")]
        return {
            "saves": self.saves,
            **({"persist": persist} if persist else {}),
            "event_times_in_loop_s": timeline,
            "idle_wait_snapshot": {"calls": len(self.idle_waits),
                                   "total_s": sum(self.idle_waits),
                                   "median_s": _median(self.idle_waits)},
            "events": sorted({type(e).__name__ for e in self.events}),
            **self.extra,
        }


def make_variant(name: str, work: Workload, root: Path, args: Any, cp: Any) -> Variant:
    if name == "none":
        return Variant(work, root, args)
    if name == "torch_save":
        return TorchSave(work, root, args)
    if name == "dcp_save":
        return DcpSave(work, root, args)
    if name in ("dcp_async_save", "dcp_async_save_pinned"):
        return DcpAsyncSave(work, root, args, pinned=name.endswith("pinned"))
    if name == "ckpt_pipeline":
        return CkptPipeline(work, root, args, cp)
    if name == "ckpt_pipeline_staged":  # the optimizer waits for a device copy only
        return CkptPipeline(work, root, args, cp, device_staging=True)
    if name == "ckpt_pipeline_2slots":  # double buffering: a save never waits for the last
        return CkptPipeline(work, root, args, cp, buffer_slots=2)
    if name == "ckpt_pipeline_streamed":  # bounded host memory: the state streams through
        return CkptPipeline(work, root, args, cp,
                            host_buffer_bytes=args.streamed_buffer_mb << 20)
    if name == "ckpt_pipeline_persist":  # every 2nd committed step promoted to a directory
        return CkptPipeline(work, root, args, cp,
                            persistent=cp.PersistentConfig(f"{root}-persistent", every=2))
    if name == "ckpt_pipeline_persist_shm":  # the same, to a tier with a bandwidth of its own
        shared = Path("/dev/shm") / f"ckpt-bench-{root.name}-{os.getpid()}-persistent"
        return CkptPipeline(work, root, args, cp,
                            persistent=cp.PersistentConfig(str(shared), every=2),
                            _remove_after=(shared,))
    if name == "ckpt_pipeline_memory":  # issue 24: commit to /dev/shm, every 4th to disk too
        shm = memory_tier_path(root)
        return CkptPipeline(work, root, args, cp, memory=memory_config(cp, shm),
                            _remove_after=(shm,))
    if name == "ckpt_pipeline_memory_staged_fresh":  # a fresh job: no size, device staging
        shm = memory_tier_path(root)
        return CkptPipeline(work, root, args, cp, memory=memory_config(cp, shm),
                            _remove_after=(shm,), device_staging=True)
    if name in ("ckpt_pipeline_memory_sized", "ckpt_pipeline_memory_staged"):
        # The same, its buffers made at open (slot_bytes: a restart's, or a given size);
        # _staged also with device_staging=True (the optimizer waits for a device copy only).
        shm = memory_tier_path(root)
        params = sum(p.numel() * p.element_size() for p in work.model.parameters())
        size = (3 * params + (16 << 20)) // 4096 * 4096  # weights, AdamW's two moments, margin
        staged = {"device_staging": True} if name.endswith("staged") else {}
        return CkptPipeline(work, root, args, cp,
                            memory=memory_config(cp, shm, slot_bytes=size),
                            _remove_after=(shm,), **staged)
    if name == "nvrx_local":  # NVIDIA resiliency extension's local checkpoints (lazy import)
        from _nvrx_variant import NvrxLocal

        return NvrxLocal(work, root, args)
    raise ValueError(f"unknown variant {name!r}")


def memory_tier_path(root: Path) -> Path:
    """A /dev/shm directory of this run for the memory tier of a variant writing to ``root``."""
    return Path("/dev/shm") / f"ckpt-bench-{root.name}-{os.getpid()}-memory"


def memory_config(cp: Any, path: Path, *, slots: int = 3, keep: int = 1,
                  disk_every: int = 4, slot_bytes: int | None = None) -> Any:
    """``cp.MemoryConfig(...)`` (issue 24), or a RuntimeError when this ckpt_pipeline lacks it."""
    config = getattr(cp, "MemoryConfig", None)
    if config is None:
        raise RuntimeError(
            "ckpt_pipeline_memory needs the memory tier (cp.MemoryConfig, issue 24), which this "
            f"ckpt_pipeline ({getattr(cp, '__file__', '?')}) does not have; leave the variant "
            "out of --variants, or run on a tree that has it")
    return config(path=str(path), slots=slots, keep=keep, disk_every=disk_every,
                  slot_bytes=slot_bytes)


def run_loop(variant: Variant, *, steps: int, every: int, warmup_steps: int,
             sync_mode: str, log: Callable[[str], None], label: str | None = None
             ) -> dict[str, Any]:
    """prepare, warm-up steps, the timed loop, the timed final wait; returns the raw record.

    The loop ends when the training stream is done (``total_stream_s``) and then when every
    stream of the device is (``total_device_s``, ``torch.cuda.synchronize()``: this also waits
    for copies a save queued on a side stream); ``total_s`` is the one ``sync_mode`` names.
    """
    work = variant.work
    t_prepare = time.perf_counter()
    variant.prepare()
    prepare_s = time.perf_counter() - t_prepare
    for _ in range(warmup_steps):
        work.step()
    work.sync()
    hook = variant.before_update if variant.uses_before_update else None
    step_ends: list[float] = []
    collections: list[list[float]] = []  # [start s, seconds, generation] of each GC in the loop
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            collections.append([round(gc_started[0] - t0, 4),
                                round(time.perf_counter() - gc_started[0], 5),
                                info.get("generation", -1)])

    t0 = time.perf_counter()
    variant.loop_started = t0
    gc.callbacks.append(on_gc)
    try:
        for step in range(1, steps + 1):
            work.step(hook)
            if step % every == 0:
                variant.save(step)
            step_ends.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(on_gc)
    if work.device.type == "cuda":
        torch.cuda.current_stream(work.device).synchronize()
    total_stream = time.perf_counter() - t0
    work.sync()
    total_device = time.perf_counter() - t0
    total = total_device if sync_mode == "device" else total_stream
    t1 = time.perf_counter()
    variant.finish()
    work.sync()
    final_wait = time.perf_counter() - t1
    variant.after_finish()
    log(f"{label or variant.name}: {steps} steps in {total:.3f} s, then {final_wait:.3f} s "
        f"until the last save was durable")
    return {
        "total_s": total,
        "total_stream_s": total_stream,
        "total_device_s": total_device,
        "end_sync": sync_mode,
        "final_wait_s": final_wait,
        "prepare_s": prepare_s,
        "steps": steps,
        "every": every,
        "step_end_s": step_ends,
        "gc_in_loop": collections,
    }


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def restore_check(cp: Any, root: Path, reference: Workload,
                  build_fresh: Callable[[], Workload], options: dict[str, Any],
                  expected_step: int) -> dict[str, Any]:
    """Restore the newest checkpoint into a fresh model and optimizer (no optimizer state yet)
    after dropping the files from the page cache; time it, compare it, take one step with it.
    """
    dropped = drop_page_cache_tree(root)
    fresh = build_fresh()
    out: dict[str, Any] = {"files_dropped_from_page_cache": dropped,
                           "expected_step": expected_step,
                           # as in a restarted process: no pinned blocks cached by the saves
                           "released_cached_pinned_memory": release_cached_pinned_memory()}
    with cp.CheckpointPipeline(root, **options) as pipe:
        fresh.sync()
        t0 = time.perf_counter()
        result = pipe.restore_latest(fresh.state())
        fresh.sync()
        out["restore_s"] = time.perf_counter() - t0
    out["step"] = getattr(result, "step", None)
    out["bytes"] = getattr(result, "bytes", None)
    out["library_seconds"] = getattr(result, "seconds", None)
    ref_params = list(reference.model.parameters())
    new_params = list(fresh.model.parameters())
    out["params_equal"] = len(ref_params) == len(new_params) and all(
        _equal(a.detach(), b.detach()) for a, b in zip(ref_params, new_params))
    optim_equal = True
    compared = 0
    for a, b in zip(ref_params, new_params):
        ref_state = reference.optim.state.get(a, {})
        new_state = fresh.optim.state.get(b, {})
        if set(ref_state) != set(new_state):
            optim_equal = False
            continue
        for key, value in ref_state.items():
            if isinstance(value, torch.Tensor):
                compared += 1
                optim_equal = optim_equal and _equal(value.detach(), new_state[key].detach())
            else:
                optim_equal = optim_equal and value == new_state[key]
    out["optim_state_equal"] = optim_equal
    out["optim_tensors_compared"] = compared
    out["state_tensors"] = len(state_tensors(fresh))
    try:
        fresh.step()
        fresh.sync()
        out["step_after_restore_ok"] = True
    except Exception as exc:
        out["step_after_restore_ok"] = False
        out["step_after_restore_error"] = f"{type(exc).__name__}: {exc}"
    out["ok"] = bool(out["step"] == expected_step and out["params_equal"] and optim_equal
                     and compared > 0 and out["step_after_restore_ok"])
    del fresh
    return out
