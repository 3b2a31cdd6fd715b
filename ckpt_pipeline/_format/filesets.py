"""File sets: the three files of one rank's shard of a step, as a rank holds them.

A rank's own files are ``rank-S.*``; a copy it holds of rank ``s``'s shard (replication) is
``replica-s-on-h.*`` (``names.py``): the same bytes under other names. A set is taken off the
disk commit record first, so that it never looks complete while the rest goes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from .names import parse_rank_file, parse_replica_file, replica_name

__all__ = ("FileSet", "owned_sets", "rank_sets")




@dataclass(frozen=True, slots=True)
class FileSet:
    """The three files of one rank's shard of a step, as one rank holds them: its own
    (``rank-S.*``, ``holder`` None) or a copy held for rank ``source`` (``replica-S-on-H.*``).
    The files are the same bytes either way; only the names differ."""

    source: int
    holder: int | None = None

    def name(self, kind: str) -> str:
        if self.holder is None:
            return f"rank-{self.source:05d}.{kind}"
        return replica_name(self.source, self.holder, kind)

    @property
    def shard(self) -> str:
        return self.name("shard")

    @property
    def manifest(self) -> str:
        return self.name("manifest")

    @property
    def commit(self) -> str:
        return self.name("commit")

    def names(self) -> tuple[str, str, str]:
        """Commit record first: the order in which a set is taken off the disk."""
        return self.commit, self.manifest, self.shard


def owned_sets(names: Iterable[str], rank: int) -> list[FileSet]:
    """The file sets ``rank`` owns among ``names`` (its own and the copies it holds), each
    named by at least one of its files."""
    out: dict[tuple[int, int | None], FileSet] = {}
    for name in names:
        parsed = parse_rank_file(name)
        if parsed is not None and parsed[0] == rank:
            out.setdefault((rank, None), FileSet(rank))
            continue
        replica = parse_replica_file(name)
        if replica is not None and replica[1] == rank:
            out.setdefault((replica[0], rank), FileSet(replica[0], rank))
    return sorted(out.values(), key=lambda f: (f.holder is not None, f.source))


def rank_sets(names: Collection[str], rank: int) -> list[FileSet]:
    """The file sets of ``rank``'s shard in a step directory holding ``names``: its own
    first, then each committed copy another rank holds of it, by holder."""
    holders = sorted(parsed[1] for parsed in map(parse_replica_file, names)
                     if parsed is not None and parsed[0] == rank and parsed[2] == "commit")
    return [FileSet(rank), *(FileSet(rank, holder) for holder in holders)]
