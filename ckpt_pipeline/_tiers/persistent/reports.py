"""What a rank tells the others about its promotions, in each save's commit vote and at close
(a ``RootedPart``): read back strictly on every rank, so that every rank decides alike. The
checksums of its finished uploads, which differ from rank to rank and which only rank 0 needs
(for the step's commit object), go to rank 0 alone (``root_msg``): every other rank reads which
steps each rank finished, so that ranks that finished the same steps send equal reports."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .objects import ObjectSum

__all__ = ("PersistReport", "UploadReport")


@dataclass(frozen=True, slots=True)
class UploadReport:
    """One finished upload of a rank: the checksum of each of its objects, and the stamp
    the store gave it (None where the store gives none), by object name."""

    sums: Mapping[str, ObjectSum]
    stamps: Mapping[str, str | None]

    def to_msg(self) -> Any:
        return {"sums": {n: s.to_msg() for n, s in self.sums.items()},
                "stamps": dict(self.stamps)}

    @classmethod
    def from_msg(cls, message: Any) -> UploadReport:
        """The inverse of ``to_msg``: a ValueError or CheckpointIntegrityError otherwise."""
        if not isinstance(message, dict) or set(message) != {"sums", "stamps"}:
            raise ValueError("an upload report is not a map of sums and stamps")
        sums, stamps = message["sums"], message["stamps"]
        if not (isinstance(sums, dict) and isinstance(stamps, dict)
                and all(isinstance(n, str) for n in [*sums, *stamps])
                and all(s is None or isinstance(s, str) for s in stamps.values())):
            raise ValueError("an upload report's sums or stamps are malformed")
        return cls({n: ObjectSum.from_msg(s) for n, s in sums.items()}, dict(stamps))


@dataclass(frozen=True, slots=True)
class PersistReport:
    """A rank's report: its unfinished promotions, the steps whose upload it finished and
    those that failed since its last report (each once, by step), whether it reaches the tier
    (rank 0: and holds the URL), and (rank 0) why the URL is not this open's. ``uploads``:
    this rank's finished uploads (``done``'s checksums), sent to rank 0 alone (``root_msg``;
    read back there by ``uploads_from_msg``); a report read back from a vote has none."""

    unfinished: int
    done: tuple[int, ...] = ()
    failed: Mapping[int, str] = field(default_factory=dict)
    reachable: bool = False
    lost: str | None = None
    uploads: Mapping[int, UploadReport] = field(default_factory=dict, compare=False)

    def to_msg(self) -> Any:
        return {"unfinished": self.unfinished, "done": sorted(self.done),
                "failed": {str(s): e for s, e in self.failed.items()},
                "reachable": self.reachable, "lost": self.lost}

    def root_msg(self) -> Any:
        """The checksums of the uploads this report finishes, for rank 0 alone."""
        if not self.uploads:
            return None
        return {str(s): u.to_msg() for s, u in self.uploads.items()}

    @staticmethod
    def uploads_from_msg(message: Any) -> dict[int, UploadReport]:
        """The inverse of ``root_msg`` (rank 0): a ValueError or CheckpointIntegrityError
        otherwise."""
        if not isinstance(message, dict):
            raise ValueError("a rank's finished uploads are not a map")
        return {_step(k): UploadReport.from_msg(v) for k, v in message.items()}

    @classmethod
    def from_msg(cls, message: Any) -> PersistReport:
        """The inverse of ``to_msg``: a ValueError or CheckpointIntegrityError otherwise."""
        if not isinstance(message, dict) or set(message) != {
                "unfinished", "done", "failed", "reachable", "lost"}:
            raise ValueError("not a persistent-tier report")
        unfinished, done, failed = message["unfinished"], message["done"], message["failed"]
        reachable, lost = message["reachable"], message["lost"]
        if not (type(unfinished) is int and unfinished >= 0 and isinstance(reachable, bool)
                and (lost is None or isinstance(lost, str))):
            raise ValueError("a persistent-tier report's fields are malformed")
        if not (isinstance(failed, dict) and all(isinstance(e, str) for e in failed.values())):
            raise ValueError("a persistent-tier report's failures are malformed")
        if not (isinstance(done, list) and all(type(s) is int and s >= 0 for s in done)):
            raise ValueError("a persistent-tier report's finished steps are malformed")
        return cls(unfinished, tuple(done), {_step(k): e for k, e in failed.items()},
                   reachable, lost)


def _step(key: Any) -> int:
    if not (isinstance(key, str) and key.isdecimal()):
        raise ValueError(f"a persistent-tier report names step {key!r}")
    return int(key)
