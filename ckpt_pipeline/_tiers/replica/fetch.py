"""Fetching this rank's shard of a step from a rank that holds a copy (at restore).

The copy arrives into a temporary file of this rank's root, is checked as a received copy is
(every range against the shard's checksums), and is published under this rank's own names,
commit record last, so that the step is whole on this rank again and the normal read path
loads it. Worker thread.
"""

from __future__ import annotations

import contextlib
import time

from ..._format.documents import decode_commit
from ..._format.filesets import FileSet
from ..._format.names import step_dir_name
from ...errors import CheckpointError, CheckpointIntegrityError
from ...storage import Storage
from .incoming import Incoming
from .push import Peer
from .wire import (
    PIECE_BYTES,
    ProtocolError,
    connect,
    piece_buffer,
    recv_data,
    recv_message,
    send_message,
)

__all__ = ("fetch_shard",)


def fetch_shard(storage: Storage, peer: Peer, *, token: str, step: int, save_id: str,
                rank: int, world_size: int, timeout_s: float) -> tuple[int, float]:
    """Fetch, check and publish rank ``rank``'s shard of ``step`` (saved by ``world_size``
    ranks) from ``peer``'s copy, into ``storage`` under that rank's own names.

    Returns (bytes, seconds). Raises CheckpointError naming the peer when the copy cannot be
    had or does not check out; nothing is left on disk then.
    """
    started = time.perf_counter()
    incoming: Incoming | None = None
    try:
        with connect(peer.host, peer.port, timeout_s) as sock:
            send_message(sock, {"op": "fetch", "token": token, "step": step,
                                "save_id": save_id, "source": rank})
            meta = recv_message(sock, expect="meta")
            size, manifest, commit = meta.get("size"), meta.get("manifest"), meta.get("commit")
            if not (isinstance(size, int) and size > 0 and isinstance(manifest, bytes)
                    and isinstance(commit, bytes)):
                raise ProtocolError("the copy's description is malformed")
            record = decode_commit(commit, f"{peer.describe()}: commit record")
            if (record.step, record.rank, record.save_id, record.world_size) != (
                step, rank, save_id, world_size
            ):
                raise CheckpointIntegrityError("the copy's commit record is for another save")
            incoming = Incoming(storage, step_dir_name(step), FileSet(rank), size)
            with piece_buffer(min(PIECE_BYTES, size)) as piece:
                while (message := recv_message(sock))["op"] != "end":
                    if message["op"] != "data":
                        raise ProtocolError(f"unexpected {message['op']!r} in a fetch")
                    recv_data(sock, message, incoming.received, incoming.write, piece)
        incoming.verify(manifest, step=step, source=rank, save_id=save_id,
                        world_size=world_size)
        incoming.publish(manifest, commit)
    except (CheckpointError, OSError) as exc:
        if incoming is not None:
            with contextlib.suppress(Exception):
                incoming.discard()
        what = exc.message if isinstance(exc, CheckpointError) else (
            f"{type(exc).__name__}: {exc}")
        raise CheckpointIntegrityError(f"fetching the copy from {peer.describe()} failed: "
                                       f"{what}", step=step, rank=rank,
                                       path=str(storage.root)) from exc
    return size, time.perf_counter() - started
