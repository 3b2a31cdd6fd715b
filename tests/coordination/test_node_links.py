"""The per-node control plane's local sockets (``coordination/_node_links.py``): a node's ranks
linked to their leader through a real store (torch.distributed's ``HashStore``, which the
job's TCPStore speaks like) and real Unix-domain sockets, each rank a thread of this process.
The multi-process runs of the whole coordinator are in ``test_hierarchical.py``."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ckpt_pipeline.coordination._node_links import NodeLinks
from ckpt_pipeline.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def _store() -> Any:
    import torch.distributed as dist

    return dist.HashStore()  # type: ignore[attr-defined]


def link(node: tuple[int, ...], *, store: Any | None = None, key: str = "k",
         deadline_s: float = 20.0) -> dict[int, NodeLinks | BaseException]:
    """Every rank of ``node``'s links, each made on a thread of its own, as each rank does."""
    store = store if store is not None else _store()
    made: dict[int, NodeLinks | BaseException] = {}
    deadline = time.monotonic() + deadline_s

    def make(rank: int) -> None:
        try:
            made[rank] = NodeLinks(store=store, key=key, rank=rank, node=node,
                                   deadline=deadline)
        except BaseException as exc:
            made[rank] = exc

    threads = [threading.Thread(target=make, args=(r,)) for r in node]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s + 10)
    return made


@contextlib.contextmanager
def linked(node: tuple[int, ...]) -> Iterator[dict[int, NodeLinks]]:
    """Every rank of ``node`` linked; every link closed at the end."""
    made = link(node)
    try:
        assert all(isinstance(v, NodeLinks) for v in made.values()), made
        yield {r: v for r, v in made.items() if isinstance(v, NodeLinks)}
    finally:
        for one in made.values():
            if isinstance(one, NodeLinks):
                one.close()


def in_threads(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` at once, each on a thread; their results (or exceptions) in order."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_node_exchanges_payloads_of_every_size_both_ways() -> None:
    """Three ranks send their leader payloads from empty to 1 MiB (many reads each), in two
    exchanges; the leader gets each in node order and its answer reaches every rank."""
    with linked((4, 5, 6, 7)) as links:
        for exchange in range(2):
            payloads = {r: bytes([r, exchange]) * (0 if r == 5 else (1 << 19) * (r - 5) + 3)
                        for r in (5, 6, 7)}
            deadline = time.monotonic() + 20
            leader = functools.partial(links[4].receive_all, (5, 6, 7), deadline)
            senders = [functools.partial(links[r].send, 4, payloads[r], deadline)
                       for r in (5, 6, 7)]
            results = in_threads(leader, *senders)
            assert results[0] == [payloads[5], payloads[6], payloads[7]]
            answer = b"relay %d" % exchange
            for r in (5, 6, 7):
                links[4].send(r, answer, deadline)
            for r in (5, 6, 7):
                assert links[r].receive_all((4,), deadline) == [answer]


def test_a_rank_that_sends_nothing_is_named_when_the_deadline_passes() -> None:
    with linked((0, 1, 2)) as links:
        links[1].send(0, b"vote", time.monotonic() + 5)
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[2\] sent nothing in time"):
            links[0].receive_all((1, 2), time.monotonic() + 0.3)


def test_a_rank_that_goes_away_fails_its_leaders_wait_at_once_and_the_leaders_its_ranks() -> None:
    with linked((0, 1, 2)) as links:
        links[2].close()  # the deadline would raise TimeoutError: the close is seen first
        with pytest.raises(ConnectionError, match="rank 2 closed its connection"):
            links[0].receive_all((1, 2), time.monotonic() + 20)
        links[0].close()
        with pytest.raises(ConnectionError, match="rank 0 closed its connection"):
            links[1].receive_all((0,), time.monotonic() + 20)


def test_a_rank_that_cannot_connect_stops_its_leader_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2's connection is refused (injected: what a rank of another host meets): it
    raises ConfigError naming its leader, and the leader stops waiting for it (it said so in
    the store) with a ConfigError naming rank 2, not a timeout."""
    import socket

    real = socket.socket.connect

    def connect(self: socket.socket, address: Any) -> None:
        if threading.current_thread().name == "rank-2":
            raise ConnectionRefusedError(111, "Connection refused (injected)")
        real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    store = _store()
    made: dict[int, Any] = {}
    deadline = time.monotonic() + 30

    def make(rank: int) -> None:
        try:
            made[rank] = NodeLinks(store=store, key="k", rank=rank, node=(0, 1, 2),
                                   deadline=deadline)
        except BaseException as exc:
            made[rank] = exc

    threads = [threading.Thread(target=make, args=(r,), name=f"rank-{r}") for r in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert isinstance(made[2], ConfigError), made
    assert "rank 2 could not connect to its node's leader, rank 0" in str(made[2])
    assert isinstance(made[0], ConfigError), made
    # Not TimeoutError ("did not connect to its leader in time"): the store said it first.
    assert "rank 2 could not connect to its node's leader, rank 0" in str(made[0])
    if isinstance(made[1], NodeLinks):
        made[1].close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_keep_its_parents_connections_open() -> None:
    """A child forked from rank 1 (a DataLoader worker, say) outlives rank 1's connection:
    the fork hook closed the child's copy, so the leader sees rank 1 go at once instead of
    waiting out its deadline."""
    with linked((0, 1)) as links:
        child = os.fork()
        if child == 0:  # the child: hold whatever it has for a while, touch nothing
            time.sleep(30)
            os._exit(0)
        try:
            links[1].close()  # without the hook the child's copy keeps it open: TimeoutError
            with pytest.raises(ConnectionError, match="rank 1 closed its connection"):
                links[0].receive_all((1,), time.monotonic() + 20)
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


def test_connections_on_descriptors_beyond_1024_work() -> None:
    """A rank of a large job holds many descriptors (gloo's connections to every rank): the
    node's sockets then have numbers beyond 1,024, which ``select()`` refuses."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1400
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with linked((0, 1)) as links:
            assert min(c.fileno() for one in links.values()
                       for c in one._peers.values()) > 1024
            deadline = time.monotonic() + 10
            links[1].send(0, b"vote", deadline)
            assert links[0].receive_all((1,), deadline) == [b"vote"]
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_messages_sent_back_to_back_are_read_one_at_a_time_in_order() -> None:
    """Two messages that arrive in one read: the second is kept for the next read, whether
    the leader waits on one rank or on several."""
    with linked((0, 1, 2)) as links:
        deadline = time.monotonic() + 10
        for message in (b"first", b"", b"third" * 1000):
            links[1].send(0, message, deadline)
            links[2].send(0, message, deadline)
        time.sleep(0.2)  # let them all arrive before the first read
        assert links[0].receive_all((1,), deadline) == [b"first"]
        assert links[0].receive_all((1, 2), deadline) == [b"", b"first"]
        assert links[0].receive_all((2, 1), deadline) == [b"", b"third" * 1000]
        assert links[0].receive_all((2,), deadline) == [b"third" * 1000]
        links[0].send(1, b"a", deadline)
        links[0].send(1, b"b", deadline)
        time.sleep(0.2)
        assert links[1].receive_all((0,), deadline) == [b"a"]
        assert links[1].receive_all((0,), deadline) == [b"b"]
