"""Each integration test starts with torch's deterministic mode off and no Accelerate state,
and puts the global flags back as they were: Lightning's ``deterministic=True`` (torch's
deterministic algorithms, cudnn's flags, ``CUBLAS_WORKSPACE_CONFIG``) and an ``Accelerator``'s
device (which a later ``Accelerator(cpu=...)`` would otherwise inherit) outlive a run in the
same process."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


def _reset_accelerate() -> None:
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        return
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _global_state_restored() -> Iterator[None]:
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    torch.use_deterministic_algorithms(False)
    _reset_accelerate()
    try:
        yield
    finally:
        _reset_accelerate()
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace
