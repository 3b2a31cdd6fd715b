"""The pipeline's lifecycle and its two faces.

- ``lifecycle``: ``AsyncCheckpointPipeline``: opens (``opening``: root lock, scrub, run id),
  runs the save stages in one task group, waits, restores, closes.
- ``blocking``: ``CheckpointPipeline``: the same in a background thread (``loop_thread``) for
  synchronous training loops; SIGTERM and held signals.
- ``rootlock``: one job per root and rank.
"""

__all__ = ()
