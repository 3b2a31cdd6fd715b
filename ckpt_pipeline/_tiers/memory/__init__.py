"""The memory tier: a checkpoint root in shared memory whose shards are the host buffers the
snapshot copies into (``shm.py``), in the format of the disk root, so that the same reader
verifies them; which failures it survives is in docs/memory.md."""

__all__ = ()
