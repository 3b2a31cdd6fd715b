"""The save path, in the order a save travels through it.

``job`` (the save as it travels), then the stages: ``copy`` (host buffer pool, device staging,
the snapshot copies; its first part runs in ``save()`` on the training thread), ``write_data``
(each tensor's bytes hashed and written to the temporary shard as its copy completes),
``seal`` (the shard header, fsync, publish; the manifest), ``commit`` (every rank's vote, then
the commit record), ``retain`` (prune older steps, report what could not be pruned).
"""

__all__ = ()
