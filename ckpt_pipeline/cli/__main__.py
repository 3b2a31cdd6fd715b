"""``python -m ckpt_pipeline.cli``: the same command as the ``ckpt-pipeline`` console script."""

from __future__ import annotations

import sys

from . import main

__all__ = ()

if __name__ == "__main__":
    sys.exit(main())
