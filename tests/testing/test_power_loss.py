"""Power loss: the power is cut at random storage calls of a saving loop, again and again.

``PowerLossStorage`` (``ckpt_pipeline.testing``) keeps a model of what each ``fsync`` and
``fsync_dir`` made durable. At the cut every storage call starts failing; the pipeline is closed
and one possible post-crash disk image is written (``materialize``): durable state plus a random
subset of everything that was not fsynced, with writes kept, dropped or torn. A pipeline opened
on the image must restore a step no older than the newest acknowledged one (its ``result()``
returned, so its fsyncs had returned), with exactly that step's tensors and TrainState, leave no
temporaries, and save and restore again.

``CKPT_POWER_CUTS`` (default 200) sets the number of cuts, ``CKPT_POWER_SEED`` the first case's
seed (case i uses seed + i; a failure prints its seed: rerun it alone with
``CKPT_POWER_SEED=<seed> CKPT_POWER_CUTS=1``), ``CKPT_POWER_RECOVERY_CUTS`` (default a quarter
of the cuts) the second cuts, during the recovery of a crashed image, and ``CKPT_POWER_REPORT``
a file for the figures. Half the cases cut at a uniformly random call index, half at a random
occurrence of a phase drawn per category of phases (so that one-call windows, such as a commit
record published but its directory not yet fsynced, are hit often). Thread timing can move a
uniform cut by a call or two between runs; a targeted cut lands on the same phase. Each image
is drawn from its own seeded RNG.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.testing import (
    CrashImage,
    PowerCut,
    PowerLossStorage,
    StorageCall,
)

CUTS = int(os.environ.get("CKPT_POWER_CUTS", "200"))
SEED = int(os.environ.get("CKPT_POWER_SEED", "20261129"))
REPORT = os.environ.get("CKPT_POWER_REPORT")
"""When set, the figures of the run are also written to this file (markdown)."""
STEPS = 5
OPTIONS: dict[str, Any] = {"keep_last": 2, "chunk_bytes": 4096, "io_threads": 2,
                           "restore_rng": False}
STEP_DIR = re.compile(r"^step-([0-9]{10,})$")
COMMIT = "rank-00000.commit"


# ---------------------------------------------------------------------- the saved state


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(24, 64, generator=g), "b": torch.randn(64, generator=g)},
        "optimizer": {"m": torch.randn(1000, generator=g).half(),
                      "count": torch.tensor([step], dtype=torch.int64)},
    }


def _zeros() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(24, 64), "b": torch.zeros(64)},
        "optimizer": {"m": torch.zeros(1000, dtype=torch.float16),
                      "count": torch.zeros(1, dtype=torch.int64)},
    }


def _train_state(step: int) -> cp.TrainState:
    return cp.TrainState(step=step, consumed_train_samples=32 * step,
                         extra={"run": "power-loss", "tag": f"step-{step}", "loss": 1.0 / step})


def _exactly(live: dict[str, Any], result: cp.RestoreResult) -> str | None:
    """None when ``live`` and the TrainState are exactly what was saved at the step."""
    want = _state(result.step)
    for group, tensors in want.items():
        for name, tensor in tensors.items():
            got = live[group][name]
            if got.dtype != tensor.dtype or not torch.equal(got, tensor):
                return f"tensor {group}/{name} differs from step {result.step}'s"
    ts, exp = result.train_state, _train_state(result.step)
    if (ts.step, ts.consumed_train_samples, ts.extra) != (
            exp.step, exp.consumed_train_samples, exp.extra):
        return f"train state {ts} differs from step {result.step}'s {exp}"
    return None


def _temporaries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*.tmp-*"))


# ---------------------------------------------------------------------- phases of a save


def _what(call: StorageCall) -> str:
    if ".tmp-" in call.name:
        return "temporary"
    for kind in ("shard", "manifest", "commit"):
        if call.name.endswith("." + kind):
            return kind
    return "dir" if call.kind in ("make_dir", "rmdir", "fsync_dir", "list_dir") else ""


_ADVANCE = {  # (kind, file) -> the stage of the step directory once the call has returned
    ("make_dir", "dir"): "dir created",
    ("create_temp", "shard"): "shard being written",
    ("fsync", "shard"): "shard fsynced",
    ("publish", "shard"): "shard published",
    ("create_temp", "manifest"): "manifest being written",
    ("publish", "manifest"): "manifest published",
    ("create_temp", "commit"): "commit record being written",
    ("publish", "commit"): "commit record published",
    ("unlink", "commit"): "pruning",
    ("rmdir", "dir"): "dir removed",
}
_AFTER_DIR_FSYNC = {"manifest published": "shard and manifest durable",
                    "commit record published": "committed", "pruning": "pruned, dir fsynced"}

CATEGORIES = {
    "(new)": "1 before the shard is durable",
    "dir created": "1 before the shard is durable",
    "shard being written": "1 before the shard is durable",
    "shard fsynced": "2 shard fsynced, not yet durable under its name",
    "shard published": "2 shard fsynced, not yet durable under its name",
    "manifest being written": "2 shard fsynced, not yet durable under its name",
    "manifest published": "2 shard fsynced, not yet durable under its name",
    "shard and manifest durable": "3 shard and manifest durable, commit record not published",
    "commit record being written": "3 shard and manifest durable, commit record not published",
    "commit record published": "4 commit record published, its directory not yet fsynced",
    "committed": "5 committed: acknowledgement, retention scan",
    "pruning": "6 pruning an old step",
    "pruned, dir fsynced": "6 pruning an old step",
    "dir removed": "6 pruning an old step",
    "root": "7 root directory: space check, listing, root fsync",
    "read": "5 committed: acknowledgement, retention scan",
    "after the last save": "8 after the last save",
}


class Phases:
    """Names the moment of each storage call: the stage its step directory had reached."""

    def __init__(self) -> None:
        self.stage: dict[str, str] = {}
        self.last: dict[int, StorageCall] = {}

    def feed(self, call: StorageCall) -> str:
        label = self._label(call)
        self._advance(call)
        self.last[call.thread] = call
        return label

    @staticmethod
    def _step_dir(call: StorageCall) -> str | None:
        first = call.path.split("/", 1)[0]
        return first if STEP_DIR.match(first) else None

    def _label(self, call: StorageCall) -> str:
        d = self._step_dir(call)
        what = _what(call)
        if d is not None:
            return f"{self.stage.get(d, '(new)')} | {call.kind} {what}".rstrip()
        if call.path.startswith("<fd"):
            return f"read | {call.kind}"
        prev = self.last.get(call.thread)
        if call.kind == "fsync_dir" and prev is not None and prev.kind in ("make_dir", "rmdir"):
            return f"root | fsync_dir root after {prev.kind}"
        return f"root | {call.kind}"

    def _advance(self, call: StorageCall) -> None:
        d = self._step_dir(call)
        if d is None:
            return
        key = (call.kind, _what(call))
        if key in _ADVANCE:
            if key == ("unlink", "commit") and self.stage.get(d) != "committed":
                return  # a failed save's clean-up, not pruning
            self.stage[d] = _ADVANCE[key]
        elif call.kind == "fsync_dir" and self.stage.get(d) in _AFTER_DIR_FSYNC:
            self.stage[d] = _AFTER_DIR_FSYNC[self.stage[d]]


def _category(label: str) -> str:
    return CATEGORIES.get(label.split(" | ", 1)[0], "9 other")


# ---------------------------------------------------------------------- one case


@dataclass
class Outcome:
    seed: int
    mode: str
    label: str
    acked: int | None
    published: int | None
    restored: int | None
    rejected: int
    scrubbed: int
    moved_aside: int
    image: CrashImage
    seconds: float


def _save_loop(storage: PowerLossStorage, root: Path, rng: random.Random,
               steps: range) -> list[cp.SaveHandle]:
    """Save ``steps`` (some waited for, some overlapping) until the power goes off."""
    handles: list[cp.SaveHandle] = []
    pipe = cp.CheckpointPipeline(root, storage=storage, **OPTIONS)
    try:
        pipe.open()
    except cp.CheckpointError:
        assert storage.is_cut
        return handles
    try:
        for step in steps:
            try:
                handle = pipe.save(step, _state(step), _train_state(step))
            except cp.CheckpointError:
                assert storage.is_cut, "save() raised with the power on"
                break
            handles.append(handle)
            if rng.random() < 0.5:
                handle.exception(60)  # waited for: acknowledged if it succeeded
        with contextlib.suppress(cp.CheckpointError):
            pipe.wait(60)
    finally:
        pipe.close()
    return handles


def _acked(handles: list[cp.SaveHandle]) -> int | None:
    return max((h.step for h in handles if h.exception(60) is None), default=None)


def _published_commit(storage: PowerLossStorage) -> int | None:
    """The newest step whose commit record had been published before the cut."""
    steps = [int(m.group(1)) for c in storage.calls()
             if c.kind == "publish" and c.name == COMMIT
             and (m := STEP_DIR.match(c.path.split("/", 1)[0]))]
    return max(steps, default=None)


def _check_image(root: Path, acked: int | None, where: str, *, corrupted: int | None = None
                 ) -> tuple[cp.RestoreResult | None, list[cp.Event]]:
    """Reopen, restore, check; then a further save and restore on the image.

    ``corrupted``: a step whose shard the test damaged on purpose (it must be rejected).
    """
    events: list[cp.Event] = []
    pipe = cp.CheckpointPipeline(root, **OPTIONS)
    pipe.subscribe(events.append)
    pipe.open()
    try:
        live = _zeros()
        result = pipe.restore_latest(live)
        if acked is not None:
            assert result is not None, f"{where}: step {acked} was acknowledged, nothing restored"
            assert result.step >= acked, (
                f"{where}: restored step {result.step}, older than the acknowledged {acked}")
        if result is not None:
            problem = _exactly(live, result)
            assert problem is None, f"{where}: step {result.step} restored wrong: {problem}"
            assert result.step != corrupted, f"{where}: the damaged step {corrupted} loaded"
            newer = [r for r in result.rejected if r.step > result.step and r.step != corrupted]
            assert not newer, f"{where}: a newer commit record survived without its data: {newer}"
        leftovers = _temporaries(root)
        assert not leftovers, f"{where}: temporaries after the reopen: {leftovers}"
        following = (result.step if result is not None else 0) + 1
        pipe.save(following, _state(following), _train_state(following)).result(60)
    finally:
        pipe.close()
    with cp.CheckpointPipeline(root, **OPTIONS) as again:
        live = _zeros()
        second = again.restore_latest(live)
        assert second is not None and second.step == following, (
            f"{where}: the save of step {following} after recovery restored as "
            f"{None if second is None else second.step}")
        assert _exactly(live, second) is None, where
    return result, events


@dataclass(frozen=True)
class Probe:
    total: int
    labels: dict[str, int]


def _probe(base: Path) -> Probe:
    """One uncut run: how many calls, and how many of each phase."""
    storage = PowerLossStorage(base / "probe")
    phases = Phases()
    counts: collections.Counter[str] = collections.Counter()

    def watch(call: StorageCall) -> bool:
        counts[phases.feed(call)] += 1
        return False

    storage.arm(cut_if=watch)
    _save_loop(storage, storage.root, random.Random(0), range(1, STEPS + 1))
    return Probe(len(storage.calls()), dict(counts))


def _case(index: int, base: Path, probe: Probe) -> Outcome:
    started = time.perf_counter()
    seed = SEED + index
    rng = random.Random(seed)
    storage = PowerLossStorage(base / f"case-{index}" / "disk")
    phases = Phases()
    counts: collections.Counter[str] = collections.Counter()
    if rng.random() < 0.5:  # a few land after the last call: nothing is volatile then
        at = rng.randint(1, probe.total + probe.total // 20)
        mode, target, occurrence = "uniform", "", 0
    else:  # a phase category, a phase in it, an occurrence of it
        category = rng.choice(sorted({_category(label) for label in probe.labels}))
        target = rng.choice(sorted(x for x in probe.labels if _category(x) == category))
        mode, at, occurrence = "targeted", 0, rng.randint(1, probe.labels[target])
    hit: list[str] = []

    def trigger(call: StorageCall) -> bool:
        label = phases.feed(call)
        counts[label] += 1
        if call.index == at or (label == target and counts[label] == occurrence):
            hit.append(label)
            return True
        return False

    storage.arm(cut_if=trigger)
    handles = _save_loop(storage, storage.root, rng, range(1, STEPS + 1))
    if not storage.is_cut:
        storage.cut()
        hit.append("after the last save")
    acked = _acked(handles)
    published = _published_commit(storage)
    image = storage.materialize(base / f"case-{index}" / "image", random.Random(seed * 7919))
    where = (f"seed={seed} ({mode} cut at {hit[0]!r}, acknowledged up to {acked}, commit "
             f"published up to {published}, image {image})")
    result, events = _check_image(image.root, acked, where)
    restored = None if result is None else result.step
    moved = len([p for p in image.root.iterdir() if ".rejected-" in p.name])
    return Outcome(seed, mode, hit[0], acked, published, restored,
                   rejected=len(result.rejected) if result is not None else 0,
                   scrubbed=sum(isinstance(e, cp.TemporariesScrubbed) for e in events),
                   moved_aside=moved, image=image, seconds=time.perf_counter() - started)


# ---------------------------------------------------------------------- the suite


def _older(a: int | None, b: int | None) -> bool:
    return a is not None and b is not None and a < b


def _report(outcomes: list[Outcome], seconds: float) -> str:
    by_category = collections.Counter(_category(o.label) for o in outcomes)
    by_kind = collections.Counter(o.label.split(" | ", 1)[-1] for o in outcomes)
    lines = [f"{len(outcomes)} power cuts in {seconds:.1f} s "
             f"({collections.Counter(o.mode for o in outcomes)})", "",
             "| where the cut landed | cuts |", "|---|---|"]
    lines += [f"| {c[2:]} | {n} |" for c, n in sorted(by_category.items())]
    lines += ["", "| refused call | cuts |", "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in by_kind.most_common()]
    rows = [
        ("nothing acknowledged before the cut", sum(o.acked is None for o in outcomes)),
        ("restored exactly the newest acknowledged step",
         sum(o.acked is not None and o.restored == o.acked for o in outcomes)),
        ("restored a newer step, complete but not acknowledged",
         sum(_older(o.acked, o.restored) for o in outcomes)),
        ("restored nothing (nothing acknowledged, nothing complete)",
         sum(o.restored is None for o in outcomes)),
        ("fell back below the newest published commit record (its directory entry lost)",
         sum(_older(o.restored, o.published) for o in outcomes)),
        ("restore rejected a complete-but-invalid step", sum(o.rejected > 0 for o in outcomes)),
        ("start-up scrub removed leftovers", sum(o.scrubbed > 0 for o in outcomes)),
        ("files of a newer step moved aside", sum(o.moved_aside > 0 for o in outcomes)),
        ("volatile writes torn (kept in part)", sum(o.image.torn_writes > 0 for o in outcomes)),
        ("volatile directory changes lost",
         sum(o.image.kept_dir_changes < o.image.volatile_dir_changes for o in outcomes)),
    ]
    lines += ["", "| outcome | images |", "|---|---|"]
    lines += [f"| {text} | {n} |" for text, n in rows]
    return "\n".join(lines)


@pytest.mark.slow
def test_power_cuts_during_saving_never_lose_an_acknowledged_step(tmp_path: Path) -> None:
    started = time.perf_counter()
    probe = _probe(tmp_path)
    assert probe.total > 100, probe
    outcomes = [_case(i, tmp_path, probe) for i in range(CUTS)]
    seconds = time.perf_counter() - started
    report = _report(outcomes, seconds)
    print(f"\nprobe: {probe.total} storage calls for {STEPS} saves\n{report}")
    if REPORT:
        Path(REPORT).write_text(report + "\n")
    if CUTS >= 200:  # the suite must reach the interesting windows, not only the long ones
        categories = collections.Counter(_category(o.label) for o in outcomes)
        for category in set(CATEGORIES.values()) - {"8 after the last save"}:
            assert categories[category] >= 3, (category, categories)
        assert any(_older(o.restored, o.published) for o in outcomes), (
            "no image lost a published commit record")


RECOVERY_CUTS = int(os.environ.get("CKPT_POWER_RECOVERY_CUTS", str(max(1, CUTS // 4))))


def _recover_and_save(storage: PowerLossStorage, root: Path) -> int | None:
    """Open (scrub), restore, save the next step; return it if acknowledged."""
    pipe = cp.CheckpointPipeline(root, storage=storage, **OPTIONS)
    try:
        pipe.open()
    except cp.CheckpointError:
        assert storage.is_cut
        return None
    try:
        try:
            result = pipe.restore_latest(_zeros())
        except cp.CheckpointError:
            assert storage.is_cut, "restore failed with the power on"
            return None
        following = (result.step if result is not None else 0) + 1
        try:
            handle = pipe.save(following, _state(following), _train_state(following))
        except cp.CheckpointError:
            assert storage.is_cut
            return None
        return following if handle.exception(60) is None else None
    finally:
        pipe.close()


def _damage_newest(root: Path) -> int | None:
    """Flip a byte of tensor data in the newest complete step, if an older one is complete."""
    complete = sorted(int(m.group(1)) for p in root.iterdir()
                      if (m := STEP_DIR.match(p.name)) and (p / COMMIT).exists())
    if len(complete) < 2:
        return None
    shard = root / f"step-{complete[-1]:010d}" / "rank-00000.shard"
    with shard.open("r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0x40]))
    return complete[-1]


@pytest.mark.slow
def test_power_cuts_during_recovery_never_lose_a_step(tmp_path: Path) -> None:
    """A second cut while the crashed image is scrubbed, restored and saved to again."""
    started = time.perf_counter()
    labels: collections.Counter[str] = collections.Counter()
    moved = 0
    for index in range(RECOVERY_CUTS):
        seed = SEED + 1_000_000 + index
        rng = random.Random(seed)
        case = tmp_path / f"case-{index}"
        first = PowerLossStorage(case / "disk")
        first.arm(cut_at=rng.randint(1, 230))
        acked = _acked(_save_loop(first, first.root, rng, range(1, STEPS + 1)))
        first.cut()
        image_a = first.materialize(case / "a", random.Random(seed))
        image_b = first.materialize(case / "b", random.Random(seed))  # the same image
        assert _files(image_a.root) == _files(image_b.root), seed
        corrupted = None
        if rng.random() < 0.5:  # then recovery also moves the damaged newest step aside
            corrupted = _damage_newest(image_a.root)
            assert _damage_newest(image_b.root) == corrupted
            acked = None if corrupted is not None else acked
        where = f"seed={seed} (first cut, acknowledged up to {acked}, damaged {corrupted})"
        clean, _ = _check_image(image_a.root, acked, where, corrupted=corrupted)
        floor = None if clean is None else clean.step  # what a recovery must never lose
        second = PowerLossStorage(image_b.root, atomic_rename=rng.random() < 0.5)
        phases = Phases()
        at = rng.randint(1, 90)
        # with a damaged step, often cut inside the move-aside: from the make_dir of the
        # rejected directory through the moves, its fsync, and the removal of the step dir
        aside = rng.randint(0, 10) if corrupted is not None and rng.random() < 0.6 else None
        hit: list[str] = []
        start: list[int] = []

        def trigger(call: StorageCall, at: int = at, aside: int | None = aside,
                    phases: Phases = phases, hit: list[str] = hit,
                    start: list[int] = start) -> bool:
            label = phases.feed(call)
            if call.kind == "make_dir" and ".rejected-" in call.path and not start:
                start.append(call.index)
            now = call.index == at if aside is None else bool(start) and (
                call.index == start[0] + aside)
            if now:
                kind = label.split(" | ", 1)[-1]
                hit.append(f"moving aside: {kind}" if aside is not None else kind)
            return now

        second.arm(cut_if=trigger)
        saved = _recover_and_save(second, image_b.root)
        if not second.is_cut:
            second.cut()
            hit.append("after the save")
        labels[hit[0]] += 1
        image_c = second.materialize(case / "c", random.Random(seed + 1))
        newest = max((s for s in (floor, saved) if s is not None), default=None)
        _check_image(image_c.root, newest,
                     f"{where}, recovery restored {floor}, cut at {hit[0]!r} (call {at}), "
                     f"saved {saved}", corrupted=corrupted)
        moved += any(".rejected-" in p.name for p in image_c.root.iterdir())
    print(f"\n{RECOVERY_CUTS} cuts during recovery in {time.perf_counter() - started:.1f} s: "
          f"{dict(labels.most_common())}; a damaged step moved aside in {moved} images")


# ---------------------------------------------------------------------- the model itself


def _write_file(storage: PowerLossStorage, rel_dir: str, name: str, data: bytes, *,
                fsync: bool = True, publish: bool = True) -> None:
    fd, temp = storage.create_temp(rel_dir, name)
    storage.pwrite(fd, memoryview(data), 0)
    if fsync:
        storage.fsync(fd)
    storage.close(fd)
    if publish:
        storage.publish(rel_dir, temp, name)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_the_model_keeps_only_what_was_fsynced(tmp_path: Path) -> None:
    storage = PowerLossStorage(tmp_path / "disk")
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "old").write_bytes(b"before arm")
    storage.arm()
    storage.make_dir("d")  # mkdir, then fsync of the root: durable
    _write_file(storage, "d", "a", b"A" * 5000)  # fsynced, published, directory not fsynced
    storage.fsync_dir("d")
    _write_file(storage, "d", "b", b"B" * 100)  # fsynced, name not durable
    _write_file(storage, "d", "c", b"C" * 100, fsync=False)  # nothing durable
    storage.unlink("old")  # not durable either
    storage.cut()
    with pytest.raises(PowerCut):
        storage.list_dir("")
    none = storage.materialize(tmp_path / "none", keep=0.0)
    assert _files(none.root) == {"old": b"before arm", "d/a": b"A" * 5000}
    everything = storage.materialize(tmp_path / "all", keep=1.0)
    assert _files(everything.root) == {"d/a": b"A" * 5000, "d/b": b"B" * 100,
                                       "d/c": b"C" * 100}
    # c kept as a name but none of its writes: a never-fsynced file may be empty
    names_only = storage.materialize(tmp_path / "names",
                                     keep=lambda ch: ch.kind != "write")
    assert _files(names_only.root)["d/c"] == b""
    # publish is link + unlink: the image may have the temporary and the final name at once
    both = storage.materialize(tmp_path / "both",
                               keep=lambda ch: not (ch.kind == "unlink" and "tmp" in ch.path))
    names = {p.name for p in (both.root / "d").iterdir()}
    assert {"a", "b", "c"} <= names and any(".b.tmp-" in n for n in names)
    seen = set()
    for seed in range(40):  # random images: any subset of the volatile changes
        image = storage.materialize(tmp_path / f"r{seed}", random.Random(seed))
        files = _files(image.root)
        assert files["d/a"] == b"A" * 5000
        if "d/b" in files:
            assert files["d/b"] == b"B" * 100  # fsynced before it was linked
        if "d/c" in files:
            assert b"B" not in files["d/c"] and len(files["d/c"]) <= 100
            seen.add(len(files["d/c"]) in (0, 100))
        seen.add("old" in files)
    assert seen == {True, False}


def test_a_torn_overwrite_and_a_rename_in_the_model(tmp_path: Path) -> None:
    storage = PowerLossStorage(tmp_path / "disk")
    storage.arm()
    fd, temp = storage.create_temp("", "f")
    storage.pwrite(fd, memoryview(b"x" * 3 * 4096), 0)
    storage.fsync(fd)
    storage.pwrite(fd, memoryview(b"y" * 3 * 4096), 4096)  # extends and overwrites
    storage.close(fd)
    storage.fsync_dir("")
    storage.make_dir("a")
    storage.move(temp, "a/f")  # rename: atomic, durable with either directory's fsync
    storage.fsync_dir("a")
    storage.cut()
    sizes, torn = set(), False
    for seed in range(60):
        image = storage.materialize(tmp_path / f"i{seed}", random.Random(seed))
        files = _files(image.root)
        assert list(files) == ["a/f"], files  # the rename is durable in both directories
        data = files["a/f"]
        assert data[:4096] == b"x" * 4096 and 3 * 4096 <= len(data) <= 4 * 4096
        sizes.add(len(data))
        torn |= b"y" in data[4096:3 * 4096] and b"x" in data[4096:3 * 4096]
    assert torn and len(sizes) > 1


def test_a_truncate_is_volatile_until_fsync_and_its_bytes_read_as_zeros(tmp_path: Path
                                                                       ) -> None:
    """(As zeros when kept whole; a random image may show stale blocks there, as for any
    write that was not fsynced.)"""
    storage = PowerLossStorage(tmp_path / "disk")
    storage.arm()
    fd, temp = storage.create_temp("", "f")
    storage.fsync_dir("")  # the name is durable, the file empty
    storage.truncate(fd, 3 * 4096)  # a download sizes its file up front
    storage.pwrite(fd, memoryview(b"z" * 4096), 4096)
    storage.close(fd)
    storage.cut()
    assert [c.kind for c in storage.calls()][-3:] == ["truncate", "pwrite", "close"]
    lost = _files(storage.materialize(tmp_path / "lost", keep=0.0).root)
    assert lost == {temp: b""}  # nothing was fsynced: neither the size nor the write
    kept = _files(storage.materialize(tmp_path / "kept", keep=1.0).root)
    assert kept == {temp: bytes(4096) + b"z" * 4096 + bytes(4096)}
    sizes = set()
    for seed in range(20):
        data = _files(storage.materialize(tmp_path / f"r{seed}", random.Random(seed)).root)
        sizes.add(len(data[temp]))
    assert max(sizes) <= 3 * 4096 and len(sizes) > 1  # the size itself may be lost


# ---------------------------------------------------------------------- findings


def test_a_cut_refuses_every_call_and_closes_descriptors(tmp_path: Path) -> None:
    storage = PowerLossStorage(tmp_path / "disk")
    storage.arm(cut_at=3)
    fd, _ = storage.create_temp("", "f")
    storage.pwrite(fd, memoryview(b"z"), 0)
    with pytest.raises(PowerCut) as info:
        storage.fsync(fd)
    assert info.value.errno == errno.EIO and storage.cut_call is not None
    assert storage.cut_call.kind == "fsync"
    with pytest.raises(PowerCut):
        storage.close(fd)
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor was closed all the same


def _cut_after_pruning_unlinks() -> Callable[[StorageCall], bool]:
    """Cut at the first call after retention unlinked step 1's commit record, manifest and shard
    (the data unlinks are then still volatile)."""
    unlinked: list[str] = []

    def trigger(call: StorageCall) -> bool:
        if len(unlinked) == 3:
            return True
        if call.kind == "unlink" and call.path.startswith("step-0000000001/"):
            unlinked.append(call.name)
        return False

    return trigger


@pytest.mark.slow
def test_a_pruned_step_never_looks_complete_after_a_power_cut(tmp_path: Path) -> None:
    """Regression (found by this suite): retention fsyncs the step directory right after it
    unlinks the commit record, so a power cut cannot keep the record and lose the data."""
    storage = PowerLossStorage(tmp_path / "disk")
    storage.arm(cut_if=_cut_after_pruning_unlinks())
    _save_loop(storage, storage.root, random.Random(0), range(1, 4))  # step 3 prunes step 1
    assert storage.is_cut and storage.cut_call is not None
    volatile = {(c.kind, c.path) for c in storage.volatile_changes()}
    assert ("unlink", f"step-0000000001/{COMMIT}") not in volatile, volatile
    assert any(kind == "unlink" and path.startswith("step-0000000001/")
               for kind, path in volatile), volatile  # the data unlinks are still volatile
    for seed in range(20):
        image = storage.materialize(tmp_path / f"image{seed}", random.Random(seed))
        step_dir = image.root / "step-0000000001"
        left = sorted(p.name for p in step_dir.iterdir()) if step_dir.exists() else []
        assert COMMIT not in left, (seed, left)  # whatever else survived, never complete
        rejected: list[cp.Event] = []
        with cp.CheckpointPipeline(image.root, **OPTIONS) as pipe:
            pipe.subscribe(rejected.append)
            result = pipe.restore_latest(_zeros())
        assert result is not None and result.step == 3, seed
        assert not [e for e in rejected if isinstance(e, cp.CheckpointRejected)], rejected


def test_a_root_created_with_its_parents_survives_a_power_cut(tmp_path: Path) -> None:
    """Regression (found by this suite): ensure_root fsyncs every directory it creates into
    its parent, top-down, so an acknowledged step never hangs on a never-fsynced entry."""
    disk = tmp_path / "disk"
    disk.mkdir()
    storage = PowerLossStorage(disk / "jobs" / "run-1" / "ckpt", disk=disk)
    storage.arm()
    handles = _save_loop(storage, storage.root, random.Random(1), range(1, 2))
    assert _acked(handles) == 1
    storage.cut()
    volatile = {(c.kind, c.path) for c in storage.volatile_changes()}
    assert not {("mkdir", "jobs"), ("mkdir", "jobs/run-1"), ("mkdir", "jobs/run-1/ckpt")
                } & volatile, volatile
    image = storage.materialize(tmp_path / "image", keep=0.0)  # only what was fsynced
    with cp.CheckpointPipeline(image.root, **OPTIONS) as pipe:
        result = pipe.restore_latest(_zeros())
    assert result is not None and result.step == 1, "the acknowledged step 1 was lost"


def test_a_cut_from_another_thread_at_a_wall_time(tmp_path: Path) -> None:
    """``cut()`` from a timer: no call index, the power just goes off mid-loop."""
    import threading

    for index, delay in enumerate((0.02, 0.05, 0.1)):
        storage = PowerLossStorage(tmp_path / f"t{index}" / "disk")
        storage.arm()
        timer = threading.Timer(delay, storage.cut)
        timer.start()
        handles = _save_loop(storage, storage.root, random.Random(index), range(1, 8))
        timer.join()
        image = storage.materialize(tmp_path / f"t{index}" / "image", random.Random(index))
        _check_image(image.root, _acked(handles), f"timer {delay} s")

