"""The on-disk package: everything about the files of a root (docs/format.md), used by the save
path, the restore path, every tier and the command line alike; it imports none of them.

``names`` (step directories, rank files, temporaries, moved-aside directories), ``documents``
(msgpack documents decoded with limits), ``shard`` (the preamble and header codec),
``header`` (what a header holds: storages, tensor records, and their checks), ``region``
(alignment, checksum chunks), ``shard_v1`` (reading format 1), ``layout`` (the data region),
``filesets`` (a rank's three files, its own or a copy's), ``steps`` (listing steps, reading
commit records), ``scan`` (the cheap validation of a file set), ``tidy`` (scrub, tidy,
quarantine), ``publish`` (publishing a file set and undoing it), ``markers`` (retention
markers), ``timeline`` (lineage and rewinds) and ``limits`` (the one table of limits).
"""

__all__ = ()
