"""The copy server in one process: real sockets on 127.0.0.1, real files in tmp_path.

A small state is saved once by a single-process pipeline; its shard is then pushed to a
``CopyServer`` the way a save pushes it (every checksum chunk with its xxh3, then header,
preamble and manifest), settled, dropped, fetched back and scrubbed. Every test checks what is
on the holder's disk (names and bytes), what the sender was told, and the events emitted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
import torch
import xxhash

import ckpt_pipeline as cp
from ckpt_pipeline import LocalStorage
from ckpt_pipeline._config_groups import ReplicationConfig
from ckpt_pipeline._format.documents import CommitRecord, decode_manifest, encode_commit
from ckpt_pipeline._format.filesets import FileSet
from ckpt_pipeline._format.limits import MAX_HEADER_BYTES
from ckpt_pipeline._format.names import replica_name
from ckpt_pipeline._format.scan import scan_files, scan_replicas
from ckpt_pipeline._format.shard import PREAMBLE_SIZE
from ckpt_pipeline._format.tidy import scrub
from ckpt_pipeline._tiers.replica.fetch import fetch_shard
from ckpt_pipeline._tiers.replica.push import Peer, Push, PushOutcome
from ckpt_pipeline._tiers.replica.ranged import PeerShard
from ckpt_pipeline._tiers.replica.replication import Replication
from ckpt_pipeline._tiers.replica.resend import Resend
from ckpt_pipeline._tiers.replica.server import CopyServer
from ckpt_pipeline._tiers.replica.vote import CopiesAcked, ReplicaVote
from ckpt_pipeline.coordination._agree import Opening
from ckpt_pipeline.errors import CheckpointIntegrityError

STEP = 10
STEP_DIR = f"step-{STEP:010d}"
TOKEN = "t"
VALUES = torch.arange(600_000, dtype=torch.float32)  # ~2.4 MB: three checksum chunks


@dataclass(frozen=True)
class Source:
    """Rank 0's saved shard of step 10, as bytes, with what its header says."""

    root: Path
    shard: bytes
    manifest: bytes
    commit: bytes
    save_id: str
    checks: list[tuple[int, int, int]]
    header_offset: int

    @property
    def header(self) -> bytes:
        return self.shard[self.header_offset:]

    @property
    def preamble(self) -> bytes:
        return self.shard[:PREAMBLE_SIZE]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    root = tmp_path_factory.mktemp("source") / "ckpt"
    with cp.CheckpointPipeline(root) as pipe:
        pipe.save(STEP, {"w": VALUES.clone()}, cp.TrainState(step=STEP)).result(30)
    status = scan_files(LocalStorage(root), FileSet(0), STEP, STEP_DIR)
    assert status.valid and status.header is not None, status.reason
    assert status.world_size == 1 and status.save_id is not None
    step_dir = root / STEP_DIR
    manifest = (step_dir / "rank-00000.manifest").read_bytes()
    assert decode_manifest(manifest, "m").save_id == status.save_id
    checks = status.header.checks()
    assert len(checks) >= 3  # several chunks, so that one can go missing or be corrupted
    assert checks[0][0] == PREAMBLE_SIZE and checks[-1][1] == status.header.header_offset
    return Source(root, (step_dir / "rank-00000.shard").read_bytes(), manifest,
                  (step_dir / "rank-00000.commit").read_bytes(), status.save_id, checks,
                  status.header.header_offset)


class RecordingStorage(LocalStorage):
    """Local storage that remembers the order of the files it removes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.unlinked: list[str] = []

    def unlink(self, rel: str) -> None:
        self.unlinked.append(os.path.basename(rel))
        super().unlink(rel)


@dataclass
class Holder:
    server: CopyServer
    storage: RecordingStorage
    root: Path
    events: list[cp.Event]

    @property
    def peer(self) -> Peer:
        return Peer(1, "nodeB", *self.server.address)

    def files(self) -> list[str]:
        """Every file under the holder's root (relative paths), temporaries included."""
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*")
                      if p.is_file())

    def copy(self, kind: str) -> Path:
        return self.root / STEP_DIR / replica_name(0, 1, kind)

    def stored(self) -> list[cp.ReplicaStored]:
        return [e for e in self.events if isinstance(e, cp.ReplicaStored)]


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    root = tmp_path / "holder"
    root.mkdir()
    storage = RecordingStorage(root)
    events: list[cp.Event] = []
    server = CopyServer(storage, 1, bind_host="127.0.0.1", advertise_host="127.0.0.1",
                        timeout_s=5, emit=events.append)
    server.token = TOKEN
    server.sources = frozenset({0})
    server.world_size = 1
    try:
        yield Holder(server, storage, root, events)
    finally:
        server.close()


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


def push(src: Source, holder: Holder, *, token: str = TOKEN, skip: int | None = None,
         transit: int | None = None, at_source: int | None = None,
         only_open: bool = False, finish: bool = True,
         before_collect: Callable[[], None] | None = None) -> PushOutcome:
    """Push rank 0's shard to the holder as a save does and collect the acknowledgement.

    ``skip``: the index of a chunk not sent; ``transit``: a chunk whose bytes are changed
    but sent with their original xxh3; ``at_source``: a chunk whose bytes are changed and
    sent with the xxh3 of the changed bytes; ``only_open``: announce the save, send nothing,
    wait for the answer (a refusal arrives then, whatever it is, without a race with the
    data in flight); ``finish``: send header, preamble and manifest."""
    p = Push([holder.peer], token=token, step=STEP, save_id=src.save_id, rank=0, timeout_s=5)
    send(src, p, skip=skip, transit=transit, at_source=at_source, only_open=only_open,
         finish=finish)
    if before_collect is not None:
        before_collect()
    return p.collect()


def send(src: Source, p: Push, *, skip: int | None = None, transit: int | None = None,
         at_source: int | None = None, only_open: bool = False, finish: bool = True) -> None:
    """Send rank 0's shard through ``p`` as a save does (``push`` says what the options do)."""
    p.open(src.header_offset + MAX_HEADER_BYTES)
    if only_open:
        return
    for k, (start, end, digest) in enumerate(src.checks):
        if k == skip:
            continue
        data = src.shard[start:end]
        if k in (transit, at_source):
            data = _flip(data, (end - start) // 2)
            if k == at_source:
                digest = xxhash.xxh3_64_intdigest(data)
        p.send(start, memoryview(data), digest)
    if finish:
        p.finish(src.header, src.header_offset, src.preamble, src.manifest)


def settle(src: Source, holder: Holder, commit: list[int]) -> dict[int, str]:
    return holder.server.receptions.settle(STEP, src.save_id, commit, lambda _s: src.commit)


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still not {what} after {seconds} s")
        time.sleep(0.01)


def acked_and_committed(src: Source, holder: Holder) -> None:
    outcome = push(src, holder)
    assert outcome.acked == (1,), outcome.errors
    assert settle(src, holder, [0]) == {}


COPY_FILES = [f"{STEP_DIR}/{replica_name(0, 1, k)}" for k in ("commit", "manifest", "shard")]


# ---------------------------------------------------------------------------- pushing


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [TOKEN, "another job's token"])
def test_the_commit_vote_part_of_a_rank_whose_copies_all_arrived_is_the_same_on_every_rank(
        source: Source, holder: Holder, token: str) -> None:
    """Rank 0 of two ranks on two nodes, its copy placed on rank 1 (the holder), pushed and
    collected by replication's commit participant as a save does. Every copy acknowledged:
    the part says "all the placed holders" (``True``), not the rank's own list, so that every
    rank sends the same bytes and a commit vote stays one run (``docs/scale.md``); read back
    against the placement it names rank 1. A holder that refused (another job's token): the
    rank's own list, empty, with the holder's reason."""
    replication = Replication(LocalStorage(source.root), ReplicationConfig(copies=1),
                              lambda _e: None, rank=0, world_size=2)
    address = holder.server.address
    replication.start(Opening("run", token, ("nodeA", "nodeB"), (address, address)))
    assert replication.placement is not None and replication.placement.holders == ((1,), (0,))
    vote = ReplicaVote(replication, replication.push_for(STEP, source.save_id), step=STEP,
                       save_id=source.save_id, rank=0, limiter=anyio.CapacityLimiter(1))
    assert vote.push is not None
    send(source, vote.push)
    part = anyio.run(vote.contribute, False)
    assert part is not None
    if token == TOKEN:
        assert part == CopiesAcked(None) and part.to_msg() == {"acked": True, "errors": {}}
        assert part.acked_of(replication.placement.holders[0]) == (1,)
        assert settle(source, holder, [0]) == {}
    else:
        assert part.acked == () and list(part.errors) == [1], part
        assert part.acked_of(replication.placement.holders[0]) == ()
    assert CopiesAcked.from_msg(part.to_msg()) == part


@pytest.mark.timeout(60)
def test_acknowledged_copy_is_committed_when_settled(source: Source, holder: Holder) -> None:
    outcome = push(source, holder)
    assert outcome.acked == (1,) and outcome.errors == {}
    assert outcome.bytes[1] == len(source.shard)
    # acknowledged: shard and manifest durable, no commit record until the step commits
    assert holder.files() == COPY_FILES[1:]
    assert holder.copy("shard").read_bytes() == source.shard
    assert holder.copy("manifest").read_bytes() == source.manifest
    assert scan_replicas(holder.storage, 1)[0].valid is False
    [event] = holder.stored()
    assert (event.step, event.rank, event.source, event.save_id) == (STEP, 1, 0, source.save_id)
    assert event.bytes == len(source.shard) and event.path == str(holder.copy("shard"))

    assert settle(source, holder, [0]) == {}
    assert holder.files() == COPY_FILES
    assert holder.copy("shard").read_bytes() == source.shard
    assert holder.copy("commit").read_bytes() == source.commit
    [status] = scan_replicas(holder.storage, 1)
    assert status.valid, status.reason
    assert (status.source, status.save_id, status.shard_size) == (
        0, source.save_id, len(source.shard))
    holder.server.close()  # a committed copy outlives the server
    assert holder.files() == COPY_FILES


@pytest.mark.timeout(60)
def test_copy_settled_without_its_source_is_removed(source: Source, holder: Holder) -> None:
    assert push(source, holder).acked == (1,)
    assert settle(source, holder, []) == {}
    assert holder.files() == []
    assert not (holder.root / STEP_DIR).exists()  # the emptied step directory is tidied


@pytest.mark.timeout(60)
def test_settle_reports_a_source_whose_copy_never_arrived(source: Source,
                                                          holder: Holder) -> None:
    assert settle(source, holder, [0]) == {0: "rank 1 holds no verified copy"}
    assert holder.files() == []


@pytest.mark.timeout(60)
def test_uncommitted_copy_is_removed_when_the_server_closes(source: Source,
                                                            holder: Holder) -> None:
    assert push(source, holder).acked == (1,)
    holder.server.close()
    assert holder.files() == []


@pytest.mark.timeout(60)
def test_chunk_corrupted_in_transit_is_refused(source: Source, holder: Holder) -> None:
    # the last chunk, and nothing sent after it until the holder answered: the refusal is
    # read before any later frame could turn the holder's close into a reset
    last = len(source.checks) - 1
    outcome = push(source, holder, transit=last, finish=False,
                   before_collect=lambda: wait_for(lambda: holder.files() == [], "removed"))
    assert outcome.acked == ()
    assert "xxh3" in outcome.errors[1] and "transit" in outcome.errors[1], outcome.errors
    assert "rank 1 on nodeB" in outcome.errors[1]
    start, end, _ = source.checks[last]
    assert f"[{start}, {end})" in outcome.errors[1]
    assert holder.files() == [] and holder.stored() == []


@pytest.mark.timeout(60)
def test_chunk_corrupted_in_transit_mid_stream_leaves_nothing(source: Source,
                                                              holder: Holder) -> None:
    """As a save sends it: the corrupt chunk first, the others right behind it (the reason
    may reach the sender or be lost to a reset; the copy is refused and removed either way)."""
    outcome = push(source, holder, transit=0)
    assert outcome.acked == () and 1 in outcome.errors
    wait_for(lambda: holder.files() == [], "removed")
    assert holder.stored() == []


@pytest.mark.timeout(60)
def test_chunk_corrupt_at_its_source_is_refused_by_verify(source: Source,
                                                          holder: Holder) -> None:
    outcome = push(source, holder, at_source=1)
    assert outcome.acked == ()
    start, end, _ = source.checks[1]
    assert f"bytes [{start}, {end}) of the copy do not match the shard's checksum" in (
        outcome.errors[1]), outcome.errors
    assert holder.files() == [] and holder.stored() == []
    assert settle(source, holder, [0]) == {0: "rank 1 holds no verified copy"}


@pytest.mark.timeout(60)
def test_missing_chunk_is_refused(source: Source, holder: Holder) -> None:
    outcome = push(source, holder, skip=1)
    assert outcome.acked == ()
    start, end, _ = source.checks[1]
    assert f"bytes [{start}, {end}) of the file never arrived" in outcome.errors[1], (
        outcome.errors)
    assert holder.files() == [] and holder.stored() == []


@pytest.mark.timeout(60)
def test_wrong_token_is_refused(source: Source, holder: Holder) -> None:
    outcome = push(source, holder, token="not-this-job", only_open=True)
    assert outcome.acked == ()
    assert "wrong token" in outcome.errors[1], outcome.errors
    full = push(source, holder, token="not-this-job")  # with the data behind the hello
    assert full.acked == () and 1 in full.errors
    assert holder.files() == [] and not (holder.root / STEP_DIR).exists()


@pytest.mark.timeout(60)
def test_source_not_held_here_is_refused(source: Source, holder: Holder) -> None:
    holder.server.sources = frozenset({2})
    outcome = push(source, holder, only_open=True)
    assert outcome.acked == ()
    assert "rank 1 does not hold copies of rank 0" in outcome.errors[1], outcome.errors
    assert push(source, holder).acked == ()
    assert holder.files() == [] and not (holder.root / STEP_DIR).exists()


@pytest.mark.timeout(60)
def test_copy_arriving_after_its_step_was_settled_is_refused(source: Source,
                                                             holder: Holder) -> None:
    assert settle(source, holder, []) == {}
    outcome = push(source, holder, only_open=True)
    assert outcome.acked == ()
    assert "too late" in outcome.errors[1], outcome.errors
    assert push(source, holder).acked == ()
    holder.server.receptions.forget(STEP, source.save_id)  # forgetting is not forgiving
    assert push(source, holder).acked == ()
    assert holder.files() == [] and holder.stored() == []


@pytest.mark.timeout(60)
def test_sender_dying_mid_transfer_leaves_nothing(source: Source, holder: Holder) -> None:
    p = Push([holder.peer], token=TOKEN, step=STEP, save_id=source.save_id, rank=0,
             timeout_s=5)
    p.open(source.header_offset + MAX_HEADER_BYTES)
    for start, end, digest in source.checks[:2]:
        p.send(start, memoryview(source.shard[start:end]), digest)
    wait_for(lambda: any(".tmp-" in f for f in holder.files()), "receiving")
    p.abort("the save failed")
    assert p.collect().errors[1].endswith("the save failed")
    wait_for(lambda: holder.files() == [], "removed")
    assert holder.stored() == []
    # the reception is over, not stuck: the same save can be pushed again
    assert push(source, holder).acked == (1,)
    assert holder.copy("shard").read_bytes() == source.shard


@pytest.mark.timeout(60)
def test_sender_stalling_mid_transfer_times_out_and_leaves_nothing(source: Source,
                                                                   holder: Holder) -> None:
    holder.server.timeout_s = 0.3  # taken by each connection as it is accepted
    p = Push([holder.peer], token=TOKEN, step=STEP, save_id=source.save_id, rank=0,
             timeout_s=5)
    p.open(source.header_offset + MAX_HEADER_BYTES)
    start, end, digest = source.checks[0]
    p.send(start, memoryview(source.shard[start:end]), digest)
    wait_for(lambda: any(".tmp-" in f for f in holder.files()), "receiving")
    wait_for(lambda: holder.files() == [], "removed")  # the holder gave up on its own
    outcome = p.collect()
    assert outcome.acked == () and "timed out" in outcome.errors[1], outcome.errors
    assert holder.stored() == []


@pytest.mark.timeout(60)
def test_copy_of_a_step_settled_while_it_arrives_is_refused(source: Source,
                                                            holder: Holder) -> None:
    p = Push([holder.peer], token=TOKEN, step=STEP, save_id=source.save_id, rank=0,
             timeout_s=5)
    p.open(source.header_offset + MAX_HEADER_BYTES)
    start, end, digest = source.checks[0]
    p.send(start, memoryview(source.shard[start:end]), digest)
    wait_for(lambda: any(".tmp-" in f for f in holder.files()), "receiving")
    # the step's vote is in before the copy is: it is not committed here, and not kept
    assert settle(source, holder, [0]) == {0: "rank 1 holds no verified copy"}
    for start, end, digest in source.checks[1:]:
        p.send(start, memoryview(source.shard[start:end]), digest)
    p.finish(source.header, source.header_offset, source.preamble, source.manifest)
    outcome = p.collect()
    assert outcome.acked == ()
    assert "step 10 was settled while its copy arrived" in outcome.errors[1], outcome.errors
    assert holder.files() == [] and holder.stored() == []


@pytest.mark.timeout(60)
def test_drop_after_commit_removes_the_copy_commit_record_first(source: Source,
                                                               holder: Holder) -> None:
    acked_and_committed(source, holder)
    assert holder.files() == COPY_FILES
    holder.storage.unlinked.clear()
    holder.server.receptions.drop(STEP, source.save_id)
    assert holder.files() == [] and not (holder.root / STEP_DIR).exists()
    assert holder.storage.unlinked[0] == replica_name(0, 1, "commit")
    assert sorted(holder.storage.unlinked) == sorted(replica_name(0, 1, k)
                                                     for k in ("commit", "manifest", "shard"))


# ---------------------------------------------------------------------------- fetching


@pytest.mark.timeout(60)
def test_fetch_restores_the_shard_exactly(source: Source, holder: Holder,
                                          tmp_path: Path) -> None:
    acked_and_committed(source, holder)
    new_root = tmp_path / "new"
    new_root.mkdir()  # a pipeline's root exists before it fetches
    size, _seconds = fetch_shard(LocalStorage(new_root), holder.peer, token=TOKEN, step=STEP,
                                 save_id=source.save_id, rank=0, world_size=1, timeout_s=5)
    assert size == len(source.shard)
    step_dir = new_root / STEP_DIR
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "rank-00000.commit", "rank-00000.manifest", "rank-00000.shard"]
    for kind in ("shard", "manifest", "commit"):
        assert (step_dir / f"rank-00000.{kind}").read_bytes() == (
            source.root / STEP_DIR / f"rank-00000.{kind}").read_bytes(), kind
    assert holder.files() == COPY_FILES  # the holder keeps its copy

    state = {"w": torch.zeros(600_000)}
    with cp.CheckpointPipeline(new_root) as pipe:
        result = pipe.restore_latest(state)
    assert result is not None and result.step == STEP
    assert torch.equal(state["w"], VALUES)


@pytest.mark.timeout(60)
def test_fetch_of_a_copy_corrupt_on_the_holder_is_refused(source: Source, holder: Holder,
                                                          tmp_path: Path) -> None:
    acked_and_committed(source, holder)
    at = source.checks[1][0] + 100
    shard = holder.copy("shard")
    shard.write_bytes(_flip(shard.read_bytes(), at))
    new_root = tmp_path / "new"
    new_root.mkdir()  # a pipeline's root exists before it fetches
    with pytest.raises(CheckpointIntegrityError) as info:
        fetch_shard(LocalStorage(new_root), holder.peer, token=TOKEN, step=STEP,
                    save_id=source.save_id, rank=0, world_size=1, timeout_s=5)
    message = str(info.value)
    assert "rank 1 on nodeB" in message and str(holder.server.address[1]) in message
    start, end, _ = source.checks[1]
    assert f"[{start}, {end})" in message
    assert [p.name for p in new_root.rglob("*")] == []  # no file, no step directory


@pytest.mark.timeout(60)
def test_fetch_of_a_copy_not_committed_is_refused(source: Source, holder: Holder,
                                                  tmp_path: Path) -> None:
    assert push(source, holder).acked == (1,)  # stored, never settled
    new_root = tmp_path / "new"
    new_root.mkdir()  # a pipeline's root exists before it fetches
    with pytest.raises(CheckpointIntegrityError, match="holds no valid copy"):
        fetch_shard(LocalStorage(new_root), holder.peer, token=TOKEN, step=STEP,
                    save_id=source.save_id, rank=0, world_size=1, timeout_s=5)
    with pytest.raises(CheckpointIntegrityError, match="wrong token"):
        fetch_shard(LocalStorage(new_root), holder.peer, token="x", step=STEP,
                    save_id=source.save_id, rank=0, world_size=1, timeout_s=5)
    assert [p.name for p in new_root.rglob("*")] == []


@pytest.mark.timeout(60)
def test_a_reshard_reads_ranges_of_a_saved_ranks_own_files_which_a_restores_fetch_does_not(
        source: Source, holder: Holder, tmp_path: Path) -> None:
    """The holder's root has saved rank 0's shard under its own names (no copy of it): a
    reshard opens it for range reads (``PeerShard``, the ``range`` op), its status checks out
    against the manifest and commit record, and ranges read through it are the shard's bytes
    (one spanning several frames, one at the end), with what crossed the network counted;
    nothing is written anywhere. The fetch of a same-size restore asks for the copy held for
    rank 0 only, and is refused; so is a range read of another save, with another job's
    token, or beyond the shard's end."""
    step_dir = holder.root / STEP_DIR
    step_dir.mkdir()
    for kind in ("shard", "manifest", "commit"):
        (step_dir / f"rank-00000.{kind}").write_bytes(
            (source.root / STEP_DIR / f"rank-00000.{kind}").read_bytes())
    new_root = tmp_path / "new"
    new_root.mkdir()
    with pytest.raises(CheckpointIntegrityError, match="holds no valid copy"):
        fetch_shard(LocalStorage(new_root), holder.peer, token=TOKEN, step=STEP,
                    save_id=source.save_id, rank=0, world_size=1, timeout_s=5)

    def open_shard(save_id: str = source.save_id, token: str = TOKEN) -> PeerShard:
        return PeerShard(holder.peer, token=token, step=STEP, save_id=save_id, source=0,
                         world_size=1, timeout_s=5)

    shard = open_shard()
    try:
        status = shard.status()
        assert status.valid and status.save_id == source.save_id
        assert status.header is not None
        assert status.header.header_offset == source.header_offset
        fd, size = shard.open_read("ignored", len(source.shard))
        assert size == len(source.shard)
        start, end = source.checks[0][0], source.checks[-1][1]  # the whole data region
        data = bytearray(end - start)
        shard.pread_into(fd, memoryview(data), start)
        assert bytes(data) == source.shard[start:end]
        tail = bytearray(100)
        shard.pread_into(fd, memoryview(tail), len(source.shard) - 100)
        assert bytes(tail) == source.shard[-100:]
        with pytest.raises(CheckpointIntegrityError, match="beyond the"):
            shard.pread_into(fd, memoryview(bytearray(10)), len(source.shard) - 5)
        read_header = len(source.shard) - source.header_offset + PREAMBLE_SIZE
        assert shard.bytes == read_header + (end - start) + 100
    finally:
        shard.close(0)
    with pytest.raises(CheckpointIntegrityError, match="holds no valid copy"):
        open_shard(save_id="not-this-save")
    with pytest.raises(CheckpointIntegrityError, match="wrong token"):
        open_shard(token="x")
    assert [p.name for p in new_root.rglob("*")] == []


@pytest.mark.slow  # waits a second for the server to close the idle connection
@pytest.mark.timeout(60)
def test_a_range_read_on_a_connection_the_server_closed_while_idle_is_made_again(
        source: Source, tmp_path: Path) -> None:
    """A holder whose copy server waits 0.3 s for the next message: the connection a
    ``PeerShard`` opened first sits idle past that (as while a reshard plans), so the server
    closes it; the next read finds it closed and is made again on a new connection, once."""
    root = tmp_path / "holder"
    (root / STEP_DIR).mkdir(parents=True)
    for kind in ("shard", "manifest", "commit"):
        (root / STEP_DIR / f"rank-00000.{kind}").write_bytes(
            (source.root / STEP_DIR / f"rank-00000.{kind}").read_bytes())
    server = CopyServer(LocalStorage(root), 1, bind_host="127.0.0.1",
                        advertise_host="127.0.0.1", timeout_s=0.3, emit=lambda _e: None)
    server.token, server.sources, server.world_size = TOKEN, frozenset({0}), 1
    try:
        shard = PeerShard(Peer(1, "nodeB", *server.address), token=TOKEN, step=STEP,
                          save_id=source.save_id, source=0, world_size=1, timeout_s=5)
        try:
            time.sleep(1.0)  # past the server's wait: it has closed the pooled connection
            start, end = source.checks[0][0], source.checks[-1][1]
            data = bytearray(end - start)
            shard.pread_into(0, memoryview(data), start)
            assert bytes(data) == source.shard[start:end]
        finally:
            shard.close(0)
    finally:
        server.close()


# ---------------------------------------------------------------------------- scrubbing


@pytest.mark.timeout(60)
def test_scrub_removes_uncommitted_copies_and_temps_of_this_holder_only(tmp_path: Path
                                                                        ) -> None:
    root = tmp_path / "holder"
    step_dir = root / STEP_DIR
    step_dir.mkdir(parents=True)
    contents = {
        # uncommitted copy held by rank 1, and a temporary of rank 1's: removed
        replica_name(0, 1, "shard"): b"s0",
        replica_name(0, 1, "manifest"): b"m0",
        f".{replica_name(0, 1, 'shard')}.tmp-abc123": b"t0",
        # a committed copy held by rank 1: kept
        replica_name(3, 1, "shard"): b"s3",
        replica_name(3, 1, "manifest"): b"m3",
        replica_name(3, 1, "commit"): b"c3",
        # another holder's files, committed or not, and its temporary: kept
        replica_name(0, 2, "shard"): b"s02",
        replica_name(0, 2, "manifest"): b"m02",
        f".{replica_name(0, 2, 'shard')}.tmp-def456": b"t02",
    }
    for name, data in contents.items():
        (step_dir / name).write_bytes(data)
    removed = scrub(LocalStorage(root), rank=1)
    gone = {replica_name(0, 1, "shard"), replica_name(0, 1, "manifest"),
            f".{replica_name(0, 1, 'shard')}.tmp-abc123"}
    assert sorted(os.path.basename(p) for p, _ in removed) == sorted(gone)
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(set(contents) - gone)
    for name in set(contents) - gone:
        assert (step_dir / name).read_bytes() == contents[name]


# ---------------------------------------------------------------------------- sending again


def _resend(root: Path, holder: Holder, save_id: str) -> list[cp.Event]:
    """Send rank 0's shard of the step in ``root`` to the holder as a restore sends a copy
    its holder lacks (``Resend``), and wait (bounded) for it to end; return its events."""
    events: list[cp.Event] = []
    resend = Resend(LocalStorage(root), [holder.peer], token=TOKEN, step=STEP,
                    save_id=save_id, rank=0, timeout_s=5, emit=events.append)
    resend.start()
    assert resend.close(30)
    return events


@pytest.mark.timeout(60)
def test_a_copy_sent_again_is_published_with_its_commit_record_and_outlives_the_server(
        source: Source, holder: Holder) -> None:
    events = _resend(source.root, holder, source.save_id)
    [done] = events
    assert isinstance(done, cp.ReplicaRestored), events
    assert (done.step, done.rank, done.holder, done.save_id) == (STEP, 0, 1, source.save_id)
    assert done.bytes == len(source.shard)
    assert holder.files() == COPY_FILES
    assert holder.copy("shard").read_bytes() == source.shard
    assert holder.copy("manifest").read_bytes() == source.manifest
    assert holder.copy("commit").read_bytes() == source.commit
    [status] = scan_replicas(holder.storage, 1)
    assert status.valid and status.save_id == source.save_id, status.reason
    holder.server.close()  # committed with its record: not a copy waiting for a vote
    assert holder.files() == COPY_FILES


@pytest.mark.timeout(60)
def test_a_shard_corrupt_on_its_disk_is_not_sent_again(source: Source, holder: Holder,
                                                       tmp_path: Path) -> None:
    root = tmp_path / "corrupt"
    root.mkdir()
    (root / STEP_DIR).mkdir()
    for kind in ("shard", "manifest", "commit"):
        data = (source.root / STEP_DIR / f"rank-00000.{kind}").read_bytes()
        if kind == "shard":
            start, end, _ = source.checks[1]
            data = _flip(data, (start + end) // 2)
        (root / STEP_DIR / f"rank-00000.{kind}").write_bytes(data)
    [failed] = _resend(root, holder, source.save_id)
    assert isinstance(failed, cp.ReplicaRestoreFailed) and failed.holder == 1, failed
    assert "do not match its checksum" in failed.error, failed.error
    wait_for(lambda: holder.files() == [], "removed")


@pytest.mark.timeout(60)
def test_a_push_carrying_another_saves_commit_record_is_refused(source: Source,
                                                                holder: Holder) -> None:
    other = encode_commit(CommitRecord(STEP, 0, 1, "another-run-10", time.time(), {}))
    p = Push([holder.peer], token=TOKEN, step=STEP, save_id=source.save_id, rank=0,
             timeout_s=5, commit=other)
    p.open(len(source.shard))
    outcome = p.collect()
    assert outcome.acked == ()
    assert "commit record pushed with rank 0's copy of step 10 is for another save" in (
        outcome.errors[1]), outcome.errors
    assert holder.files() == []
