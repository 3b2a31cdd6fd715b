"""Bad input fails before anything is written, with a CheckpointError naming step and path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp


def _nothing_written(root: Path) -> bool:
    return not root.exists() or not any(n.startswith("step-") for n in os.listdir(root))


def test_unsupported_leaf_names_its_path_and_writes_nothing(root: Path) -> None:
    state = {"model": {"w": torch.ones(2)}, "misc": {"fn": lambda x: x}}
    with cp.CheckpointPipeline(root) as pipe:
        with pytest.raises(cp.StateError) as info:
            pipe.save(1, state)
        assert info.value.step == 1
        assert info.value.path == "misc/fn"
        assert "function" in str(info.value)
    assert _nothing_written(root)


def test_unsupported_map_key_is_refused(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.StateError, match="key"):
        pipe.save(1, {"m": {(1, 2): torch.ones(1)}})
    assert _nothing_written(root)


def test_step_not_greater_than_last_saved_is_refused(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(5, {"x": torch.ones(1)}).result(30)
        with pytest.raises(cp.StepOrderError, match="not greater than the last saved step 5"):
            pipe.save(5, {"x": torch.ones(1)})
        with pytest.raises(cp.StepOrderError):
            pipe.save(3, {"x": torch.ones(1)})


def test_step_not_greater_than_committed_on_disk_is_refused_after_reopen(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(5, {"x": torch.ones(1)}).result(30)
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.StepOrderError):
        pipe.save(4, {"x": torch.ones(1)})


def test_negative_or_non_int_step_is_refused(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe:
        for bad in (-1, 1.5, True):
            with pytest.raises(cp.StepOrderError):
                pipe.save(bad, {"x": torch.ones(1)})  # type: ignore[arg-type]


def test_train_state_for_another_step_is_refused(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.StateError, match=r"train_state\.step is 3"):
        pipe.save(4, {"x": torch.ones(1)}, cp.TrainState(step=3))
    assert _nothing_written(root)


def test_unencodable_train_state_extra_is_refused(root: Path) -> None:
    ts = cp.TrainState(step=1, extra={"bad": object()})
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.StateError):
        pipe.save(1, {"x": torch.ones(1)}, ts)
    assert _nothing_written(root)


def test_symlinked_root_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(cp.UnsafeRootError, match="symlink"):
        cp.CheckpointPipeline(link).open()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_root_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 65534, 65534)
    with pytest.raises(cp.UnsafeRootError, match="owned by uid 65534"):
        cp.CheckpointPipeline(other).open()


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(cp.UnsafeRootError, match="not a directory"):
        cp.CheckpointPipeline(f).open()


def test_save_after_close_is_refused(root: Path) -> None:
    pipe = cp.CheckpointPipeline(root)
    with pipe:
        pass
    with pytest.raises(cp.PipelineClosedError):
        pipe.save(1, {"x": torch.ones(1)})


def test_invalid_configuration_fails_at_construction_with_a_hint(root: Path) -> None:
    with pytest.raises(cp.ConfigError, match="keep_last"):
        cp.CheckpointPipeline(root, keep_last=0)
    with pytest.raises(cp.ConfigError, match='"block" or "skip"'):
        cp.CheckpointPipeline(root, when_busy="drop")
    with pytest.raises(cp.ConfigError, match="unknown option"):
        cp.CheckpointPipeline(root, keep_lats=2)
    with pytest.raises(cp.ConfigError, match="multiple of 4096"):
        cp.PipelineConfig(chunk_bytes=1000)
    with pytest.raises(cp.ConfigError, match="copies=-1 is not a number of copies"):
        cp.ReplicationConfig(copies=-1)
    with pytest.raises(cp.ConfigError, match="node_name=''"):
        cp.ReplicationConfig(node_name="")
    with pytest.raises(cp.ConfigError, match="timeout_s=0"):
        cp.ReplicationConfig(timeout_s=0)


def test_copies_in_a_single_process_job_fail_at_open_naming_the_nodes(root: Path) -> None:
    pipe = cp.CheckpointPipeline(root, replication=cp.ReplicationConfig(copies=1,
                                                                        node_name="alone"))
    with pytest.raises(cp.ConfigError, match=r"copies=1 needs 2 nodes, this job runs on 1: "
                                             r"'alone' \(1 rank\(s\)\)"):
        pipe.open()
    # Nothing was written, and the root opens again without copies.
    assert not [p for p in root.iterdir() if p.name.startswith("step-")]
    with cp.CheckpointPipeline(root) as again:
        again.save(1, {"w": torch.ones(2)}).result(30)


def test_state_that_is_not_a_mapping_is_refused(root: Path) -> None:
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.StateError, match="mapping"):
        pipe.save(1, [torch.ones(1)])  # type: ignore[arg-type]


def test_sparse_tensor_is_refused_with_its_path(root: Path) -> None:
    sparse = torch.eye(3).to_sparse()
    with cp.CheckpointPipeline(root) as pipe, pytest.raises(cp.StateError) as info:
        pipe.save(1, {"emb": {"s": sparse}})
    assert info.value.path == "emb/s"
