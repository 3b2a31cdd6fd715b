"""``import ckpt_pipeline`` (and every public module beside the integrations) never imports a
framework: the integrations are optional extras, and a training process that uses none of
them does not pay for one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "transformers",
              "accelerate", "torchtitan")

CODE = """
import json, sys
import ckpt_pipeline, ckpt_pipeline.loading, ckpt_pipeline.export, ckpt_pipeline.cli
import ckpt_pipeline.integrations
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))
"""


@pytest.mark.slow  # a child process importing the package: seconds of the fast suite
def test_importing_the_package_imports_no_framework() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         timeout=100, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "ckpt_pipeline" in loaded
    assert not loaded & set(FRAMEWORKS), sorted(loaded & set(FRAMEWORKS))
