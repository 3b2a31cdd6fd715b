"""How a command of ``ckpt-pipeline`` ends: its exit statuses, and the usage error.

Every command returns one of the exit statuses; ``UsageError`` is raised for a command line
that names something that is not there (a root, a step), and ``main`` turns it into status 2
with a message, as argparse does for a malformed command line.
"""

from __future__ import annotations

__all__ = ("EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "UsageError")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """The command line names something that is not there (exit status 2)."""
