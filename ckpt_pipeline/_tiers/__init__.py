"""The tiers: the places a committed shard can live besides the rank's own root.

``replica`` (copies on ranks of other nodes) and ``persistent`` (a URL: S3, a shared
directory, fsspec) are siblings: neither imports the other, the lifecycle, the save path or the
restore path (the import contracts in ``pyproject.toml`` hold them to it). ``base`` holds the
typed interfaces both implement.
"""

__all__ = ()
