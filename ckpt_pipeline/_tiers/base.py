"""The typed interfaces every tier implements (replicas, the persistent tier, next the memory
tier): a commit participant takes part in a save's vote and settles its outcome; a shard source
is one place a rank's committed shard can be read back from, in the order recovery and
``cp.load`` try them.
"""

from __future__ import annotations

__all__ = ()

# -- commit participants ---------------------------------------------------------------------

# -- shard sources ---------------------------------------------------------------------------
