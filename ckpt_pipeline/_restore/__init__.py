"""The restore path: ``scan`` (scrub leftovers, list and cheaply validate steps, read a shard
back verifying every chunk), ``recovery`` (agree across ranks on the newest step every rank
holds, load it, fall back), ``apply`` (validate the live state, apply in place, roll back).
"""

__all__ = ()
