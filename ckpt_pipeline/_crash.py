"""Labelled crash points, for crash tests in child processes (see ``ckpt_pipeline.testing``)."""

from __future__ import annotations

import os
import signal

__all__ = ("CRASH_ENV", "CRASH_POINTS", "crash_point")

CRASH_ENV = "CKPT_PIPELINE_CRASH_AT"

CRASH_POINTS = (
    "save.requested",          # save() handed the job to the pipeline
    "serialize.data_written",  # tensor bytes in the temporary shard, not fsynced
    "write.shard_fsynced",     # shard fsynced under its temporary name
    "write.shard_published",   # shard under its final name, no manifest yet
    "write.done",              # shard and manifest durable, no vote yet
    "commit.voted",            # every rank agreed, no commit record yet
    "commit.record_published", # commit record durable, confirmation not exchanged
    "retain.commit_removed",   # an old step's commit record removed, its data not yet
    "scrub.removed",           # start-up removed one leftover, others may remain
)


def crash_point(label: str) -> None:
    """SIGKILL this process if ``CKPT_PIPELINE_CRASH_AT`` names ``label``."""
    if os.environ.get(CRASH_ENV) == label:
        os.kill(os.getpid(), signal.SIGKILL)
