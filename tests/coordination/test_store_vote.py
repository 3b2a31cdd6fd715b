"""The agreement that replaced the flat gloo groups at construction (``store_vote``): every
rank puts a value in the job's store and learns whether all ranks put the same one, with no
group of every rank. A real TCPStore (server in this process), one client and one thread a
rank, as ranks reach it."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from ckpt_pipeline.coordination._hierarchy import store_vote

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def stores() -> Any:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    clients: list[Any] = []

    def client() -> Any:
        c = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                          timeout=timedelta(seconds=30))
        clients.append(c)
        return c

    yield client
    clients.clear()  # the clients, then the server, go with the fixture's frame


def _vote(stores: Any, values: list[bytes], key: str, absent: tuple[int, ...] = (),
          timeout_s: float = 20.0) -> list[Any]:
    world = len(values)
    out: list[Any] = [None] * world
    clients = [stores() for _ in range(world)]

    def rank(r: int) -> None:
        try:
            out[r] = ("ok", store_vote(clients[r], key, r, world, values[r], timeout_s))
        except Exception as exc:  # reported to the test
            out[r] = ("error", exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)
               if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    return out


def test_ranks_that_agree_learn_it_without_reading_each_others_entries(stores: Any) -> None:
    out = _vote(stores, [b"8"] * 6, "k1")
    assert out == [("ok", None)] * 6


def test_ranks_that_differ_all_learn_who_said_what(stores: Any) -> None:
    out = _vote(stores, [b"8", b"8", b"4", b"8", b"0", b"4"], "k2")
    expected = {b"8": [0, 1, 3], b"4": [2, 5], b"0": [4]}
    assert out == [("ok", expected)] * 6


@pytest.mark.slow  # waits out its 1 s timeout
def test_a_rank_that_never_comes_is_named_when_the_others_give_up(stores: Any) -> None:
    out = _vote(stores, [b"8"] * 4, "k3", absent=(2,), timeout_s=1.0)
    for r in (0, 1, 3):
        kind, exc = out[r]
        assert kind == "error" and isinstance(exc, TimeoutError), out[r]
        assert "rank(s) 2 did not come" in str(exc)
    assert out[2] is None


def test_keys_of_two_votes_do_not_mix(stores: Any) -> None:
    assert _vote(stores, [b"a", b"a"], "k4") == [("ok", None)] * 2
    assert _vote(stores, [b"a", b"b"], "k5") == [("ok", {b"a": [0], b"b": [1]})] * 2
