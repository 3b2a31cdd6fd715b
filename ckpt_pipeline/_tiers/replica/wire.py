"""The wire format between two ranks' copy connections: framed msgpack messages and data frames.

Every message is an 8-byte prefix (``CKRP`` and the payload's length, little-endian u32) and a
msgpack map with an ``op``. A data frame is the message ``{"op": "data", "offset", "length",
"xxh3"}`` followed by ``length`` raw bytes: the bytes of the shard file at ``offset``, with the
xxh3-64 of those bytes. The receiver reads a frame into its file a piece at a time
(``recv_into``, no per-frame buffer as large as the frame), hashing as it goes, and compares the
digest at the end. Blocking sockets, driven from worker threads; every call is bounded by the
socket's timeout.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import xxhash

from ...errors import CheckpointError

__all__ = ("PIECE_BYTES", "ProtocolError", "Received", "connect", "copy_frames", "piece_buffer",
           "recv_data", "recv_message", "send_data", "send_message")

_PREFIX = struct.Struct("<4sI")
_MAGIC = b"CKRP"
_MAX_MESSAGE = 4 * 1024 * 1024  # manifests and commit records are small; a header is data
PIECE_BYTES = 8 * 1024 * 1024
"""The largest piece of a frame held in memory at once by a receiver."""


class ProtocolError(CheckpointError):
    """The peer sent something that is not this protocol, or not what was expected now."""


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A connected TCP socket with the options every copy connection uses."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    tune(sock, timeout_s)
    return sock


def tune(sock: socket.socket, timeout_s: float) -> None:
    sock.settimeout(timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, 4 * 1024 * 1024)


@contextlib.contextmanager
def piece_buffer(size: int) -> Iterator[memoryview]:
    """A buffer for the pieces of frames, mapped for the connection and unmapped after it.

    Not a bytearray: the allocator would keep the freed memory of each connection's thread
    (its own arena), and a holder's memory would creep up with every copy it receives.
    """
    area = mmap.mmap(-1, max(size, 1))
    view = memoryview(area)
    try:
        yield view
    finally:
        # A slice may outlive the block (in the traceback of an error raised while it was in
        # use): the mapping then goes when the last reference does.
        with contextlib.suppress(BufferError):
            view.release()
            area.close()


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    payload = msgpack.packb(message, use_bin_type=True)
    sock.sendall(_PREFIX.pack(_MAGIC, len(payload)) + payload)


def recv_message(sock: socket.socket, expect: str | None = None) -> dict[str, Any]:
    """The next message; ``expect``: the op it must have (a peer's error message raises)."""
    prefix = _recv_exact(sock, _PREFIX.size)
    magic, length = _PREFIX.unpack(prefix)
    if magic != _MAGIC or length > _MAX_MESSAGE:
        raise ProtocolError(f"not a ckpt_pipeline copy message (prefix {prefix[:4]!r}, "
                            f"{length} bytes)")
    try:
        message = msgpack.unpackb(_recv_exact(sock, length), raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"a malformed message: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("a message without an op")
    if message["op"] == "error":
        raise ProtocolError(f"the peer refused: {message.get('error')}")
    if expect is not None and message["op"] != expect:
        raise ProtocolError(f"expected {expect!r}, the peer sent {message['op']!r}")
    return message


def send_data(sock: socket.socket, offset: int, data: memoryview, digest: int) -> None:
    """One data frame: the bytes at ``offset`` of the file, and their xxh3."""
    send_message(sock, {"op": "data", "offset": offset, "length": len(data), "xxh3": digest})
    sock.sendall(data)


class Received:
    """The frames a receiver took into its file: {offset: (end, digest)}, each checked.

    ``size``: the file's size, or until it is known (a push learns it at the end) a bound on
    it that every frame must stay within."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.frames: dict[int, tuple[int, int]] = {}
        self.bytes = 0

    def digest_of(self, start: int, end: int) -> int | None:
        """The digest of the frame that is exactly [start, end), or None."""
        frame = self.frames.get(start)
        return frame[1] if frame is not None and frame[0] == end else None

    def check_complete(self) -> None:
        """The frames cover [0, size) exactly once."""
        at = 0
        for start in sorted(self.frames):
            end = self.frames[start][0]
            if start != at:
                raise ProtocolError(f"bytes [{at}, {start}) of the file never arrived"
                                    if start > at else f"frames overlap at {start}")
            at = end
        if at != self.size:
            raise ProtocolError(f"bytes [{at}, {self.size}) of the file never arrived")


def recv_data(sock: socket.socket, message: dict[str, Any], received: Received,
              write: Callable[[memoryview, int], None], piece: memoryview) -> None:
    """Receive the bytes of the data frame ``message`` announced; write them at their offset
    with ``write(view, offset)``, a piece at a time, and check their xxh3."""
    offset, length, digest = message.get("offset"), message.get("length"), message.get("xxh3")
    if not (isinstance(offset, int) and isinstance(length, int) and isinstance(digest, int)):
        raise ProtocolError("a data frame without offset, length and xxh3")
    if offset < 0 or length <= 0 or offset + length > received.size:
        raise ProtocolError(f"a data frame [{offset}, {offset + length}) outside the "
                            f"{received.size}-byte file")
    if offset in received.frames:
        raise ProtocolError(f"a second data frame at offset {offset}")
    hasher = xxhash.xxh3_64()
    view = piece
    at = offset
    while at < offset + length:
        n = min(len(piece), offset + length - at)
        _recv_into(sock, view[:n])
        hasher.update(view[:n])
        write(view[:n], at)
        at += n
    if hasher.intdigest() != digest:
        raise ProtocolError(f"the bytes at [{offset}, {offset + length}) do not match the "
                            "xxh3 they were sent with (corrupted in transit)")
    received.frames[offset] = (offset + length, digest)
    received.bytes += length


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def copy_frames(checks: list[tuple[int, int, int]], size: int
                ) -> list[tuple[int, int, int | None]]:
    """The frames a fetch sends: each checksummed range as it is (with its checksum), and
    the bytes between them (preamble, padding, header) cut at most PIECE_BYTES long."""
    out: list[tuple[int, int, int | None]] = []
    at = 0
    for start, end, digest in sorted(checks):
        out.extend(_gaps(at, start))
        out.append((start, end, digest))
        at = end
    out.extend(_gaps(at, size))
    return out


def _gaps(start: int, end: int) -> list[tuple[int, int, int | None]]:
    return [(a, min(end, a + PIECE_BYTES), None) for a in range(start, end, PIECE_BYTES)]
