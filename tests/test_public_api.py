"""The public face: every module declares __all__, and the package re-exports the contract."""

from __future__ import annotations

import importlib
import pkgutil

import ckpt_pipeline


def test_every_module_declares_a_tuple_all() -> None:
    for info in pkgutil.walk_packages(ckpt_pipeline.__path__, "ckpt_pipeline."):
        module = importlib.import_module(info.name)
        assert isinstance(getattr(module, "__all__", None), tuple), info.name
        for name in module.__all__:
            assert hasattr(module, name), f"{info.name}.{name}"


def test_package_exports_the_issue_contract() -> None:
    for name in ("TrainState", "CheckpointPipeline", "AsyncCheckpointPipeline", "SaveHandle",
                 "CommitInfo", "RestoreResult", "CheckpointError", "PipelineConfig"):
        assert name in ckpt_pipeline.__all__
    assert all(issubclass(getattr(ckpt_pipeline, n), ckpt_pipeline.CheckpointError)
               for n in ckpt_pipeline.__all__ if n.endswith("Error"))


def test_every_public_name_is_exported_and_documented() -> None:
    """Both ways: what a public module defines is in its __all__, and what the __all__ of a
    public module names exists and has a docstring."""
    import inspect

    for info in pkgutil.walk_packages(ckpt_pipeline.__path__, "ckpt_pipeline."):
        module = importlib.import_module(info.name)
        public_module = not any(part.startswith("_") for part in info.name.split("."))
        exported = set(module.__all__)
        for name, obj in vars(module).items():
            if (public_module and not name.startswith("_")
                    and (inspect.isclass(obj) or inspect.isfunction(obj))
                    and obj.__module__ == module.__name__):
                assert name in exported, f"{info.name}.{name} is public but not in __all__"
        for name in exported if public_module else ():
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert inspect.getdoc(obj), f"{info.name}.{name} has no docstring"


def test_constructor_options_are_the_config_fields() -> None:
    import inspect
    from typing import get_type_hints

    from ckpt_pipeline.config import PipelineOptions

    keywords = {name for name, param in
                inspect.signature(ckpt_pipeline.PipelineConfig.__init__).parameters.items()
                if param.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(get_type_hints(PipelineOptions)) == keywords
    # Every field is a keyword too (dataclasses.replace passes them all); keep_last is the
    # one shorthand that is not a field (it is held as retention=KeepLast(n)).
    assert keywords - set(ckpt_pipeline.PipelineConfig.__dataclass_fields__) == {"keep_last"}


def test_a_misspelled_option_fails_at_construction(tmp_path: object) -> None:
    import pytest

    with pytest.raises(ckpt_pipeline.ConfigError, match="keep_lats"):
        ckpt_pipeline.CheckpointPipeline(str(tmp_path), keep_lats=2)  # type: ignore[call-arg]
