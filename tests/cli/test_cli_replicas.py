"""``ckpt-pipeline ls`` and ``verify`` on roots where a rank holds copies of other ranks' shards.

The checkpoints are real ones, saved by the library; the copies are made as replication makes
them: the source rank's three files, byte for byte, under the holder's names
(``replica-SSSSS-on-HHHHH.*``) in the holder's step directory. The holder here is rank 1 of a
job of two, saved by one process that stands in for it (``Agreeing``: the other rank always
agrees), so that the holder's root has its own shard next to the copy, as a real one has.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.documents import decode_commit
from ckpt_pipeline._format.scan import scan, scan_replicas
from tests._support.cli import run_cli as _cli
from tests._support.coordinators import Agreeing

COPY = "replica-00000-on-00001"
"""The names of rank 0's files as rank 1 holds them."""
DATA_BYTES = (1024 + 256) * 4
"""The tensor bytes of one saved state (``_save_steps``)."""


def _save_steps(root: Path, steps: list[int], rank: int | None = None) -> None:
    """Save a small state at each step: as the only rank (None), or as rank ``rank`` of 2."""
    coordinator = None if rank is None else Agreeing(rank)
    with cp.CheckpointPipeline(root, keep_last=5, coordinator=coordinator) as pipe:
        for step in steps:
            pipe.save(step, {"w": torch.randn(1024), "opt": {"m": torch.zeros(256)}},
                      cp.TrainState(step=step)).result(30)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def _replicate(source_root: Path, holder_root: Path, step: int) -> Path:
    """Copy rank 0's files of ``step`` into rank 1's step directory as rank 1's copy of them;
    return the copy's shard."""
    for kind in ("shard", "manifest", "commit"):
        shutil.copyfile(_step_dir(source_root, step) / f"rank-00000.{kind}",
                        _step_dir(holder_root, step) / f"{COPY}.{kind}")
    return _step_dir(holder_root, step) / f"{COPY}.shard"


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    """Rank 0's root and rank 1's, steps 10 and 20 in both, rank 1 holding copies of rank 0's
    shards of both steps."""
    source, holder = tmp_path / "rank0", tmp_path / "rank1"
    _save_steps(source, [10, 20])
    _save_steps(holder, [10, 20], rank=1)
    for step in (10, 20):
        _replicate(source, holder, step)
    return source, holder


def _json(*args: object, code: int = 0) -> dict[str, Any]:
    done = _cli(*args, "--json")
    assert done.returncode == code, done.stdout + done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def _table(stdout: str) -> tuple[str, list[str]]:
    """The header line and the row lines of a table (a summary line is a row here too)."""
    lines = stdout.splitlines()
    return lines[0], lines[1:]


def _save_id(root: Path, step: int, rank: int) -> str:
    path = _step_dir(root, step) / f"rank-{rank:05d}.commit"
    return decode_commit(path.read_bytes(), str(path)).save_id


def _data_offset(holder: Path, step: int) -> int:
    """Where the copy's data region starts (its first checksummed range)."""
    (status,) = [s for s in scan_replicas(cp.LocalStorage(holder), 1) if s.step == step]
    assert status.header is not None
    return min(start for start, _, _ in status.header.checks())


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


# --------------------------------------------------------------------------- ls


@pytest.mark.timeout(60)
def test_ls_json_lists_the_copy_a_rank_holds_per_step(roots: tuple[Path, Path]) -> None:
    source, holder = roots
    data = _json("ls", holder, "--rank", 1)
    assert data["rank"] == 1
    assert [(s["step"], s["status"]) for s in data["steps"]] == [(20, "complete"),
                                                                 (10, "complete")]
    for entry in data["steps"]:
        step = entry["step"]
        copy_files = [_step_dir(holder, step) / f"{COPY}.{k}"
                      for k in ("shard", "manifest", "commit")]
        assert entry["copies"] == [{
            "source": 0,
            "holder": 1,
            "status": "complete",
            "valid": True,
            "reason": None,
            "bytes": sum(p.stat().st_size for p in copy_files),
            "save_id": _save_id(source, step, 0),
            "shard": str(copy_files[0]),
        }]
        # The row itself is still rank 1's own files: the copy adds neither bytes nor ranks.
        own = sum(p.stat().st_size for p in _step_dir(holder, step).glob("rank-00001.*"))
        assert entry["bytes"] == own
        assert entry["ranks_committed"] == [1]
        assert entry["ranks_present"] == [1]
        assert entry["save_id"] == _save_id(holder, step, 1)


@pytest.mark.timeout(60)
def test_ls_text_shows_each_copy_with_its_source_rank_and_state(
        roots: tuple[Path, Path]) -> None:
    source, holder = roots
    # Rank 0's files of step 20 under the name of a copy of rank 2's: they name rank 0.
    for kind in ("shard", "manifest", "commit"):
        shutil.copyfile(_step_dir(source, 20) / f"rank-00000.{kind}",
                        _step_dir(holder, 20) / f"replica-00002-on-00001.{kind}")
    done = _cli("ls", holder, "--rank", 1)
    assert done.returncode == 0, done.stderr
    header, rows = _table(done.stdout)
    assert header.split() == ["STEP", "STATUS", "SIZE", "AGE", "RANKS", "SAVE", "ID",
                              "COPIES", "REASON"]
    copies_at = header.index("COPIES")
    reason_at = header.index("REASON")
    assert rows[0].split()[:2] == ["20", "complete"]
    assert rows[0][copies_at:reason_at].strip() == "0 complete, 2 corrupt"
    reason = rows[0][reason_at:]
    assert reason.startswith("copy of rank 2: commit record is for step 20 rank 0")
    assert "replica-00002-on-00001.commit" in reason
    assert reason.endswith("(copy held by rank 1)")
    assert rows[1].split()[:2] == ["10", "complete"]
    assert rows[1][copies_at:].strip() == "0 complete"


@pytest.mark.timeout(60)
def test_ls_of_a_root_without_copies_is_unchanged(roots: tuple[Path, Path]) -> None:
    source, holder = roots
    done = _cli("ls", source)
    assert done.returncode == 0, done.stderr
    header, rows = _table(done.stdout)
    assert header.split() == ["STEP", "STATUS", "SIZE", "AGE", "RANKS", "SAVE", "ID"]
    assert [r.split()[:2] for r in rows] == [["20", "complete"], ["10", "complete"]]
    assert all(s["copies"] == [] for s in _json("ls", source)["steps"])
    # Rank 0 holds no copies in rank 1's root either: the copy is rank 1's.
    assert all(s["copies"] == [] for s in _json("ls", holder, "--rank", 0)["steps"])


@pytest.mark.timeout(60)
def test_ls_shows_a_copy_without_its_commit_record_as_incomplete(
        roots: tuple[Path, Path]) -> None:
    _, holder = roots
    os.unlink(_step_dir(holder, 20) / f"{COPY}.commit")
    by_step = {s["step"]: s for s in _json("ls", holder, "--rank", 1)["steps"]}
    (copy,) = by_step[20]["copies"]
    assert (copy["source"], copy["holder"], copy["status"], copy["valid"]) == (
        0, 1, "incomplete", False)
    assert copy["reason"] == "no commit record for rank 0 (copy held by rank 1)"
    assert copy["save_id"] is None
    # Rank 1's own shard of the step, and the copy of the other step, are untouched by it.
    assert by_step[20]["status"] == "complete"
    assert by_step[20]["reason"] is None
    assert [c["status"] for c in by_step[10]["copies"]] == ["complete"]

    done = _cli("ls", holder, "--rank", 1)
    header, rows = _table(done.stdout)
    assert rows[0][header.index("COPIES"):header.index("REASON")].strip() == "0 incomplete"
    assert rows[0][header.index("REASON"):] == (
        "copy of rank 0: no commit record for rank 0 (copy held by rank 1)")


@pytest.mark.timeout(60)
def test_ls_shows_a_copy_with_a_truncated_commit_record_as_corrupt(
        roots: tuple[Path, Path]) -> None:
    _, holder = roots
    os.truncate(_step_dir(holder, 20) / f"{COPY}.commit", 10)
    by_step = {s["step"]: s for s in _json("ls", holder, "--rank", 1)["steps"]}
    (copy,) = by_step[20]["copies"]
    assert (copy["status"], copy["valid"]) == ("corrupt", False)
    assert f"{COPY}.commit" in copy["reason"]
    assert copy["reason"].endswith("(copy held by rank 1)")
    assert by_step[20]["status"] == "complete"


@pytest.mark.timeout(60)
def test_ls_of_a_step_holding_only_a_copy(tmp_path: Path) -> None:
    source, holder = tmp_path / "rank0", tmp_path / "rank1"
    _save_steps(source, [10])
    _step_dir(holder, 10).mkdir(parents=True)
    _replicate(source, holder, 10)
    (entry,) = _json("ls", holder, "--rank", 1)["steps"]
    assert (entry["step"], entry["status"], entry["bytes"]) == (10, "incomplete", 0)
    assert [(c["source"], c["status"]) for c in entry["copies"]] == [(0, "complete")]


# --------------------------------------------------------------------------- verify


@pytest.mark.timeout(60)
def test_verify_reads_the_own_shard_and_every_copy_and_passes(
        roots: tuple[Path, Path]) -> None:
    source, holder = roots
    done = _cli("verify", holder, "--rank", 1)
    assert done.returncode == 0, done.stdout + done.stderr
    header, rows = _table(done.stdout)
    assert header.split() == ["STEP", "SHARD", "RESULT", "READ", "SECONDS", "GB/S", "REASON"]
    assert [r.split()[:3] for r in rows[:2]] == [["20", "own", "OK"],
                                                 ["20", "copy", "of"]]
    assert rows[1].split()[3:5] == ["0", "OK"]
    assert rows[2] == "2 ok"

    (result,) = _json("verify", holder, "--rank", 1)["results"]
    assert (result["step"], result["ok"], result["bytes"]) == (20, True, DATA_BYTES)
    (copy,) = result["copies"]
    assert {k: copy[k] for k in ("source", "holder", "ok", "result", "reason", "bytes",
                                 "save_id", "path", "shard")} == {
        "source": 0, "holder": 1, "ok": True, "result": "ok", "reason": None,
        "bytes": DATA_BYTES, "save_id": _save_id(source, 20, 0),
        "path": str(_step_dir(holder, 20)),
        "shard": str(_step_dir(holder, 20) / f"{COPY}.shard")}


@pytest.mark.timeout(60)
def test_verify_fails_on_a_corrupt_copy_and_still_reports_the_own_shard_ok(
        roots: tuple[Path, Path]) -> None:
    _, holder = roots
    shard = _step_dir(holder, 20) / f"{COPY}.shard"
    _flip_byte(shard, _data_offset(holder, 20) + 100)
    # The cheap look does not read the data: ls still sees a complete copy.
    (newest, _) = _json("ls", holder, "--rank", 1)["steps"]
    assert [c["status"] for c in newest["copies"]] == ["complete"]

    done = _cli("verify", holder, "--rank", 1)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    header, rows = _table(done.stdout)
    assert rows[0].split()[:3] == ["20", "own", "OK"]
    assert rows[1].split()[:5] == ["20", "copy", "of", "0", "FAILED"]
    reason = rows[1][header.index("REASON"):]
    assert "checksum mismatch in 1 chunk(s)" in reason
    assert "(tensor 'w')" in reason
    assert f"rank=0, path={shard}" in reason
    assert reason.endswith("(copy held by rank 1)")
    assert rows[2] == "1 ok, 1 failed"

    (result,) = _json("verify", holder, "--rank", 1, code=1)["results"]
    assert (result["ok"], result["result"], result["reason"]) == (True, "ok", None)
    (copy,) = result["copies"]
    assert (copy["source"], copy["holder"], copy["ok"], copy["result"]) == (0, 1, False,
                                                                           "failed")
    assert copy["shard"] == str(shard)
    assert "checksum mismatch" in copy["reason"]


@pytest.mark.timeout(60)
def test_verify_fails_on_a_corrupt_own_shard_and_still_reports_the_copy_ok(
        roots: tuple[Path, Path]) -> None:
    _, holder = roots
    own = scan(cp.LocalStorage(holder), 1)[0]
    assert own.step == 20 and own.header is not None
    start = min(s for s, _, _ in own.header.checks())
    _flip_byte(_step_dir(holder, 20) / "rank-00001.shard", start + 100)
    (result,) = _json("verify", holder, "--rank", 1, code=1)["results"]
    assert (result["step"], result["ok"]) == (20, False)
    assert "rank-00001.shard" in result["reason"]
    assert [(c["source"], c["ok"], c["reason"]) for c in result["copies"]] == [(0, True, None)]


@pytest.mark.timeout(60)
def test_verify_all_checks_the_copies_of_every_step_and_skips_an_uncommitted_copy(
        roots: tuple[Path, Path]) -> None:
    _, holder = roots
    os.unlink(_step_dir(holder, 10) / f"{COPY}.commit")
    data = _json("verify", holder, "--rank", 1, "--all")
    got = [(r["step"], r["result"], [(c["source"], c["result"]) for c in r["copies"]])
           for r in data["results"]]
    assert got == [(20, "ok", [(0, "ok")]), (10, "ok", [(0, "skipped")])]
    skipped = data["results"][1]["copies"][0]
    assert skipped["ok"] is None
    assert skipped["reason"] == "no commit record for rank 0 (copy held by rank 1)"

    # Named with --step, the uncommitted copy fails, as the rank's own files would.
    (result,) = _json("verify", holder, "--rank", 1, "--step", 10, code=1)["results"]
    assert result["ok"] is True
    assert [(c["result"], c["reason"]) for c in result["copies"]] == [
        ("failed", "no commit record for rank 0 (copy held by rank 1)")]


@pytest.mark.timeout(60)
def test_verify_of_a_root_without_copies_is_unchanged(roots: tuple[Path, Path]) -> None:
    source, _ = roots
    done = _cli("verify", source)
    assert done.returncode == 0, done.stdout + done.stderr
    header, rows = _table(done.stdout)
    assert header.split() == ["STEP", "RESULT", "READ", "SECONDS", "GB/S", "REASON"]
    assert [r.split()[:2] for r in rows] == [["20", "OK"]]
    (result,) = _json("verify", source)["results"]
    assert result["copies"] == []


# ------------------------------------------------------------------- cp.load and show


def _assert_same_tree(a: Any, b: Any) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            _assert_same_tree(a[key], b[key])
        else:
            assert torch.equal(a[key], b[key]), key


@pytest.mark.timeout(60)
def test_load_reads_a_rank_from_the_copy_another_rank_holds(roots: tuple[Path, Path]) -> None:
    """Rank 0's own files are not in rank 1's root (rank 0's node is gone): ``cp.load`` of
    rank 0 there reads rank 1's copy, verified, and says so."""
    source, holder = roots
    own = cp.load(source, rank=0)
    from_copy = cp.load(holder, rank=0)
    assert (from_copy.step, from_copy.rank, dict(from_copy.copies)) == (20, 0, {0: 1})
    assert dict(own.copies) == {}
    _assert_same_tree(from_copy.tree, own.tree)
    assert cp.load(holder, 10, rank=0).step == 10
    assert dict(cp.load(holder, rank=1).copies) == {}


@pytest.mark.timeout(60)
def test_load_falls_back_to_the_copy_when_the_own_shard_is_damaged(tmp_path: Path) -> None:
    """Rank 0's root holds a copy of its own shard under a holder's name; flipping a data byte
    of the own shard makes ``cp.load`` read the copy; damaging the copy too gives an error
    that names both."""
    source = tmp_path / "rank0"
    _save_steps(source, [10])
    want = cp.load(source)
    for kind in ("shard", "manifest", "commit"):
        shutil.copyfile(_step_dir(source, 10) / f"rank-00000.{kind}",
                        _step_dir(source, 10) / f"{COPY}.{kind}")
    status = scan(cp.LocalStorage(source), 0)[0]
    assert status.header is not None
    start = min(s for s, _, _ in status.header.checks())
    _flip_byte(_step_dir(source, 10) / "rank-00000.shard", start + 100)
    got = cp.load(source)
    assert dict(got.copies) == {0: 1}
    _assert_same_tree(got.tree, want.tree)

    _flip_byte(_step_dir(source, 10) / f"{COPY}.shard", start + 100)
    with pytest.raises(cp.CheckpointIntegrityError) as info:
        cp.load(source)
    message = str(info.value)
    assert "step 10 of rank 0 does not verify" in message
    assert "rank-00000.shard" in message and "copy held by rank 1" in message


@pytest.mark.timeout(60)
def test_show_reads_the_header_of_a_copy_when_the_own_files_are_gone(
        roots: tuple[Path, Path]) -> None:
    _, holder = roots
    done = _cli("show", holder, "--rank", 0)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "from the copy rank 1 holds" in done.stdout.splitlines()[0]
    data = _json("show", holder, "--rank", 0)
    assert (data["step"], data["copy_held_by"]) == (20, 1)
    assert [t["path"] for t in data["tensors"]] == ["w", "opt/m"]
    assert _json("show", holder, "--rank", 1)["copy_held_by"] is None
