"""The memory tier's files: a checkpoint root in shared memory, laid out as the disk root.

A rank's shard of a memory step is the buffer its save was copied into: the data region is the
mapped part of the buffer's file, the header goes after it, and the file is renamed from the
rank's slot directory into the step's directory (``seal_shard``); the manifest and the commit
record are the disk root's. Dropping a step (``drop_files``) removes its commit record first,
then gives the buffer its free name back. A crash leaves committed steps whole and buffers
being filled under their slot names, which the next open clears (``clear_slots``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from dataclasses import dataclass

import msgpack

from ..._format.filesets import FileSet
from ..._format.names import step_dir_name
from ..._format.publish import publish_file
from ..._format.shard import encode_preamble
from ..._format.steps import committed_steps, read_small
from ..._format.tidy import tidy_step_dir
from ...errors import CheckpointError, StorageError
from ...storage import Storage

__all__ = ("Topology", "clear_slots", "drop_files", "is_memory_root", "lock_name",
           "memory_ranks", "read_topology", "remove_rank_files", "seal_shard",
           "slot_dir", "try_lock", "usage_bytes", "write_topology")


def slot_dir(rank: int) -> str:
    """Where a rank's free and filling buffers live, relative to the memory root."""
    return os.path.join("slots", f"rank-{rank}")


def lock_name(rank: int) -> str:
    return f".lock-memory-rank-{rank}"


def try_lock(storage: Storage, rank: int) -> int | None:
    """Take ``rank``'s lock of the memory root (held while its pipeline is open: two jobs on
    one directory, or a ``clean`` of a running one, are refused); its descriptor, or None when
    another process holds it. Closing the descriptor releases it."""
    fd = os.open(os.path.join(storage.root, lock_name(rank)),
                 os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def is_memory_root(storage: Storage) -> bool:
    """Whether the directory is a memory tier's (it has buffers or topology records)."""
    names = {e.name for e in storage.list_dir("")}
    return "slots" in names or any(n.startswith("topology-rank-") for n in names)


def memory_ranks(storage: Storage) -> list[int]:
    """The ranks with files in a memory root (by their topology records and buffers)."""
    ranks = set()
    for entry in storage.list_dir(""):
        if entry.name.startswith("topology-rank-") and entry.name.endswith(".msgpack"):
            with contextlib.suppress(ValueError):
                ranks.add(int(entry.name[len("topology-rank-"):-len(".msgpack")]))
    with contextlib.suppress(StorageError):
        for entry in storage.list_dir("slots"):
            if entry.name.startswith("rank-"):
                with contextlib.suppress(ValueError):
                    ranks.add(int(entry.name[len("rank-"):]))
    return sorted(ranks)


def usage_bytes(storage: Storage) -> int:
    """Bytes of every file under a memory root (shards and buffers, all ranks)."""
    total = 0
    for top, _dirs, files in os.walk(storage.root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


def remove_rank_files(storage: Storage, rank: int) -> int:
    """Every memory file of ``rank`` (steps, buffers, topology, lock); the bytes they held.
    The caller holds the rank's lock. Worker thread."""
    before = usage_bytes(storage)
    for dir_name in committed_steps(storage, rank).values():
        drop_files(storage, dir_name, rank, None)
    clear_slots(storage, slot_dir(rank))
    for rel in (slot_dir(rank), "slots"):
        with contextlib.suppress(StorageError):
            storage.rmdir(rel)
    storage.unlink(f"topology-rank-{rank}.msgpack")
    storage.unlink(lock_name(rank))
    return max(0, before - usage_bytes(storage))


def seal_shard(storage: Storage, fd: int, slot_rel: str, step: int, rank: int,
               header: bytes, data_end: int) -> tuple[str, int, bytes]:
    """Finish the shard in buffer ``fd`` (data in place up to ``data_end``): header after the
    data, preamble first, file cut to the shard's size, renamed into the step's directory.
    Returns (its new name in the root, the shard's size, the preamble). Worker thread."""
    storage.pwrite(fd, memoryview(header), data_end)
    preamble = encode_preamble(data_end, header)
    storage.pwrite(fd, memoryview(preamble), 0)
    size = data_end + len(header)
    storage.truncate(fd, size)  # only the header's tail: the mapping ends at data_end
    dir_name = step_dir_name(step)
    storage.make_dir(dir_name)
    rel = os.path.join(dir_name, FileSet(rank).shard)
    storage.move(slot_rel, rel)
    return rel, size, preamble


def drop_files(storage: Storage, dir_name: str, rank: int, home: str | None) -> None:
    """Remove ``rank``'s files of a memory step, commit record first; its shard goes back to
    ``home`` (the free name of the live buffer it is) or, of an earlier run, is deleted.
    Worker thread."""
    files = FileSet(rank)
    storage.unlink(os.path.join(dir_name, files.commit))
    storage.unlink(os.path.join(dir_name, files.manifest))
    shard = os.path.join(dir_name, files.shard)
    if home is None:
        storage.unlink(shard)
    else:
        storage.move(shard, home)
    with contextlib.suppress(StorageError):
        tidy_step_dir(storage, dir_name)



def clear_slots(storage: Storage, slot_dir: str) -> list[str]:
    """Remove what a rank's slot directory holds (buffers free or being filled at a crash:
    never a committed step). Returns the names removed. Worker thread."""
    storage.make_dir("slots")
    storage.make_dir(slot_dir)
    removed = []
    for entry in storage.list_dir(slot_dir):
        if not entry.is_dir:
            storage.unlink(os.path.join(slot_dir, entry.name))
            removed.append(entry.name)
    return removed


@dataclass(frozen=True, slots=True)
class Topology:
    """Where a rank ran when it wrote its memory steps: a memory restore elsewhere is
    refused (the steps are another process's view of another placement)."""

    host: str
    boot_id: str
    world_size: int
    device: int | None

    @classmethod
    def here(cls, world_size: int, device: int | None) -> Topology:
        boot = ""
        with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id",
                                                encoding="ascii") as f:
            boot = f.read().strip()
        return cls(socket.gethostname(), boot, world_size, device)

    def differs(self, other: Topology) -> str | None:
        """What changed from ``other`` to this one, or None."""
        for name in ("host", "boot_id", "world_size", "device"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} was {theirs!r}, is {mine!r}"
        return None


def _topology_name(rank: int) -> str:
    return f"topology-rank-{rank}.msgpack"


def write_topology(storage: Storage, rank: int, topology: Topology) -> None:
    """Record (replacing) where this rank runs. Worker thread."""
    name = _topology_name(rank)
    data = msgpack.packb({"host": topology.host, "boot_id": topology.boot_id,
                          "world_size": topology.world_size, "device": topology.device})
    storage.unlink(name)
    publish_file(storage, "", name, data)


def read_topology(storage: Storage, rank: int) -> Topology | None:
    """Where this rank ran when it last opened the tier (None: not recorded, or unreadable).
    Worker thread."""
    try:
        raw = msgpack.unpackb(read_small(storage, _topology_name(rank)), raw=False)
        device = raw.get("device")
        return Topology(str(raw["host"]), str(raw["boot_id"]), int(raw["world_size"]),
                        None if device is None else int(device))
    except (CheckpointError, KeyError, TypeError, ValueError, msgpack.UnpackException):
        return None
