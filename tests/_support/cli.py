"""The ``ckpt-pipeline`` command, run in this process."""

from __future__ import annotations

import contextlib
import io
import subprocess

__all__ = ("run_cli",)


def run_cli(*args: object) -> subprocess.CompletedProcess[str]:
    """Run the ``ckpt-pipeline`` command in this process (its ``main``), its output captured.

    ``tests/cli/test_cli.py::test_the_command_runs_as_its_own_process`` checks the real
    process once."""
    from ckpt_pipeline.cli import main as cli_main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
