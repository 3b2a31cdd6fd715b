"""Replicating each rank's committed shard to ranks on other nodes, and fetching it back.

``placement`` (which ranks hold whose copies), ``replication`` (the agreement at open and the
copy server), ``push`` (sending a copy while the local write runs), ``server`` and
``incoming`` (receiving and publishing one), ``fetch`` (restore from a holder), ``wire`` (the
framing). See docs/distributed.md, "Replication".
"""

__all__ = ()
