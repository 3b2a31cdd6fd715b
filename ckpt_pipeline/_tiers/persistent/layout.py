"""Names and the commit object of the persistent tier.

A step promoted to the persistent tier has the layout of a local root, one prefix per step:

    URL/step-0000000050/rank-00000.shard      the same bytes as the local files
    URL/step-0000000050/rank-00000.manifest
    URL/step-0000000050/rank-00000.commit     the rank's own commit record
    URL/step-0000000050/step.commit           written last, by rank 0: the step is complete

``step.commit`` (msgpack, never pickle) lists every object of the step with its size and the
xxh3 of each part, as rank 0 learnt them from every rank's report through the control plane.
A step prefix without it is an unfinished promotion and is never restored from. It also
names the step's lineage (``_format/timeline.py``); the run's rewinds are in
``URL/timeline.rewinds`` (``rewinds.py``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..._format.documents import FORMAT_VERSION, decode_message, encode_message
from ..._format.filesets import FileSet
from ..._format.names import step_dir_name
from ..._format.timeline import Lineage, decode_lineage, encode_lineage
from ...errors import CheckpointIntegrityError
from .objects import ObjectSum
from .objects import is_uint as _uint

__all__ = ("MAX_COMMIT_BYTES", "STEP_COMMIT", "ObjectSum", "StepRecord", "decode_step_record",
           "encode_step_record", "rank_keys")

STEP_COMMIT = "step.commit"
MAX_COMMIT_BYTES = 64 * 1024 * 1024
"""Bound on a step commit object read back (about 100 bytes per 64 MiB part and file)."""


def rank_keys(step: int, rank: int) -> dict[str, str]:
    """{file name: object key} of one rank's three files of ``step``."""
    files = FileSet(rank)
    prefix = step_dir_name(step)
    return {name: f"{prefix}/{name}" for name in (files.shard, files.manifest, files.commit)}


@dataclass(frozen=True, slots=True)
class StepRecord:
    """The content of ``step.commit``."""

    step: int
    save_id: str
    world_size: int
    objects: Mapping[str, ObjectSum]
    """{file name within the step prefix: its checksum}, every rank's three files."""
    created_unix: float = 0.0
    lineage: Lineage | None = None
    """The step's lineage, as its commit records name it (None: written before lineage)."""

    def rank_objects(self, rank: int) -> dict[str, ObjectSum]:
        files = FileSet(rank)
        return {name: self.objects[name] for name in (files.shard, files.manifest, files.commit)
                if name in self.objects}

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects.values())


def encode_step_record(record: StepRecord) -> bytes:
    return encode_message({
        "format": FORMAT_VERSION, "kind": "persisted", "step": record.step,
        "save_id": record.save_id, "world_size": record.world_size,
        "created_unix": record.created_unix or time.time(),
        "objects": {name: s.to_msg() for name, s in sorted(record.objects.items())},
        **({} if record.lineage is None else encode_lineage(record.lineage))})


def decode_step_record(raw: bytes, where: str) -> StepRecord:
    """Decode and check a step commit object; CheckpointIntegrityError names ``where``."""
    try:
        doc = decode_message(raw, f"the commit object {where}")
        step, save_id, world = doc.get("step"), doc.get("save_id"), doc.get("world_size")
        objects = doc.get("objects")
        if doc.get("kind") != "persisted" or type(doc.get("format")) is not int or not (
            isinstance(step, int) and _uint(step) and isinstance(save_id, str) and save_id
            and isinstance(world, int) and _uint(world) and world > 0
            and isinstance(objects, dict)
        ):
            raise CheckpointIntegrityError("fields are missing or of the wrong type")
        sums = {str(name): ObjectSum.from_msg(value) for name, value in objects.items()}
        if len(sums) != 3 * world:
            raise CheckpointIntegrityError(f"it lists {len(sums)} objects for {world} ranks")
        for rank in range(world):
            for name in (FileSet(rank).shard, FileSet(rank).manifest, FileSet(rank).commit):
                if name not in sums:
                    raise CheckpointIntegrityError(f"it does not list {name}")
        created = doc.get("created_unix")
        return StepRecord(step, save_id, world, sums,
                          float(created) if isinstance(created, (int, float)) else 0.0,
                          decode_lineage(doc, where))
    except CheckpointIntegrityError as exc:
        raise CheckpointIntegrityError(f"the commit object {where} is invalid: {exc.message}",
                                       path=where) from exc
