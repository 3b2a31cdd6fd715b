"""The on-disk format (docs/format.md): ``names`` (step directories, rank files, temporaries,
moved-aside directories), ``documents`` (msgpack documents decoded with limits: state tree,
TrainState, manifest, commit record, control-plane messages), ``shard`` (preamble, header,
tensor records, checksums) and ``limits`` (the one table of limits that ``save()`` checks and
the readers enforce).
"""

__all__ = ()
