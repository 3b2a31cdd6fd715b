"""The on-disk format (docs/format.md): ``codec`` (names, shard layout, msgpack documents
decoded with limits) and ``limits`` (the one table of limits that ``save()`` checks and the
readers enforce).
"""

__all__ = ()
