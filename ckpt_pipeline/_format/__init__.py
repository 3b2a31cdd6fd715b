"""The on-disk package: everything about the files of a root (docs/format.md), used by the save
path, the restore path, every tier and the command line alike; it imports none of them.

``names`` (step directories, rank files, temporaries, moved-aside directories), ``documents``
(msgpack documents decoded with limits), ``shard`` (preamble, header, tensor records,
checksums), ``layout`` (the data region), ``scan`` (listing steps, commit records, file sets,
tidy and quarantine) and ``limits`` (the one table of limits).
"""

__all__ = ()
