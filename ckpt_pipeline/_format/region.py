"""The arithmetic of a shard's data region: alignment and the xxh3-64 checksum chunks.

The region is checksummed in chunks cut at the multiples of ``chunk_bytes`` of the file offset
(so that each chunk is also an aligned write); the writer, the readers and the header's
``checks`` all cut it here.
"""

from __future__ import annotations

from typing import Any

import xxhash

from .limits import ALIGN

__all__ = ("align_down", "align_up", "checksum", "chunk_count", "region_chunks")


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def align_down(n: int, align: int = ALIGN) -> int:
    return n // align * align


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of a byte range (releases the GIL for large inputs)."""
    return int(xxhash.xxh3_64_intdigest(data))


def checksum_stream() -> Any:
    """``checksum`` of a byte range given in pieces: ``update`` with each piece in order
    (it lets go of the GIL), then ``intdigest()``."""
    return xxhash.xxh3_64()



def chunk_count(start: int, end: int, chunk_bytes: int) -> int:
    """How many ``region_chunks`` the region [start, end) has (without listing them)."""
    return -(-end // chunk_bytes) - start // chunk_bytes if end > start else 0


def region_chunks(start: int, end: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The checksum chunks of the data region [start, end): cut at the multiples of
    ``chunk_bytes`` of the file offset, so that each chunk is also an aligned write."""
    return [(max(start, k * chunk_bytes), min(end, (k + 1) * chunk_bytes))
            for k in range(start // chunk_bytes, -(-end // chunk_bytes))] if end > start else []
