"""The restore path: ``read`` (a shard read back, verifying every chunk), ``recovery`` (agree
across ranks on the newest step every rank holds, load it, fall back), ``validate`` (check the
live state before touching it), ``apply`` (load in place) and ``rollback`` (the journal that
undoes an apply).
"""

__all__ = ()
