"""Restoring on another number of ranks than saved (issue 26): real gloo processes, FSDP2 on
CPU, DDP, and DTensors on 2-D meshes, in one root that every rank reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import ckpt_pipeline as cp
from ckpt_pipeline._format.scan import scan
from tests._support.children import child_script
from tests.coordination.test_distributed import flip_data_byte
from tests.coordination.test_fsdp import _run_ranks

WORKER = child_script("reshard_worker.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _restore(tmp_path: Path, world: int, *args: str) -> list[dict[str, Any]]:
    outs = [tmp_path / f"out-{world}-{r}.json" for r in range(world)]
    _run_ranks(WORKER, world, *args, "--root", tmp_path / "ckpt",
               per_rank=lambda rank: ["--out", outs[rank]])
    return [json.loads(o.read_text()) for o in outs]


INPLACE = ("--inplace-min", "0")
"""Every live DTensor shard read straight into it (the worker's models are below the 1 MiB
the library reads straight into by default)."""


@pytest.mark.parametrize(("saved", "live", "kinds", "inplace"), [
    (2, 4, ("fsdp", "fsdp"), True), (4, 2, ("fsdp", "fsdp"), True),
    (4, 1, ("fsdp", "fsdp"), False), (1, 4, ("fsdp", "fsdp"), False),
    (2, 3, ("fsdp", "fsdp"), True), (2, 3, ("ddp", "fsdp"), True),
    (3, 2, ("fsdp", "ddp"), False),
], ids=["2to4_inplace", "4to2_inplace", "4to1", "1to4", "2to3_inplace",
        "ddp2_to_fsdp3_inplace", "fsdp3_to_ddp2"])
def test_a_model_and_its_optimizer_reshard_onto_another_world_size(
        tmp_path: Path, saved: int, live: int, kinds: tuple[str, str], inplace: bool) -> None:
    """Every full parameter and AdamW moment equals what was saved, bit for bit; one more
    step on the same global batch matches the saved job's next step to within float32
    rounding (the gradients are reduced over another number of ranks, in another order).
    ``inplace``: the FSDP2 parameters' shards are read straight into (the moments never are:
    an optimizer's load_state_dict replaces its state); else into fresh memory."""
    _run_ranks(WORKER, saved, "save", "--kind", kinds[0], "--root", tmp_path / "ckpt")
    results = _restore(tmp_path, live, "restore", "--kind", kinds[1],
                       *(INPLACE if inplace else ()))
    for r in results:
        assert r["step"] == 2 and r["resharded_from"] == saved
        assert r["equal"], r["differ"]
        assert r["next_step_max_diff"] < 1e-6, r
        (in_place,) = r["in_place"]
        assert (in_place > 0) == (inplace and kinds[1] == "fsdp"), r
    if inplace:  # FSDP2: every rank's parameter shards, unless its shards are all empty
        assert sum(r["in_place"][0] for r in results) == 4 * (30 * 50 + 50 + 50 * 7 + 7)


def test_two_dimensional_mesh_reshards_onto_other_mesh_shapes(tmp_path: Path) -> None:
    """Saved on a 2x2 mesh (rows and columns, HSDP, one dimension split twice), restored on
    1x4 and on a 1-D mesh of 4 with other placements, and on 2 ranks."""
    _run_ranks(WORKER, 4, "mesh-save", "--mesh", "2x2", "--root", tmp_path / "ckpt")
    cases = [
        ("1x4", {"rows_and_cols": "R,S1", "hsdp": "R,S0", "cols_only": "R,S0", "twice": "S0,R"}),
        ("4", {"rows_and_cols": "S1", "hsdp": "R", "cols_only": "S0", "twice": "S0"}),
        ("2", {"rows_and_cols": "S0", "hsdp": "S1", "cols_only": "R", "twice": "S1"}),
    ]
    for mesh, live in cases:
        world = 1
        for n in mesh.split("x"):
            world *= int(n)
        results = _restore(tmp_path, world, "mesh-restore", "--mesh", mesh,
                           "--live", json.dumps(live), *INPLACE)
        for r in results:
            assert "error" not in r, (mesh, r)
            assert r.pop("resharded_from") == 4, (mesh, r)
            assert all(r.values()), (mesh, r)


def test_a_shape_that_differs_is_refused_on_every_rank_with_the_state_untouched(
        tmp_path: Path) -> None:
    """A live tensor one row shorter than saved: every rank raises, naming the tensor and
    both shapes, and no live tensor changed (the others fit and would have resharded)."""
    _run_ranks(WORKER, 4, "mesh-save", "--mesh", "2x2", "--root", tmp_path / "ckpt")
    results = _restore(tmp_path, 2, "mesh-restore", "--mesh", "2", "--shrink", "hsdp",
                       "--live", json.dumps({"rows_and_cols": "S0", "hsdp": "S0",
                                             "cols_only": "S0", "twice": "S0"}))
    for r in results:
        assert "error" in r, r
        assert r["untouched"], r
    assert any("hsdp: saved tensor of shape [9, 3], the live DTensor [8, 3]" in r["error"]
               for r in results), results


def test_a_damaged_slice_that_one_rank_needs_makes_every_rank_fall_back(tmp_path: Path) -> None:
    """Saved rank 1's shard of step 2 is corrupt: the live ranks that read from it fail its
    checksum, and all four ranks restore step 1 together, resharded (straight into the live
    shards: what step 2 wrote there is put back, then step 1 read)."""
    _run_ranks(WORKER, 2, "save", "--root", tmp_path / "ckpt")
    flip_data_byte(tmp_path / "ckpt" / "step-0000000002" / "rank-00001.shard")
    results = _restore(tmp_path, 4, "restore", *INPLACE)
    assert [(r["step"], r["resharded_from"]) for r in results] == [(1, 2)] * 4



def test_a_damaged_block_found_after_reading_into_the_live_tensors_puts_them_back(
        tmp_path: Path) -> None:
    """The reshard reads straight into the live tensors; a damaged block at the end of saved
    rank 3's shard fails live rank 1 after it wrote ranges from saved rank 2 (and the other
    rank's load fails with it): with no older step every rank raises, and every live bit is as
    it was before the restore, put back from the copies taken before each write."""
    _run_ranks(WORKER, 4, "volume-save", "--root", tmp_path / "ckpt")
    (status,) = scan(cp.LocalStorage(tmp_path / "ckpt"), 3)
    assert status.header is not None
    (rows,) = [t for t in status.header.tensors if t.path == "t/rows"]
    at = status.header.storages[rows.storage].offset + rows.byte_offset \
        + 4 * rows.shape[0] * rows.shape[1] - 4096  # a byte of its last row
    with (Path(status.path) / "rank-00003.shard").open("r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    results = _restore(tmp_path, 2, "volume-damaged-restore", "--live", "S0")
    for r in results:
        assert "error" in r and r["untouched"], r
    assert "checksum mismatch" in results[1]["error"] or "rank 3" in results[1]["error"], \
        results[1]["error"]
    assert results[1]["put_back"] and results[1]["put_back"][0] > 0, results[1]


def _blocks(ranges: list[list[int]], block: int) -> list[int]:
    return [k for a, b in ranges for k in range(a // block, (b - 1) // block + 1)]


def _merged(ranges: list[list[int]]) -> list[tuple[int, int]]:
    """The byte ranges read, adjacent ones joined; AssertionError where two overlap (a byte
    read twice)."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        assert not out or a >= out[-1][1], f"bytes {a}-{b} read twice"
        if out and a == out[-1][1]:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


@pytest.mark.parametrize("live", ["S0", "S1"])
def test_a_reshard_reads_only_the_blocks_it_needs_each_once(tmp_path: Path, live: str) -> None:
    """Counted reads, 4 ranks to 2: no byte read twice by a rank, and what a rank reads of a
    file is whole checksum blocks (in pieces: a local file is read as a stream, each range
    into its place and the rest of its blocks into scratch). Rows split as saved (S0): a rank
    reads its two saved row ranges and at most one block beyond each end of each. Columns
    (S1): every block of the matrix, no more. The replicated matrix: read whole from one
    saved rank, the two live ranks from two."""
    _run_ranks(WORKER, 4, "volume-save", "--root", tmp_path / "ckpt")
    results = _restore(tmp_path, 2, "volume-restore", "--live", live)
    holders = []
    for r in results:
        assert r["equal"]
        needed = sum(r["needed"].values())
        assert r["in_place"] == [needed], (r["in_place"], needed)  # straight into the live
        read = 0
        rep_from = []
        for rel, entry in r["files"].items():
            block, (lo, hi) = entry["block"], entry["tensors"]["t/rows"]
            blocks = _blocks(entry["reads"], block)
            start, end = entry["data"]
            assert all((a % block == 0 or a == start) and (b % block == 0 or b == end)
                       for a, b in _merged(entry["reads"])), f"{rel}: not whole blocks"
            read += sum(b - a for a, b in entry["reads"])
            rep_lo, rep_hi = entry["tensors"]["t/rep"]
            covered = set(range(rep_lo // block, (rep_hi - 1) // block + 1))
            if covered <= set(blocks):
                rep_from.append(rel)
            row_blocks = set(range(lo // block, (hi - 1) // block + 1))
            if live == "S1":  # half of every row: every block of the rows, each once
                assert row_blocks <= set(blocks), rel
        assert len(rep_from) == 1, r["files"].keys()
        holders.append(rep_from[0])
        runs = 2 + 1 if live == "S0" else 4 + 1  # saved row ranges met, and the replica
        if live == "S0":
            assert needed <= read <= needed + 2 * runs * block, (read, needed)
        else:
            rows_total = 4 * 4099 * 1024
            assert needed <= read <= rows_total + 4 * 1500 * 1024 + 2 * runs * block
    assert holders[0] != holders[1]


def test_per_rank_values_are_refused_unless_excluded_or_mapped(tmp_path: Path) -> None:
    """Saved on 4 ranks with a per-rank loader position, per-rank TrainState values and
    per-rank RNG streams; restored on 2. Without a choice: refused on every rank, naming the
    value, the live state untouched. ``exclude`` keeps the loader's live values and a hook maps
    the TrainState's; ``rng="rank0"`` gives every rank saved rank 0's stream, the default
    leaves the live streams."""
    _run_ranks(WORKER, 4, "values-save", "--root", tmp_path / "ckpt")
    refused = _restore(tmp_path, 2, "values-restore", "--choice", "none")
    for r in refused:
        assert r["type"] == "ReshardError" and "loader/position" in r["error"], r
        assert "exclude" in r["error"] and r["untouched"]
        assert r["loader"] == {"position": -1, "epoch": -1}
    excluded = _restore(tmp_path, 2, "values-restore", "--choice", "exclude")
    for r in excluded:
        assert "error" not in r, r
        assert r["rows_equal"] and r["excluded"] == ["loader"]
        assert r["loader"] == {"position": -1, "epoch": -1}  # the live values, kept
        assert r["consumed"] == 5 + 10 + 15 + 20 and r["extra"] == {"seen": 6, "lr": 0.5}
        assert r["calls"] == ["train_state.consumed_train_samples", "train_state.extra/seen"]
        assert r["rank0_stream"]
    mapped = _restore(tmp_path, 2, "values-restore", "--choice", "hook")
    for r in mapped:
        assert "error" not in r, r
        assert r["loader"] == {"position": 0 + 10 + 20 + 30, "epoch": 1}
        assert "loader/position" in r["calls"] and r["live_stream"] and not r["rank0_stream"]


def test_a_mesh_of_another_shape_on_as_many_ranks_asks_for_a_choice_on_per_rank_values(
        tmp_path: Path) -> None:
    """Saved on 4 ranks on a 1-D mesh; restored on 4 ranks on a 2x2 mesh, where a rank's
    place in the data-parallel dimension changed: the per-rank loader positions are refused
    as on another world size (the live state untouched), and a hook maps them. Restored on
    the saved mesh shape with another placement, each rank keeps its own saved values."""
    _run_ranks(WORKER, 4, "values-save", "--root", tmp_path / "ckpt")
    for r in _restore(tmp_path, 4, "values-restore", "--mesh", "2x2", "--choice", "none"):
        assert r.get("type") == "ReshardError" and "loader/position" in r["error"], r
        assert r["untouched"] and r["loader"] == {"position": -1, "epoch": -1}, r
    for r in _restore(tmp_path, 4, "values-restore", "--mesh", "2x2", "--choice", "hook"):
        assert "error" not in r, r
        assert r["rows_equal"] and r["loader"] == {"position": 0 + 10 + 20 + 30, "epoch": 1}
    same = _restore(tmp_path, 4, "values-restore", "--live", "S1", "--choice", "none")
    for rank, r in enumerate(same):
        assert "error" not in r, r
        assert r["rows_equal"] and r["loader"] == {"position": 10 * rank, "epoch": 1}, r
        assert r["consumed"] == 5 * (rank + 1) and r["extra"] == {"seen": rank, "lr": 0.5}


def test_a_mesh_whose_dimensions_are_named_otherwise_asks_for_a_choice_on_per_rank_values(
        tmp_path: Path) -> None:
    """Saved on 4 ranks on a 2x2 mesh named ("dp", "tp"), which every shard header records;
    restored on 4 ranks on a 2x2 mesh with the same placements but named ("tp", "dp"): a
    rank's place in the data-parallel dimension may have moved, so the per-rank loader
    positions are refused as on another world size (the live state untouched), and a hook
    maps them. Named as saved, each rank keeps its own saved values."""
    _run_ranks(WORKER, 4, "values-save", "--mesh", "2x2", "--names", "dp,tp", "--root",
               tmp_path / "ckpt")
    for rank in range(4):
        (status,) = [s for s in scan(cp.LocalStorage(str(tmp_path / "ckpt")), rank) if s.valid]
        assert status.header is not None and status.header.meshes == (((2, 2), ("dp", "tp")),)
    swapped = ("values-restore", "--mesh", "2x2", "--names", "tp,dp")
    for r in _restore(tmp_path, 4, *swapped, "--choice", "none"):
        assert r.get("type") == "ReshardError" and "loader/position" in r["error"], r
        assert r["untouched"] and r["loader"] == {"position": -1, "epoch": -1}, r
    for r in _restore(tmp_path, 4, *swapped, "--choice", "hook"):
        assert "error" not in r, r
        assert r["rows_equal"] and r["loader"] == {"position": 0 + 10 + 20 + 30, "epoch": 1}
    named = _restore(tmp_path, 4, "values-restore", "--mesh", "2x2", "--names", "dp,tp",
                     "--choice", "none")
    for rank, r in enumerate(named):
        assert "error" not in r, r
        assert r["rows_equal"] and r["loader"] == {"position": 10 * rank, "epoch": 1}, r


def _flip_data_byte(shard: Path) -> None:
    """Flip a bit in the middle of the first checksum block of a shard file."""
    from ckpt_pipeline._format.shard import PREAMBLE_SIZE, decode_header, decode_preamble

    raw = bytearray(shard.read_bytes())
    version, offset, length, _ = decode_preamble(bytes(raw[:PREAMBLE_SIZE]), len(raw),
                                                 str(shard))
    header = decode_header(bytes(raw[offset:offset + length]), str(shard),
                           file_size=len(raw), header_offset=offset, version=version)
    start, end, _ = header.checks()[0]
    raw[(start + end) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))


def _files(root: Path) -> list[str]:
    """Every file under ``root`` (paths relative to it), sorted; the pipelines' lock files
    left out (each open of a root makes its own)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and not p.name.startswith(".lock"))


def test_node_local_roots_reshard_through_the_persistent_tier(tmp_path: Path) -> None:
    """Saved on 2 ranks, each into a root of its own (node-local disks) and promoted to a
    persistent tier (a directory); restored on 3 ranks whose roots are the saved ones and one
    new one. With both saved roots there, the live roots hold the step between them: ranks 0
    and 1 serve their own files and every rank reads the ranges it needs of what it lacks
    from them. With rank 1's root lost, no root holds its files: refused on every rank
    without the tier, saying what to do; with it, each rank reads the ranges it needs of the
    saved ranks' files its root lacks from the tier and reshards. Either way live rank 0
    (its root holds saved rank 0's files) reads saved rank 1's header and nothing of its
    data, which it does not need. Nothing read stays in the roots. A block of saved rank 1's
    shard damaged in the tier: the two ranks that read it fail step 2 on its checksum, and
    all three fall back to step 1 together."""
    import shutil

    tier = tmp_path / "tier"
    _run_ranks(WORKER, 2, "save", "--root", tmp_path / "ckpt", "--own-roots", "--tier", tier)
    before = _files(tmp_path / "ckpt")
    peered = _restore(tmp_path, 3, "restore", "--own-roots")
    for r in peered:
        assert r.get("step") == 2 and r["resharded_from"] == 2, r
        assert r["equal"], r["differ"]
    read = [r["peer_read"] for r in peered]
    sizes = [r["peer_sizes"] for r in peered]
    assert [sorted(one[0]) for one in read] == [["1"], ["0"], ["0", "1"]], read
    header_only = read[0][0]["1"]  # live rank 0 needs no element of saved rank 1's
    assert 0 < header_only < sizes[0][0]["1"], (read, sizes)
    assert read[2][0]["1"] > header_only  # live rank 2's rows are in saved rank 1's shard
    assert _files(tmp_path / "ckpt") == before
    shutil.rmtree(tmp_path / "ckpt" / "rank-1")  # a node lost, with its root
    for r in _restore(tmp_path, 3, "restore", "--own-roots"):
        assert r.get("type") == "RestoreError", r
        assert "no step saved by 2 rank(s) is complete" in r["error"], r
        assert "persistent tier" in r["error"], r
    tiered = _restore(tmp_path, 3, "restore", "--own-roots", "--tier", str(tier))
    for r in tiered:
        assert r.get("step") == 2 and r["resharded_from"] == 2, r
        assert r["equal"], r["differ"]
        assert r["next_step_max_diff"] < 1e-6, r
    read = [r["tier_read"] for r in tiered]
    sizes = [r["tier_sizes"] for r in tiered]
    assert [sorted(one[0]) for one in read] == [["1"], ["0", "1"], ["0", "1"]], read
    header_only = read[0][0]["1"]  # live rank 0 needs no element of saved rank 1's
    assert 0 < header_only < sizes[0][0]["1"], (read, sizes)
    for one, size in zip(read, sizes, strict=True):
        assert all(0 < one[0][r] <= size[0][r] for r in one[0]), (read, sizes)
    assert read[2][0]["1"] > header_only  # live rank 2's rows are in saved rank 1's shard
    assert _files(tmp_path / "ckpt") == [f for f in before if not f.startswith("rank-1/")]
    # a block of saved rank 1's shard of step 2 damaged in the tier: the ranks that need it
    # find it by its checksum, and every rank falls back to step 1 together
    _flip_data_byte(tier / "step-0000000002" / "rank-00001.shard")
    for r in _restore(tmp_path, 3, "restore", "--own-roots", "--tier", str(tier)):
        assert r.get("step") == 1 and r["resharded_from"] == 2, r
        failures = r["failed"][0]  # step 2's vote: the ranks that needed the block
        assert sorted(failures) == ["1", "2"], failures
        assert all("checksum mismatch" in e for e in failures.values()), failures


def test_a_node_that_is_lost_reshards_from_the_copies_on_the_node_left(tmp_path: Path) -> None:
    """Saved on 2 ranks, each on a node of its own with a root of its own and one copy of its
    shard on the other node (replication). Node 1 and its root are lost; the job restarts on
    rank 0 alone: its root holds its own shard and the copy of rank 1's, so it reshards 2 -> 1
    from the root, with no persistent tier, and the copy is left as it was."""
    import shutil

    _run_ranks(WORKER, 2, "save", "--root", tmp_path / "ckpt", "--own-roots", "--copies", "1")
    step_dir = tmp_path / "ckpt" / "rank-0" / "step-0000000002"
    held = sorted(p.name for p in step_dir.iterdir())
    assert "replica-00001-on-00000.shard" in held, held
    shutil.rmtree(tmp_path / "ckpt" / "rank-1")  # the node that was lost
    [r] = _restore(tmp_path, 1, "restore", "--own-roots")
    assert r.get("step") == 2 and r["resharded_from"] == 2, r
    assert r["equal"], r["differ"]
    assert r["next_step_max_diff"] < 1e-6, r
    assert sorted(p.name for p in step_dir.iterdir()) == held


def test_node_local_roots_reshard_from_the_copies_on_the_other_nodes(tmp_path: Path) -> None:
    """Saved on 4 ranks, each on a node of its own with a root of its own and 2 copies of its
    shard on the next nodes (rank r's on r+1 and r+2). Nodes 2 and 3 are lost; the job
    restarts on 2 ranks: neither root holds every saved rank's shard (rank 0's lacks rank 1's,
    rank 1's lacks rank 2's), both together do. Each rank reads the ranges it needs of what
    it lacks from the other's copy server (rank 1's own files; the copy on rank 0) and
    reshards 4 -> 2, writing nothing: the roots are left as they were."""
    import shutil

    _run_ranks(WORKER, 4, "save", "--root", tmp_path / "ckpt", "--own-roots", "--copies", "2")
    roots = [tmp_path / "ckpt" / f"rank-{r}" / "step-0000000002" for r in range(2)]
    before = [sorted(p.name for p in root.iterdir()) for root in roots]
    assert "replica-00001-on-00000.shard" not in before[0], before
    assert "replica-00002-on-00001.shard" not in before[1], before
    for lost in (2, 3):
        shutil.rmtree(tmp_path / "ckpt" / f"rank-{lost}")
    files = _files(tmp_path / "ckpt")
    restored = _restore(tmp_path, 2, "restore", "--own-roots", "--copies", "1")
    for r in restored:
        assert r.get("step") == 2 and r["resharded_from"] == 4, r
        assert r["equal"], r["differ"]
        assert r["next_step_max_diff"] < 1e-6, r
    assert [sorted(r["peer_read"][0]) for r in restored] == [["1"], ["2"]], restored
    for r in restored:
        assert all(0 < r["peer_read"][0][s] <= r["peer_sizes"][0][s]
                   for s in r["peer_read"][0]), r
    assert [sorted(p.name for p in root.iterdir()) for root in roots] == before
    assert _files(tmp_path / "ckpt") == files
    # a block of saved rank 1's own shard of step 2 damaged in live rank 1's root: rank 0,
    # which reads it over the data plane, and rank 1, which reads it from its root (both
    # need rows of it: of a 50-row weight saved rank 1 holds rows 13-25, live rank 0 takes
    # rows 0-24 and live rank 1 rows 25-49), find it by its checksum; both fall back to
    # step 1 together
    _flip_data_byte(roots[1] / "rank-00001.shard")
    for r in _restore(tmp_path, 2, "restore", "--own-roots", "--copies", "1"):
        assert r.get("step") == 1 and r["resharded_from"] == 4, r
        failures = r["failed"][0]
        assert sorted(failures) == ["0", "1"], failures
        assert all("checksum mismatch" in e for e in failures.values()), failures
