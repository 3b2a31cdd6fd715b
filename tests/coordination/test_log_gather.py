"""The leaders' stage of the per-node control plane (``log_gather``: Bruck's all-gather in
ceil(log2 n) rounds of gloo point-to-point messages) on real gloo ranks: every member gets
every payload in order, for 1 to 7 members (powers of two and not), and a member that never
comes ends the others' wait by the timeout instead of hanging them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._support.children import child_script
from tests.coordination.test_fsdp import _run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

WORKER = child_script("log_gather_worker.py")


def _run(world: int, out: Path, *args: str) -> list[dict[str, object]]:
    out.mkdir()
    _run_ranks(WORKER, world, "--out", out, *args)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def test_every_member_gets_every_payload_in_order_for_one_to_seven_members(
        tmp_path: Path) -> None:
    reports = _run(7, tmp_path / "out")
    assert [r["wrong"] for r in reports] == [[]] * 7


def test_a_member_that_never_comes_ends_the_others_wait_by_the_timeout(
        tmp_path: Path) -> None:
    reports = _run(5, tmp_path / "out", "--absent", "2", "--timeout", "3")
    for rank, report in enumerate(reports):
        if rank == 2:
            continue
        assert report["error"], f"rank {rank} finished an exchange rank 2 never joined"
        assert 2.5 <= float(report["after_s"]) < 3.0 + 5.0, report  # 5 s: a loaded machine
