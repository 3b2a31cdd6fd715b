"""The public face: every module declares __all__, and the package re-exports the contract."""

from __future__ import annotations

import importlib
import pkgutil

import ckpt_pipeline


def test_every_module_declares_a_tuple_all() -> None:
    for info in pkgutil.iter_modules(ckpt_pipeline.__path__):
        module = importlib.import_module(f"ckpt_pipeline.{info.name}")
        assert isinstance(getattr(module, "__all__", None), tuple), info.name
        for name in module.__all__:
            assert hasattr(module, name), f"{info.name}.{name}"


def test_package_exports_the_issue_contract() -> None:
    for name in ("TrainState", "CheckpointPipeline", "AsyncCheckpointPipeline", "SaveHandle",
                 "CommitInfo", "RestoreResult", "CheckpointError", "PipelineConfig"):
        assert name in ckpt_pipeline.__all__
    assert all(issubclass(getattr(ckpt_pipeline, n), ckpt_pipeline.CheckpointError)
               for n in ckpt_pipeline.__all__ if n.endswith("Error"))
