"""S3 uploads: the parts of a multipart upload read and hashed ahead of obstore, and the
ETags the store must answer for what was sent.

A multipart upload is one call to obstore, which takes its parts from an iterator
(``read_ahead``) and sends up to ``threads`` of them at once. The pipeline's threads read and
hash each part (xxh3 for the commit object, MD5 for the ETag) at most ``AHEAD`` parts ahead of
the one obstore takes, so memory stays bounded: ``threads + AHEAD + 1`` parts. The local file
is read through its ``Storage`` (``LocalFile``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import itertools
import re
from collections.abc import Callable, Generator, Sequence
from typing import Any

from .objects import LocalFile, xxh
from .workers import DaemonPool

__all__ = ("AHEAD", "S3_MAX_PUT", "S3_MIN_PART", "PartSum", "etag_matches", "multipart_etag",
           "read_ahead", "single_etag")

S3_MIN_PART = 5 * 1024 * 1024
"""S3's smallest part of a multipart upload (but the last)."""
S3_MAX_PUT = 5 * 1024**3
"""S3's largest object stored by one PUT."""
AHEAD = 2
"""Parts read and hashed ahead of the one obstore takes."""
_MD5_ETAG = re.compile(r'"[0-9a-f]{32}(-[0-9]+)?"')

PartSum = tuple[int, bytes]
"""(xxh3-64, MD5) of one part as it was sent."""


def read_ahead(source: LocalFile, ranges: list[tuple[int, int]], pool: DaemonPool,
               gate: Callable[[], None] | None, sums: list[PartSum]
               ) -> Generator[bytearray, None, None]:
    """The bytes of each part in order, read and hashed in ``pool`` at most ``AHEAD`` ahead;
    each part's sums are appended to ``sums`` as it is handed on. ``gate``, when set, is
    called before each part is read (see ``Remote.gate``). Closing the iterator cancels the
    reads not started and waits for those running: the file is closed after the upload."""

    def read(start: int, end: int) -> tuple[bytearray, int, bytes]:
        if gate is not None:
            gate()
        data = source.read(start, end)
        return data, xxh(data), hashlib.md5(data, usedforsecurity=False).digest()

    pending: collections.deque[concurrent.futures.Future[Any]] = collections.deque()
    todo = iter(ranges)

    def more() -> None:
        for start, end in itertools.islice(todo, AHEAD + 1 - len(pending)):
            pending.append(pool.submit(read, start, end))

    try:
        more()
        while pending:
            data, part_xxh, part_md5 = pending.popleft().result()
            sums.append((part_xxh, part_md5))
            more()
            yield data
    finally:
        for future in pending:
            future.cancel()
        concurrent.futures.wait(pending)


def single_etag(md5: bytes) -> str:
    """The ETag S3 gives an object stored by one PUT."""
    return f'"{md5.hex()}"'


def multipart_etag(part_md5s: Sequence[bytes]) -> str:
    """The ETag S3 gives an object stored by a multipart upload."""
    whole = hashlib.md5(b"".join(part_md5s), usedforsecurity=False)
    return f'"{whole.hexdigest()}-{len(part_md5s)}"'


def etag_matches(got: Any, expected: str) -> bool:
    """Whether an ETag agrees with ``expected``; one that is no MD5 form (an encrypted
    object's, another store's) cannot be checked and passes."""
    if not isinstance(got, str) or _MD5_ETAG.fullmatch(got) is None:
        return True
    return got == expected
