"""Retention beyond keep_last: KeepEvery, KeepBest by a recorded metric, several policies at once.

Every test runs the real pipeline on real files. The expected steps on disk are computed here
from the policies' definitions, independently of ``ckpt_pipeline.retention``.

Run as a script, this module is one rank of the two-rank test
(``test_every_rank_keeps_the_steps_rank_0s_metric_chooses``).
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence, Set
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.documents import CommitRecord, decode_commit, encode_commit
from ckpt_pipeline.errors import CheckpointIntegrityError, ConfigError
from ckpt_pipeline.retention import KeepBest, KeepEvery, KeepLast

# Ups and downs, with ties (2.0 at steps 4, 8 and 16; 0.5 at steps 13 and 18).
LOSSES = (5.0, 3.0, 4.0, 2.0, 6.0, 1.0, 7.0, 2.0, 8.0, 9.0,
          1.0, 3.0, 0.5, 4.0, 6.0, 2.0, 7.0, 0.5, 5.0, 3.0)


def _loss(step: int) -> float:
    return LOSSES[step - 1]


def _open(root: Path, retention: Any, **options: Any) -> cp.CheckpointPipeline:
    return cp.CheckpointPipeline(root, retention=retention, direct_io=False, **options)


def _save(pipe: cp.CheckpointPipeline, step: int, extra: Mapping[str, Any]) -> None:
    pipe.save(step, {"x": torch.full((4,), float(step))},
              cp.TrainState(step=step, extra=dict(extra))).result(30)
    pipe.wait(30)


def _on_disk(root: Path) -> set[int]:
    return {int(p.name[len("step-"):]) for p in root.glob("step-*")
            if (p / "rank-00000.commit").exists()}


def _best(values: Mapping[int, float], count: int, mode: str) -> set[int]:
    """The ``count`` best steps, the newer one first among equal values."""
    newest_first = sorted(values, reverse=True)  # a stable sort keeps this order on ties
    return set(sorted(newest_first, key=lambda s: values[s], reverse=mode == "max")[:count])


def _expected(saved: Sequence[int], values: Mapping[int, float], *, last: int, every: int,
              best: int, mode: str = "min") -> set[int]:
    """KeepLast(last) | KeepEvery(every) | KeepBest(best) over every step saved so far, and
    the newest step."""
    newest = sorted(saved)[-last:]
    return set(newest) | {s for s in saved if s % every == 0} | _best(
        {s: values[s] for s in saved if s in values}, best, mode) | {max(saved)}


POLICIES = [KeepLast(2), KeepEvery(5), KeepBest(3, metric="loss", mode="min")]


@pytest.mark.timeout(120)
def test_steps_on_disk_are_the_union_of_every_policys_steps(root: Path) -> None:
    values = {s: _loss(s) for s in range(1, 21)}
    with _open(root, POLICIES) as pipe:
        for step in range(1, 21):
            _save(pipe, step, {"loss": _loss(step), "tag": f"s{step}"})
            assert _on_disk(root) == _expected(range(1, step + 1), values, last=2, every=5,
                                               best=3), step
    # by hand: the last two, the multiples of 5, and the three lowest losses (0.5 at 18 and
    # 13, then 1.0 at 11 rather than at 6: the newer of equals wins)
    assert _on_disk(root) == {19, 20} | {5, 10, 15} | {18, 13, 11}


@pytest.mark.timeout(120)
def test_metrics_are_recorded_in_every_commit_record(root: Path) -> None:
    with _open(root, POLICIES) as pipe:
        _save(pipe, 7, {"loss": 7, "other": 1.5})  # an int is recorded as a float
    raw = (root / "step-0000000007" / "rank-00000.commit").read_bytes()
    record = decode_commit(raw, "x")
    assert record.metrics == {"loss": 7.0}
    assert type(record.metrics["loss"]) is float
    assert msgpack.unpackb(raw)["metrics"] == {"loss": 7.0}


@pytest.mark.timeout(120)
def test_a_restarted_pipeline_ranks_old_steps_by_their_commit_records(root: Path) -> None:
    values = {s: _loss(s) for s in range(1, 21)}
    with _open(root, POLICIES) as pipe:
        for step in range(1, 11):
            _save(pipe, step, {"loss": _loss(step)})
    assert _on_disk(root) == _expected(range(1, 11), values, last=2, every=5, best=3)
    with _open(root, list(POLICIES)) as pipe:  # a new pipeline: nothing carried in memory
        for step in range(11, 21):
            _save(pipe, step, {"loss": _loss(step)})
            assert _on_disk(root) == _expected(range(1, step + 1), values, last=2, every=5,
                                               best=3), step


@pytest.mark.timeout(120)
def test_keep_best_with_mode_max_keeps_the_highest_values(root: Path) -> None:
    accuracy = {s: -_loss(s) + 10 for s in range(1, 13)}
    with _open(root, [KeepLast(1), KeepBest(2, metric="acc", mode="max")]) as pipe:
        for step in range(1, 13):
            _save(pipe, step, {"acc": accuracy[step]})
            assert _on_disk(root) == _expected(range(1, step + 1), accuracy, last=1,
                                               every=10**9, best=2, mode="max"), step
    assert _on_disk(root) == {12, 11, 6}  # acc 9.0 at 11 and 6 (0.5 only at 13)


@pytest.mark.timeout(120)
def test_a_step_saved_without_the_metric_is_never_among_the_best(root: Path) -> None:
    with _open(root, KeepLast(10)) as pipe:
        for step in (1, 2, 3):  # nothing asks for "loss": the records carry no metric
            _save(pipe, step, {"loss": 0.0})
    with _open(root, KeepBest(1, metric="loss")) as pipe:
        _save(pipe, 4, {"loss": 100.0})
        assert _on_disk(root) == {4}
        _save(pipe, 5, {"loss": 1.0})
        assert _on_disk(root) == {5}
        _save(pipe, 6, {"loss": 50.0})  # the newest is never pruned, the best stays
        assert _on_disk(root) == {5, 6}


class KeepOdd:
    """A user's policy of the first version of the protocol: only ``keep(steps)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def keep(self, steps: Sequence[int]) -> Set[int]:
        self.calls.append(tuple(steps))
        return {s for s in steps if s % 2}


@pytest.mark.timeout(120)
def test_a_policy_with_only_keep_still_works_alone_and_combined(root: Path) -> None:
    odd = KeepOdd()
    with _open(root / "alone", odd) as pipe:
        for step in range(1, 7):
            _save(pipe, step, {})
    assert _on_disk(root / "alone") == {1, 3, 5, 6}
    assert odd.calls[-1] == (6, 5, 3, 1)  # every committed step still there, newest first

    combined = KeepOdd()
    with _open(root / "combined", [combined, KeepBest(1, metric="loss")]) as pipe:
        for step in range(1, 7):
            _save(pipe, step, {"loss": _loss(step)})
    assert _on_disk(root / "combined") == {1, 3, 5} | {6}  # step 6 is also the best (1.0)
    assert combined.calls[-1] == (6, 5, 4, 3, 1)  # 4 was the best (2.0) until step 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [{"acc": 0.9}, {"loss": "low"}, {"loss": True}],
                         ids=["missing", "str", "bool"])
def test_a_save_without_a_usable_metric_fails_and_keeps_the_previous_steps(
        root: Path, extra: dict[str, Any]) -> None:
    with _open(root, [KeepLast(2), KeepBest(1, metric="loss")]) as pipe:
        _save(pipe, 1, {"loss": 3.0})
        _save(pipe, 2, {"loss": 4.0})
        handle = pipe.save(3, {"x": torch.zeros(4)}, cp.TrainState(step=3, extra=extra))
        with pytest.raises(cp.StateError) as caught:
            handle.result(30)
        error = caught.value
        assert (error.step, error.rank) == (3, 0)
        assert "'loss'" in error.message and "step 3" in error.message
        if "acc" in extra:
            assert "['acc']" in error.message  # the keys that are there
        assert error.hint is not None and "previous checkpoint is intact" in error.hint
        assert _on_disk(root) == {1, 2}
        assert not (root / "step-0000000003").exists()
        state = {"x": torch.zeros(4)}
        restored = pipe.restore_latest(state)
        assert restored is not None and restored.step == 2
        assert torch.equal(state["x"], torch.full((4,), 2.0))
        with pytest.raises(cp.StateError) as again:  # the first failure since the last wait()
            pipe.wait(30)
        assert again.value is error
        _save(pipe, 4, {"loss": 1.0})  # the pipeline goes on
        assert _on_disk(root) == {2, 4}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_diverged_metric_still_saves_and_is_never_the_best(root: Path, value: float,
                                                            caplog: Any) -> None:
    """A NaN or infinite loss is what a diverging run reports: the step is saved (it may be
    what one wants to debug) without a value, so KeepBest never keeps it, and it is logged."""
    import logging

    caplog.set_level(logging.WARNING, logger="ckpt_pipeline")
    with _open(root, [KeepLast(1), KeepBest(1, metric="loss")]) as pipe:
        _save(pipe, 1, {"loss": 3.0})
        pipe.save(2, {"x": torch.zeros(4)}, cp.TrainState(step=2, extra={"loss": value})
                  ).result(30)
        pipe.wait(30)
        assert _on_disk(root) == {1, 2}  # 2 is the newest; 1 still the best
        record = decode_commit((root / "step-0000000002" / "rank-00000.commit").read_bytes(),
                               "test")
        assert record.metrics == {}
        _save(pipe, 3, {"loss": 5.0})
        assert _on_disk(root) == {1, 3}  # 2 was never the best, and is no longer the newest
    assert any("ckpt.retention.metric_not_finite" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("make", [
    lambda: KeepEvery(0), lambda: KeepEvery(-5), lambda: KeepEvery(True),
    lambda: KeepBest(0, metric="loss"), lambda: KeepBest(2, metric=""),
    lambda: KeepBest(2, metric=None),  # type: ignore[arg-type]
    lambda: KeepBest(2, metric="loss", mode="median"),  # type: ignore[arg-type]
    lambda: KeepLast(0),
], ids=["every-0", "every-negative", "every-bool", "best-0", "metric-empty", "metric-none",
        "mode-median", "last-0"])
def test_a_bad_policy_fails_at_construction(make: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        make()
    assert caught.value.hint


@pytest.mark.parametrize("retention", [[], [KeepLast(1), "keep everything"], 3],
                         ids=["empty", "not-a-policy", "int"])
def test_a_bad_retention_list_fails_at_construction(root: Path, retention: Any) -> None:
    with pytest.raises(ConfigError, match="retention"):
        _open(root, retention)


def test_the_config_combines_a_list_of_policies() -> None:
    config = cp.PipelineConfig(retention=[KeepLast(1), KeepEvery(10),
                                          KeepBest(1, metric="loss"),
                                          KeepBest(2, metric="acc", mode="max"),
                                          KeepBest(3, metric="loss")])
    assert isinstance(config.retention, tuple)
    assert config.retention_metrics == ("loss", "acc")
    assert cp.PipelineConfig(keep_last=2).retention_metrics == ()
    assert config.retention_policy.keep([30, 21, 20, 3]) == {30, 20}  # no metrics: none best


def _old_commit_record(**fields: Any) -> bytes:
    doc = {"format": 2, "kind": "commit", "step": 7, "rank": 0, "world_size": 1,
           "save_id": "run-7", "committed_unix": 1.5, **fields}
    return bytes(msgpack.packb(doc, use_bin_type=True))


def test_a_commit_record_without_metrics_decodes_to_none() -> None:
    record = decode_commit(_old_commit_record(), "x")
    assert record == CommitRecord(7, 0, 1, "run-7", 1.5)
    assert record.metrics == {}
    assert "metrics" not in msgpack.unpackb(encode_commit(record))  # written as before


def test_a_commit_record_with_metrics_round_trips() -> None:
    record = CommitRecord(7, 0, 1, "run-7", 1.5, {"loss": 0.25, "acc": 0.75})
    assert decode_commit(encode_commit(record), "x") == record


@pytest.mark.parametrize("metrics", [[1.0], {"loss": 1}, {"loss": True}, {"loss": "1.0"},
                                     {"loss": math.nan}, {"loss": -math.inf}, {"": 1.0},
                                     {1: 1.0}, None],
                         ids=["list", "int", "bool", "str", "nan", "inf", "empty-name",
                              "int-key", "none"])
def test_a_malformed_metrics_field_is_an_integrity_error(metrics: Any) -> None:
    with pytest.raises(CheckpointIntegrityError, match="metrics"):
        decode_commit(_old_commit_record(metrics=metrics), "x")


# ---------------------------------------------------------------- two ranks over gloo

RANK_LOSSES = {0: (5.0, 1.0, 4.0, 2.0, 6.0, 3.0, 0.5, 7.0),
               1: (0.1, 9.0, 0.2, 8.0, 0.3, 9.5, 9.9, 0.4)}
"""Each rank's loss at steps 1..8: rank 1's would choose other steps than rank 0's."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_rank_keeps_the_steps_rank_0s_metric_chooses(tmp_path: Path) -> None:
    from tests._support.children import spawn_child

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    procs = [spawn_child(Path(__file__), "--root", tmp_path / "ckpt", "--out",
                         tmp_path / f"rank-{rank}.json", env={**env, "RANK": str(rank)},
                         stdout=tmp_path / f"rank-{rank}.log", stderr=subprocess.STDOUT)
             for rank in range(2)]
    try:
        codes = [proc.wait(150) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = "\n".join((tmp_path / f"rank-{r}.log").read_text(errors="replace")[-3000:]
                     for r in range(2))
    assert codes == [0, 0], logs
    seen = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)}
    values = dict(enumerate(RANK_LOSSES[0], start=1))
    expected = [sorted(_expected(range(1, s + 1), values, last=1, every=10**9, best=2))
                for s in range(1, 9)]
    assert seen[0]["kept"] == expected
    assert seen[1]["kept"] == expected
    assert expected[-1] == [2, 7, 8]  # rank 1's own losses would keep 1 and 3
    # The copy each rank holds of the other's shard is kept and pruned the same way: its
    # commit record carries rank 0's metric too.
    assert seen[0]["copies"] == expected and seen[1]["copies"] == expected
    assert seen[0]["copy_metrics"] == seen[1]["copy_metrics"] == {
        str(s): {"loss": values[s]} for s in expected[-1]}


def _rank_main(argv: Iterable[str]) -> int:
    import datetime

    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(list(argv))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        rank = dist.get_rank()
        other = 1 - rank
        root = args.root / f"rank-{rank}"
        copy_commit = f"replica-{other:05d}-on-{rank:05d}.commit"
        kept: list[list[int]] = []
        copies: list[list[int]] = []
        with cp.CheckpointPipeline(root, retention=[KeepLast(1), KeepBest(2, metric="loss")],
                                   direct_io=False, coordination_timeout_s=30,
                                   replication=cp.ReplicationConfig(
                                       copies=1, node_name=f"node-{rank}")) as pipe:
            for step, loss in enumerate(RANK_LOSSES[rank], start=1):
                pipe.save(step, {"x": torch.full((4,), float(step + rank))},
                          cp.TrainState(step=step, extra={"loss": loss})).result(60)
                pipe.wait(60)
                kept.append(sorted(int(p.name[len("step-"):]) for p in root.glob("step-*")
                                   if (p / f"rank-{rank:05d}.commit").exists()))
                copies.append(sorted(int(p.name[len("step-"):]) for p in root.glob("step-*")
                                     if (p / copy_commit).exists()))
        copy_metrics = {
            str(int(p.name[len("step-"):])): dict(decode_commit(
                (p / copy_commit).read_bytes(), str(p)).metrics)
            for p in root.glob("step-*") if (p / copy_commit).exists()}
        args.out.write_text(json.dumps({"kept": kept, "copies": copies,
                                        "copy_metrics": copy_metrics}))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
