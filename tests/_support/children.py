"""Child processes: the scripts that tests run as other processes live in ``tests/children/``.

``spawn_child`` starts one (``run_child`` runs one to its end) with this Python, in the
checkout, with the checkout first on ``PYTHONPATH``; ``load_script`` imports one to share its
helpers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import IO, Any, NoReturn

from ckpt_pipeline.testing import CRASH_ENV

__all__ = ("CHILDREN", "REPO", "Stream", "child_env", "child_script", "exit_without_teardown",
           "free_port", "load_script", "run_child", "spawn_child")

REPO = Path(__file__).resolve().parents[2]
"""The checkout: children run in it, and import ``ckpt_pipeline`` from it."""
CHILDREN = REPO / "tests" / "children"
"""The scripts that tests run as child processes."""


def exit_without_teardown(code: int = 0) -> NoReturn:
    """End a child that used DTensors or ``fully_shard`` on gloo once every result is written:
    flush stdout and stderr and leave without the interpreter's teardown.

    Their collectives keep the gloo group alive past ``destroy_process_group`` (torch 2.13: its
    worker threads still run after it); torn down during the interpreter's exit, it at times
    aborts the process ("terminate called without an active exception", SIGABRT) after all the
    work is done. Seen twice on CI in the reshard tests' save children."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now, for a job's ``MASTER_PORT`` (another process may
    take it before the job binds it: a small race every launcher of test jobs has)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def child_script(name: str) -> Path:
    """The path of a child's script in ``tests/children/`` (``"crash_child.py"``)."""
    path = CHILDREN / name
    assert path.is_file(), f"no child script {path}"
    return path


def load_script(path: str | Path) -> ModuleType:
    """Import a child's script (a name in ``tests/children/``, or a path) to share its helpers."""
    path = child_script(path) if isinstance(path, str) else path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: this one's with the checkout first on ``PYTHONPATH``, no crash
    point armed (``CKPT_PIPELINE_CRASH_AT``) and Python's fault handler on (a child that
    aborts, as a C++ thread of torch's can at interpreter exit, prints every thread's stack:
    the log the failing test shows names the thread), then ``extra``."""
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    env["PYTHONFAULTHANDLER"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


Stream = int | IO[Any] | Path | None
"""Where a child's stdout or stderr goes: as for ``subprocess.Popen``, or a log file (Path)."""


def spawn_child(script: str | Path, *args: object, env: Mapping[str, str] | None = None,
                unbuffered: bool = False, stdin: int | IO[Any] | None = None,
                stdout: Stream = None, stderr: Stream = None,
                text: bool = False) -> subprocess.Popen[Any]:
    """Start a child: ``script`` (a name in ``tests/children/``, or a path) with ``args``, run
    by this Python (``-u`` when ``unbuffered``) in the checkout, its environment
    ``child_env(env)``. A ``Path`` for ``stdout`` or ``stderr`` is a log file, created or
    truncated, that the child writes."""
    path = child_script(script) if isinstance(script, str) else script
    command = [sys.executable, *(["-u"] if unbuffered else []), str(path), *map(str, args)]
    with contextlib.ExitStack() as logs:
        out, err = (logs.enter_context(s.open("wb")) if isinstance(s, Path) else s
                    for s in (stdout, stderr))
        return subprocess.Popen(command, stdin=stdin, stdout=out, stderr=err, cwd=REPO,
                                env=child_env(env), text=text)


def run_child(script: str | Path, *args: object, timeout: float,
              env: Mapping[str, str] | None = None, stdout: Stream = subprocess.PIPE,
              stderr: Stream = subprocess.PIPE,
              text: bool = False) -> subprocess.CompletedProcess[Any]:
    """Run a child (as ``spawn_child`` starts it) to its end, its output captured unless
    redirected; past ``timeout`` seconds it is killed and ``TimeoutExpired`` raised."""
    with spawn_child(script, *args, env=env, stdout=stdout, stderr=stderr, text=text) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
