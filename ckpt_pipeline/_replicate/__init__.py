"""Replicating each rank's committed shard to ranks on other nodes (in progress).

Built so far: ``placement`` (which ranks hold whose copies). The transfer, the commit rules and
the restore from peers come next (docs/design.md, "Replication").
"""

__all__ = ()
