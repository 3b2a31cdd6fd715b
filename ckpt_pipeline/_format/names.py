"""The names of the files and directories of a checkpoint root, and their parsers.

A step is a directory ``step-<step, 10 digits>``; each rank writes ``rank-<rank, 5 digits>``
``.shard``, ``.manifest`` and ``.commit`` in it, each first under a temporary name
(``TEMP_FILE``); recovery moves a rank's files of a step it will not use aside, to
``step-<step>.rejected-r<rank>-<token>``, or, for a step a rewind abandoned,
``step-<step>.rewound-<rewind point, 10 digits>-r<rank>-<token>``; each rank records a rewind
in ``rewind-<timeline, 10 digits>-r<rank>`` in the root. A copy of rank ``s``'s files held by rank ``h``
(replication) is ``replica-<s, 5 digits>-on-<h, 5 digits>`` with the same three suffixes, in
the same step directory of the holder's root; the holder owns it. docs/format.md is the reference. A parser accepts
only the canonical spelling of a name (the one the matching ``*_name`` writes), so that no two
names on disk stand for the same step or rank.
"""

from __future__ import annotations

import re

__all__ = (
    "TEMP_FILE",
    "TIER_REWINDS",
    "commit_name",
    "foreign_dir_name",
    "manifest_name",
    "parse_foreign_dir",
    "parse_rank_file",
    "parse_rejected_dir",
    "parse_replica_file",
    "parse_rewind_file",
    "parse_rewound_dir",
    "parse_step_dir",
    "rejected_dir_name",
    "replica_name",
    "rewind_file_name",
    "rewound_dir_name",
    "shard_name",
    "step_dir_name",
    "temp_owner",
)

TIER_REWINDS = "timeline.rewinds"
"""The persistent tier's record of the run's rewinds, at its top level (rank 0 writes it)."""
_STEP_DIR = re.compile(r"^step-([0-9]{10,})$")
_RANK_FILE = re.compile(r"^rank-([0-9]{5,})\.(shard|manifest|commit)$")
_REJECTED_DIR = re.compile(r"^(step-[0-9]{10,})\.rejected-r([0-9]{5,})-([0-9a-f]{8})$")
_FOREIGN_DIR = re.compile(r"^(step-[0-9]{10,})\.foreign-r([0-9]{5,})-([0-9a-f]{8})$")
_REWOUND_DIR = re.compile(r"^(step-[0-9]{10,})\.rewound-([0-9]{10,})-r([0-9]{5,})-([0-9a-f]{8})$")
_REWIND_FILE = re.compile(r"^rewind-([0-9]{10,})-r([0-9]{5,})$")
_REPLICA_FILE = re.compile(r"^replica-([0-9]{5,})-on-([0-9]{5,})\.(shard|manifest|commit)$")
TEMP_FILE = re.compile(r"^\.(?:rank-[0-9]{5,}|replica-[0-9]{5,}-on-[0-9]{5,})"
                       r"\.(shard|manifest|commit)\.tmp-[0-9a-f]{1,32}$")


def step_dir_name(step: int) -> str:
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a step directory name, or None; only the canonical spelling matches."""
    m = _STEP_DIR.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None


def rejected_dir_name(step: int, rank: int, token: str) -> str:
    """Where recovery moves a rank's files of a step it will not use (kept for inspection)."""
    return f"{step_dir_name(step)}.rejected-r{rank:05d}-{token}"


def parse_rejected_dir(name: str) -> tuple[int, int] | None:
    """(step, rank) of a directory that recovery moved aside, or None."""
    m = _REJECTED_DIR.match(name)
    if m is None:
        return None
    step = parse_step_dir(m.group(1))
    rank = int(m.group(2))
    if step is None or rejected_dir_name(step, rank, m.group(3)) != name:
        return None
    return step, rank


def foreign_dir_name(step: int, rank: int, token: str) -> str:
    """Where restore sets a rank's files of a step aside when they are of another save than
    the one the ranks agreed on (another run's root): kept, never loaded, never pruned."""
    return f"{step_dir_name(step)}.foreign-r{rank:05d}-{token}"


def parse_foreign_dir(name: str) -> tuple[int, int] | None:
    """(step, rank) of a directory of another save's files that restore set aside, or None."""
    m = _FOREIGN_DIR.match(name)
    if m is None:
        return None
    step = parse_step_dir(m.group(1))
    rank = int(m.group(2))
    if step is None or foreign_dir_name(step, rank, m.group(3)) != name:
        return None
    return step, rank


def rewound_dir_name(step: int, rewound_to: int, rank: int, token: str) -> str:
    """Where a rewind to step ``rewound_to`` moves a rank's files of a newer ``step``."""
    return f"{step_dir_name(step)}.rewound-{rewound_to:010d}-r{rank:05d}-{token}"


def parse_rewound_dir(name: str) -> tuple[int, int, int] | None:
    """(step, rewind point, rank) of a directory that a rewind moved aside, or None."""
    m = _REWOUND_DIR.match(name)
    if m is None:
        return None
    step = parse_step_dir(m.group(1))
    to, rank = int(m.group(2)), int(m.group(3))
    if step is None or rewound_dir_name(step, to, rank, m.group(4)) != name:
        return None
    return step, to, rank


def rewind_file_name(timeline: int, rank: int) -> str:
    """The record of the rewind that started ``timeline``, as ``rank`` wrote it."""
    return f"rewind-{timeline:010d}-r{rank:05d}"


def parse_rewind_file(name: str) -> tuple[int, int] | None:
    """(timeline, rank) of a rewind record's file name, or None."""
    m = _REWIND_FILE.match(name)
    if m is None:
        return None
    timeline, rank = int(m.group(1)), int(m.group(2))
    return (timeline, rank) if rewind_file_name(timeline, rank) == name else None


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.shard"


def manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.manifest"


def commit_name(rank: int) -> str:
    return f"rank-{rank:05d}.commit"


def parse_rank_file(name: str) -> tuple[int, str] | None:
    """(rank, kind) of a committed file name, or None."""
    m = _RANK_FILE.match(name)
    if m is None:
        return None
    rank = int(m.group(1))
    kind = m.group(2)
    return (rank, kind) if f"rank-{rank:05d}.{kind}" == name else None


def replica_name(source: int, holder: int, kind: str) -> str:
    """A copy of rank ``source``'s file of ``kind`` (shard, manifest, commit) held by
    ``holder``."""
    return f"replica-{source:05d}-on-{holder:05d}.{kind}"


def parse_replica_file(name: str) -> tuple[int, int, str] | None:
    """(source rank, holder rank, kind) of a committed copy's file name, or None."""
    m = _REPLICA_FILE.match(name)
    if m is None:
        return None
    source, holder, kind = int(m.group(1)), int(m.group(2)), m.group(3)
    return (source, holder, kind) if replica_name(source, holder, kind) == name else None


def temp_owner(name: str) -> int | None:
    """The rank that owns a temporary file (its rank, or the holder of a copy), or None."""
    if not TEMP_FILE.match(name):
        return None
    final = name[1:name.rindex(".tmp-")]
    parsed = parse_rank_file(final)
    if parsed is not None:
        return parsed[0]
    replica = parse_replica_file(final)
    return None if replica is None else replica[1]
