"""Using one pipeline from several threads, a forked child, and a slow disk: never lost, never hung."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import GatedStorage


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_restore_while_another_thread_saves_loses_no_acknowledged_step(root: Path) -> None:
    acknowledged: list[int] = []
    refused: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    with cp.CheckpointPipeline(root, keep_last=100) as pipe:
        pipe.save(1, {"x": torch.full((1024,), 1.0)}).result(30)
        acknowledged.append(1)

        def keep_saving() -> None:
            step = 1
            try:
                while not stop.is_set() and step < 200:
                    step += 1
                    while True:  # a save refused during a restore is tried again
                        try:
                            handle = pipe.save(step, {"x": torch.full((1024,), float(step))})
                            break
                        except cp.PipelineBusyError:
                            refused.append(step)
                            if stop.is_set():
                                return
                            time.sleep(0.001)
                    handle.result(30)
                    acknowledged.append(step)
            except BaseException as exc:  # surfaced by the assertion below
                errors.append(exc)

        saver = threading.Thread(target=keep_saving)
        saver.start()
        live = {"x": torch.zeros(1024)}
        for _ in range(10):
            restored = pipe.restore_latest(live)
            assert restored is not None
            assert float(live["x"][0]) == float(restored.step)
            # the other thread gets at least one more save through before the next restore
            seen = len(acknowledged)
            deadline = time.monotonic() + 30
            while len(acknowledged) == seen and saver.is_alive() and time.monotonic() < deadline:
                time.sleep(0.001)
        stop.set()
        saver.join(60)
        assert not saver.is_alive()
    assert errors == []
    assert len(acknowledged) > 10
    assert not [p for p in root.iterdir() if ".rejected-" in p.name]
    committed = sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step-")
                       and (p / "rank-00000.commit").exists())
    assert committed == sorted(acknowledged)
    with cp.CheckpointPipeline(root, keep_last=100) as pipe:
        restored = pipe.restore_latest({"x": torch.zeros(1024)})
    assert restored is not None and restored.step == max(acknowledged)


@pytest.mark.timeout(60)
def test_save_during_a_restore_is_refused_with_a_clear_error(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"x": torch.ones(4)}).result(30)
        pipe._pipe.ledger.begin_restore()  # as from inside restore_latest() on another thread
        with pytest.raises(cp.PipelineBusyError, match="restore_latest"):
            pipe.save(2, {"x": torch.ones(4)})
        pipe._pipe.ledger.end_restore()
        pipe.save(2, {"x": torch.ones(4)}).result(30)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_using_the_pipeline_gets_a_clear_error_at_once(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(1, {"x": torch.ones(4)}).result(30)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: every use raises at once, nothing hangs
            code = 0
            try:
                for use in (pipe.latest_step, lambda: pipe.save(2, {"x": torch.ones(4)}),
                            pipe.wait, lambda: pipe.restore_latest({"x": torch.ones(4)}),
                            pipe.wait_snapshot, pipe.close):
                    try:
                        use()
                        code = 2
                    except cp.ForkedProcessError as exc:
                        if "fork" not in str(exc):
                            code = 3
                    except BaseException:
                        code = 4
            finally:
                os.write(write_end, bytes([code]))
                os._exit(0)
        os.close(write_end)
        answer = os.read(read_end, 1)
        os.close(read_end)
        os.waitpid(pid, 0)
        assert answer == bytes([0])
        # the parent's pipeline is untouched
        pipe.save(2, {"x": torch.ones(4)}).result(30)
        assert pipe.latest_step() == 2


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_that_does_not_use_the_pipeline_works(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        pid = os.fork()
        if pid == 0:  # a DataLoader worker: computes, never touches the pipeline
            os._exit(0 if float(torch.ones(3).sum()) == 3.0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        pipe.save(1, {"x": torch.ones(4)}).result(30)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_skip_policy_never_blocks_the_caller_on_a_stuck_disk(root: Path) -> None:
    storage = GatedStorage(root)  # every shard write waits until the gate opens
    results: list[cp.SaveHandle] = []
    with cp.CheckpointPipeline(root, storage=storage, when_busy="skip", queue_depth=1) as pipe:
        first = pipe.save(1, {"x": torch.ones(1024)})
        assert storage.entered.wait(30)

        def many_skips() -> None:
            for step in range(2, 15):
                results.append(pipe.save(step, {"x": torch.ones(1024)}))

        caller = threading.Thread(target=many_skips)
        caller.start()
        caller.join(20)  # the disk is stuck: a blocking save would still be in there
        stuck = caller.is_alive()
        storage.gate.set()
        caller.join(30)
        assert not stuck, "a skipped save() blocked while the disk was stuck"
        assert first.result(30).step == 1
        for handle in results:
            with pytest.raises(cp.PoolBusyError):
                handle.result(30)
        pipe.save(20, {"x": torch.ones(1024)}).result(30)
    time.sleep(0)  # nothing left running: the with block waited for every save
