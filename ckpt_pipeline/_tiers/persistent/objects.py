"""What the persistent tier moves: objects under checked keys, in parts, each part hashed.

An object is moved in parts of ``part_bytes``; ``ObjectSum`` is its size and the xxh3-64 of
each part, hashed from the bytes actually sent or received, as the step commit object records
it. The local side of an upload is a ``LocalFile``: a committed file of the local root read
through its ``Storage``, so that the fault and power-loss storages see the tier's reads as
they see the save's writes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import xxhash

from ...errors import CheckpointIntegrityError
from ...storage import Storage

__all__ = ("KEY_PART", "LocalFile", "ObjectSum", "check_key", "is_uint", "part_ranges", "xxh")

KEY_PART = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True, slots=True)
class ObjectSum:
    """What an uploaded object must hold: its size and the xxh3-64 of each part."""

    size: int
    part_bytes: int
    parts: tuple[int, ...]

    @classmethod
    def of(cls, data: bytes, part_bytes: int) -> ObjectSum:
        """The checksum of ``data`` in parts of ``part_bytes``, as uploads compute it."""
        return cls(len(data), part_bytes,
                   tuple(xxh(data[s:e]) for s, e in part_ranges(len(data), part_bytes)))

    def to_msg(self) -> list[Any]:
        """``[size, part_bytes, [parts...]]``, for the step commit object (msgpack)."""
        return [self.size, self.part_bytes, list(self.parts)]

    @classmethod
    def from_msg(cls, value: Any) -> ObjectSum:
        """The inverse of ``to_msg``; anything else is a CheckpointIntegrityError."""
        if not (isinstance(value, (list, tuple)) and len(value) == 3 and is_uint(value[0])
                and is_uint(value[1]) and value[1] > 0 and isinstance(value[2], (list, tuple))
                and all(is_uint(p) for p in value[2])):
            raise CheckpointIntegrityError("an object checksum is malformed")
        size, part_bytes, parts = value
        if len(parts) != math.ceil(size / part_bytes):
            raise CheckpointIntegrityError(
                f"an object checksum lists {len(parts)} parts for {size} bytes in parts of "
                f"{part_bytes}")
        return cls(size, part_bytes, tuple(parts))


@dataclass(frozen=True, slots=True)
class LocalFile:
    """A committed file of the local root, open for an upload (``Remote.upload`` opens and
    closes it). Every read goes through ``storage``."""

    storage: Storage
    fd: int
    size: int
    path: str

    def read(self, start: int, end: int) -> bytearray:
        """Bytes [start, end) of the file (a fresh buffer, read into once: no copy of a part
        is made to turn it into ``bytes``); a short file is a StorageError."""
        buf = bytearray(end - start)
        if buf:
            self.storage.pread_into(self.fd, memoryview(buf), start)
        return buf

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``offset``."""
        self.storage.pread_into(self.fd, view, offset)

    def copy_to(self, out: int, start: int, end: int) -> bool:
        """Copy bytes [start, end) to the same offsets of ``out`` in the kernel; False where
        that is refused (see ``Storage.copy_out``)."""
        return self.storage.copy_out(self.fd, out, start, end)


def is_uint(value: Any) -> bool:
    """``value`` is an int of msgpack's unsigned 64-bit range (not a bool)."""
    return type(value) is int and 0 <= value < 2**64


def check_key(key: str) -> str:
    """``key`` itself, if it is a key of the tier: relative, '/'-separated, strict names."""
    parts = key.split("/")
    if not key or any(not KEY_PART.match(p) or p in (".", "..") for p in parts):
        raise ValueError(f"{key!r} is not a key of the persistent tier: relative, "
                         "'/'-separated names of [A-Za-z0-9._-]")
    return key


def part_ranges(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """The [start, end) of each part of an object of ``size`` bytes."""
    return [(start, min(size, start + part_bytes)) for start in range(0, size, part_bytes)]


def xxh(data: bytes | bytearray | memoryview) -> int:
    """The xxh3-64 of ``data``: the checksum of one part."""
    return int(xxhash.xxh3_64_intdigest(data))
