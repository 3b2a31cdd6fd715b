"""The processes of ``tests/reliability/test_concurrent.py``: writer ranks and readers on one
shared root.

Usage::

    python concurrent_child.py writer --root ROOT --ctl CTL --name NAME --world N --rank R \\
        --init FILE --first A --last B [--keep-last K] [--go NAME] [--restore-first]
        [--final-restore] [--opened] [--tolerate-failures] [--pause-ms MS]
        [--hold-prune STEP | --hold-create-temp STEP] [--release NAME,...]
        [--scrub-after-dir STEP]
    python concurrent_child.py reader --root ROOT --ctl CTL --name NAME --world N

Every process touches ``CTL/ready-NAME`` once it imported torch, and writes ``CTL/out-NAME.json``
at the end. ``CTL`` is the control directory, beside the checkpoint root, never inside it.

A **writer** is rank R of a world of N ranks: it waits for ``CTL/go`` (or ``CTL/NAME`` of ``--go NAME``),
joins a gloo process group (``init_process_group`` with ``file://FILE``), opens
``CheckpointPipeline(ROOT, keep_last=K)`` (which coordinates over torch.distributed: real commit
votes and confirmations between the processes) and saves steps A..B, waiting for each commit.

- In a subscriber of the pipeline's events it appends each committed step to its journal,
  ``CTL/journal-R``, on the pipeline's thread, when ``CheckpointCommitted`` is emitted: after
  the commit confirmation (every rank's commit record is durable) and before the retain stage
  of that step runs. No rank removes a step before it journaled a newer one: the journals are
  the readers' witness of progress.
- Once ``result()`` returned it appends the step to ``CTL/ack-R`` (what the job knows to be
  acknowledged).
- ``--opened``: touch ``CTL/opened-NAME`` once ``open()`` returned (its start-up scrub done).
- Its first ``TemporariesScrubbed`` event touches ``CTL/scrubbed-NAME`` (its start-up scrub
  removed something and returned).
- ``--retry-locked``: when the root's lock for this rank is held by another live process
  (``RootInUseError``: the previous job's process still finishing), touch ``CTL/refused-NAME``,
  record the refusal and open again every 50 ms, as a requeued job waiting for its old copy.
- ``--restore-first``: ``restore_latest`` right after opening, as a restarted job does; the
  output has the step restored and every value that differs from that step's.
- ``--hold-prune STEP``: the storage stops right after the retain stage removed this rank's
  commit record of STEP (the manifest and shard still there), touches ``CTL/held-NAME`` and
  waits until every ``CTL/NAME`` of ``--release`` exists: a rank caught in the middle of
  pruning, made certain (at most ``HOLD_MAX_S``). ``--hold-create-temp STEP`` does the same
  before the first temporary of STEP is created; ``--scrub-after-dir STEP`` makes the start-up
  scrub list the root only once STEP's directory exists (``OrderedStorage``).
- ``--pause-ms MS``: sleep up to MS (uniformly drawn) before each save, as training would.
- ``--tolerate-failures``: a save that fails is recorded in the output, not fatal.
- ``--final-restore``: after the last save and ``close()``, a fresh pipeline restores into a
  state of zeros and reports the step and every value that differs.

``CKPT_PIPELINE_CRASH_AT`` in the environment kills a writer at a labelled point.

A **reader** takes observations of the root until ``CTL/stop`` exists, then two more. Each is
checked against the rules in the docstrings of ``Reader.observe_set`` (recovery functions: a
complete set survives, never torn) and ``Reader.observe_tools`` (``ckpt-pipeline ls`` and
``verify``, every ``TOOLS_EVERY``-th observation); every breach is recorded in its output with
the evidence. It only reads.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import io
import json
import logging
import os
import random
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

import ckpt_pipeline as cp
from ckpt_pipeline._format.documents import decode_commit
from ckpt_pipeline._format.names import commit_name
from ckpt_pipeline._format.scan import StepStatus, decode_contents, scan
from ckpt_pipeline._restore.read import LoadedShard, read_shard
from ckpt_pipeline.cli import main as cli_main
from ckpt_pipeline.events import CheckpointCommitted, Event, TemporariesScrubbed
from ckpt_pipeline.storage import FileInfo

W_NUMEL = 8192  # 32 KiB of float32
IDS_NUMEL = 1000
SAMPLES_PER_STEP = 32
HOLD_MAX_S = float(os.environ.get("CKPT_TEST_HOLD_MAX_S", "60"))
WAIT_MAX_S = 90.0
TOOLS_EVERY = 4
"""A reader runs the command-line tools every this many observations."""
MAX_SECONDS = 110.0
"""A child dumps its stacks and exits by then, so that a hang shows where it waits."""


# ---------------------------------------------------------------- values saved

def expected(step: int, rank: int) -> dict[str, torch.Tensor]:
    """The tensors of ``step`` on ``rank``: exact, and unique per (step, rank)."""
    return {"w": torch.arange(W_NUMEL, dtype=torch.float32).add_(step * 16 + rank),
            "ids": torch.arange(IDS_NUMEL, dtype=torch.int64).mul_(step).add_(rank)}


def train_state(step: int) -> cp.TrainState:
    return cp.TrainState(step=step, consumed_train_samples=step * SAMPLES_PER_STEP,
                         extra={"tag": f"step-{step}"})


def train_state_ok(ts: cp.TrainState, step: int) -> bool:
    want = train_state(step)
    return (ts.step, ts.consumed_train_samples, dict(ts.extra)) == (
        want.step, want.consumed_train_samples, dict(want.extra))


def zeros() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(W_NUMEL), "ids": torch.zeros(IDS_NUMEL, dtype=torch.int64)}


# ---------------------------------------------------------------- control files

def touch(path: Path) -> None:
    path.write_text(f"{time.time()}\n")


def wait_for(paths: Sequence[Path], max_s: float) -> bool:
    deadline = time.monotonic() + max_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def append_line(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text + "\n")


def read_steps(path: Path) -> list[int]:
    """The complete lines of a journal or ack file (a line being written is skipped)."""
    try:
        data = path.read_text()
    except FileNotFoundError:
        return []
    lines = data.split("\n")[:-1]
    return [int(x) for x in lines if x]


def write_json(path: Path, data: dict[str, Any]) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(data, indent=1))
    os.replace(temp, path)


def error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


# ---------------------------------------------------------------- writer

class OrderedStorage(cp.LocalStorage):
    """The real local storage, which waits for control files at chosen calls.

    - ``hold_prune``: after removing this rank's commit record of that step (the retain stage;
      the manifest and shard are still there), touch ``held`` and wait for ``release``;
    - ``hold_create_temp``: before creating a temporary in that step's directory, wait for
      ``release``;
    - ``scrub_after_dir``: the first listing of the root (the start-up scrub's) waits until
      that step's directory exists.

    Each wait happens once, and gives up after ``HOLD_MAX_S``; ``holds`` records them.
    """

    def __init__(self, root: Path, rank: int, held: Path, release: Sequence[Path], *,
                 hold_prune: int | None, hold_create_temp: int | None,
                 scrub_after_dir: int | None) -> None:
        super().__init__(root)
        self.rank = rank
        self.held = held
        self.release = release
        self.hold_prune = hold_prune
        self.hold_create_temp = hold_create_temp
        self.scrub_after_dir = scrub_after_dir
        self.holds: list[dict[str, Any]] = []
        self._waited: set[str] = set()

    def _wait(self, what: str, paths: Sequence[Path]) -> None:
        if what in self._waited:
            return
        self._waited.add(what)
        started = time.time()
        touch(self.held)
        released = wait_for(paths, HOLD_MAX_S)
        self.holds.append({"what": what, "held_unix": started, "released_unix": time.time(),
                           "released": released})

    def unlink(self, rel: str) -> None:
        super().unlink(rel)
        if self.hold_prune is not None and rel == os.path.join(
                f"step-{self.hold_prune:010d}", commit_name(self.rank)):
            self._wait("prune", self.release)

    def create_temp(self, rel_dir: str, final_name: str) -> tuple[int, str]:
        if self.hold_create_temp is not None and rel_dir == f"step-{self.hold_create_temp:010d}":
            self._wait("create_temp", self.release)
        return super().create_temp(rel_dir, final_name)

    def list_dir(self, rel: str) -> list[FileInfo]:
        if self.scrub_after_dir is not None and rel == "":
            self._wait("scrub", [self.root / f"step-{self.scrub_after_dir:010d}"])
        return super().list_dir(rel)


def run_writer(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    ctl: Path = args.ctl
    rank = args.rank
    out: dict[str, Any] = {"rank": rank, "acked": [], "scrubbed": [], "restored": None,
                           "final": None, "holds": [], "failed": [], "refused": []}
    touch(ctl / f"ready-{args.name}")
    if not wait_for([ctl / args.go], WAIT_MAX_S):
        raise RuntimeError(f"{args.go} never came")
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=60))
    storage = OrderedStorage(args.root, rank, ctl / f"held-{args.name}",
                             [ctl / n for n in args.release.split(",") if n],
                             hold_prune=args.hold_prune,
                             hold_create_temp=args.hold_create_temp,
                             scrub_after_dir=args.scrub_after_dir)
    journal = ctl / f"journal-{rank}"

    def on_event(event: Event) -> None:
        if isinstance(event, CheckpointCommitted):
            append_line(journal, str(event.step))
        elif isinstance(event, TemporariesScrubbed):
            out["scrubbed"].append(os.path.relpath(event.path, args.root))
            touch(ctl / f"scrubbed-{args.name}")

    deadline = time.monotonic() + WAIT_MAX_S
    # One control-plane group for every attempt: creating it is a collective of all ranks.
    coordinator = cp.DistributedCoordinator(timeout_s=30)
    while True:
        pipe = cp.CheckpointPipeline(args.root, keep_last=args.keep_last, storage=storage,
                                     coordinator=coordinator, restore_rng=False)
        pipe.subscribe(on_event)
        try:
            pipe.open()
        except cp.RootInUseError as exc:
            if not args.retry_locked or time.monotonic() > deadline:
                raise
            out["refused"].append(str(exc))
            touch(ctl / f"refused-{args.name}")
            time.sleep(0.05)
            continue
        break
    state = zeros()
    with pipe:
        if args.opened:
            touch(ctl / f"opened-{args.name}")
        if args.restore_first:
            result = pipe.restore_latest(state)
            out["restored"] = None if result is None else {
                "step": result.step, "train_state_ok": train_state_ok(result.train_state,
                                                                        result.step),
                "mismatches": [k for k, v in expected(result.step, rank).items()
                               if not torch.equal(state[k], v)]}
        rng = random.Random(rank)
        for step in range(args.first, args.last + 1):
            time.sleep(rng.uniform(0, args.pause_ms / 1000))  # a training step, of sorts
            for name, value in expected(step, rank).items():
                state[name].copy_(value)
            try:
                pipe.save(step, state, train_state(step)).result(60)
            except cp.CheckpointError as exc:
                if not args.tolerate_failures:
                    raise
                out["failed"].append({"step": step, "error": f"{type(exc).__name__}: {exc}"})
                continue
            append_line(ctl / f"ack-{rank}", str(step))
            out["acked"].append(step)
    out["holds"] = storage.holds
    if args.final_restore:
        live = zeros()
        with cp.CheckpointPipeline(args.root, restore_rng=False,
                                   coordination_timeout_s=30) as fresh:
            result = fresh.restore_latest(live)
        out["final"] = None if result is None else {
            "step": result.step,
            "train_state_ok": train_state_ok(result.train_state, result.step),
            "mismatches": [k for k, v in expected(result.step, rank).items()
                           if not torch.equal(live[k], v)]}
    return out


# ---------------------------------------------------------------- reader

def journal_max(ctl: Path, world: int) -> int | None:
    """The newest step any rank journaled as confirmed (None before the first)."""
    steps = [s for r in range(world) for s in read_steps(ctl / f"journal-{r}")]
    return max(steps, default=None)


def commit_save_id(storage: cp.LocalStorage, step: int, rank: int) -> str | None:
    """The save id in this rank's commit record of ``step``, None when it is not there."""
    path = storage.root / f"step-{step:010d}" / commit_name(rank)
    try:
        data = path.read_bytes()
        return str(decode_commit(data, str(path)).save_id)
    except (OSError, cp.CheckpointError):
        return None


async def _read_shard(storage: cp.LocalStorage, status: StepStatus,
                      rank: int) -> LoadedShard:
    return await read_shard(storage, status, rank, threads=1,
                                      limiter=anyio.CapacityLimiter(1))


def read_exact(portal: BlockingPortal, storage: cp.LocalStorage,
               status: StepStatus, rank: int) -> tuple[str, str | None]:
    """Read and verify one rank's shard of a step: ("ok"|"error"|"wrong", detail)."""
    try:
        loaded = portal.call(_read_shard, storage, status, rank)
        _tree, ts = decode_contents(status, rank)
    except cp.CheckpointError as exc:
        return "error", f"{type(exc).__name__}: {exc}"
    want = expected(status.step, rank)
    got = {rec.path: t for rec, t in zip(loaded.header.tensors, loaded.tensors, strict=True)}
    wrong = [k for k, v in want.items() if k not in got or not torch.equal(got[k], v)]
    if wrong or set(got) != set(want) or not train_state_ok(ts, status.step):
        return "wrong", f"tensors {wrong} or train state {ts} differ from step {status.step}"
    return "ok", None


class Reader:
    def __init__(self, root: Path, ctl: Path, world: int, portal: BlockingPortal) -> None:
        self.portal = portal  # one event loop for every read (anyio.run costs ~20 ms a call)
        self.root = root
        self.ctl = ctl
        self.world = world
        self.storage = cp.LocalStorage(root)
        self.stats: dict[str, Any] = {
            "observations": 0, "with_commit": 0, "stable": 0, "progress_during": 0,
            "found": 0, "found_while_progress": 0, "fell_back": 0, "read_raced_prune": 0,
            "tools_rounds": 0, "tools_stable": 0, "cli_calls": 0,
            "ls_corrupt_raced_prune": 0, "verify_skipped": 0, "verify_exit_1": 0,
            "verify_failed_raced_prune": 0,
            "steps_found": [],
        }
        self.violations: list[dict[str, Any]] = []

    def violation(self, rule: str, **evidence: Any) -> None:
        if len(self.violations) < 50:
            self.violations.append({"rule": rule, "unix": time.time(), **evidence})

    def cli(self, *argv: str, codes: tuple[int, ...] = (0, 1)) -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        self.stats["cli_calls"] += 1
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli_main(list(argv))
        except BaseException as exc:  # cli.main turns every CheckpointError into exit 1
            self.violation("tools never crash", argv=list(argv), error=error_text(exc))
            return -1, ""
        if code not in codes:
            self.violation(f"tools exit with one of {codes}", argv=list(argv), code=code,
                           stderr=err.getvalue())
        return code, out.getvalue()

    def observe_safely(self, tools: bool) -> None:
        try:
            self.observe_set()
            if tools:
                self.observe_tools()
        except BaseException as exc:  # the recovery functions raise CheckpointError only
            self.violation("reading never raises anything but CheckpointError",
                           error=error_text(exc))

    def observe_set(self) -> None:
        """One observation with the recovery functions, and the rules it must satisfy.

        ``c0`` and ``c1`` are the newest journaled step before and after the observation.
        Every rank journals a step after every rank's commit record of it is durable and
        before it prunes anything for it, so if ``c1 == c0`` nobody removed a file of step
        ``c0`` (or newer) during the observation: the newest complete set must be seen whole.
        When ``c1 > c0`` a rank may have pruned between our reads of two ranks (a step seen
        on rank 0 gone when rank 1 is read, a shard gone between scan and read), so not
        finding a set is then expected; what was read must still be exact.

        1. A complete set survives: if ``c1 == c0``, some step >= ``c0`` is valid on every
           rank with one save id and reads back exactly (tensors and TrainState) on every
           rank. Candidates are tried newest first, as ``restore_latest`` does.
        2. Never torn: a shard that reads without error holds exactly the values of its
           (step, rank); a read that fails while the rank's commit record of the step is still
           there (same save id) afterwards is a corrupt complete step. Every removal (prune,
           a failed save's clean-up) takes the commit record first, so a read that raced one
           finds it gone.
        """
        st = self.stats
        st["observations"] += 1
        c0 = journal_max(self.ctl, self.world)
        scans = [scan(self.storage, r) for r in range(self.world)]
        by_rank = [{s.step: s for s in statuses if s.valid} for statuses in scans]
        common = sorted(set.intersection(*(set(v) for v in by_rank)), reverse=True)
        found: int | None = None
        tried: list[dict[str, Any]] = []
        for step in common:
            statuses = [by_rank[r][step] for r in range(self.world)]
            if c0 is not None and step < c0:
                break
            if len({s.save_id for s in statuses}) != 1 or any(
                    s.world_size != self.world for s in statuses):
                tried.append({"step": step, "why": "save ids or world sizes differ"})
                continue
            outcomes = [read_exact(self.portal, self.storage, statuses[r], r)
                        for r in range(self.world)]
            for r, (what, detail) in enumerate(outcomes):
                if what == "wrong":
                    self.violation("never torn: exact values", step=step, rank=r, detail=detail)
                elif what == "error":
                    if commit_save_id(self.storage, step, r) == statuses[r].save_id:
                        self.violation("never torn: a complete step reads back", step=step,
                                       rank=r, detail=detail)
                    else:
                        st["read_raced_prune"] += 1
            if all(what == "ok" for what, _ in outcomes):
                found = step
                break
            tried.append({"step": step, "outcomes": outcomes})
        c1 = journal_max(self.ctl, self.world)
        if c0 is None:
            return
        st["with_commit"] += 1
        if c1 != c0:
            st["progress_during"] += 1
        else:
            st["stable"] += 1
            if found is None:
                self.violation("a complete set survives", c0=c0, common=common, tried=tried,
                               valid_by_rank=[sorted(v) for v in by_rank])
        if found is not None:
            st["found"] += 1
            st["found_while_progress"] += c1 != c0
            st["fell_back"] += bool(tried)
            if found not in st["steps_found"]:
                st["steps_found"].append(found)

    def observe_tools(self) -> None:
        """``ckpt-pipeline ls --json`` and ``verify --json`` of every rank, and their rules.

        3. They never raise, exit 0 (``verify``: or 1 while steps are being confirmed and
           pruned, or 2 before the first commit), never call a step whose commit record is
           still there corrupt or failed, and when ``c1 == c0`` show step ``c0`` complete and
           verify it (or a newer one).
        """
        c0 = journal_max(self.ctl, self.world)
        ls_rows = self.check_ls()
        verify_codes = self.check_verify(c0)
        c1 = journal_max(self.ctl, self.world)
        self.stats["tools_rounds"] += 1
        if c0 is None or c1 != c0:
            return
        self.stats["tools_stable"] += 1
        for r, rows in enumerate(ls_rows):
            if rows is not None and not any(row["step"] == c0 and row["status"] ==
                                            "complete" for row in rows):
                self.violation("ls shows the newest complete set", c0=c0, rank=r,
                               rows=[(row["step"], row["status"]) for row in rows])
        for r, code in enumerate(verify_codes):
            if code != 0:
                self.violation("verify passes while nothing is confirmed", c0=c0, rank=r,
                               code=code)

    def check_ls(self) -> list[list[dict[str, Any]] | None]:
        out: list[list[dict[str, Any]] | None] = []
        for r in range(self.world):
            code, text = self.cli("ls", str(self.root), "--rank", str(r), "--json")
            if code != 0:
                if code != -1:
                    self.violation("ls exits 0", rank=r, code=code)
                out.append(None)
                continue
            rows: list[dict[str, Any]] = json.loads(text)["steps"]
            for row in rows:
                if row["status"] != "corrupt":
                    continue
                now = commit_save_id(self.storage, row["step"], r)
                if now is not None and row["save_id"] in (None, now):
                    self.violation("ls never calls a complete step corrupt", rank=r, row=row)
                else:
                    self.stats["ls_corrupt_raced_prune"] += 1
            out.append(rows)
        return out

    def check_verify(self, c0: int | None) -> list[int]:
        codes: list[int] = []
        for r in range(self.world):
            # Exit 2, "no checkpoints under the root", only before the first commit.
            code, text = self.cli("verify", str(self.root), "--rank", str(r), "--json",
                                  codes=(0, 1) if c0 is not None else (0, 1, 2))
            codes.append(code)
            if code == 1:
                self.stats["verify_exit_1"] += 1
            if code not in (0, 1) or not text.strip():
                continue
            for res in json.loads(text)["results"]:
                if res["result"] == "skipped":
                    self.stats["verify_skipped"] += 1
                elif res["result"] == "failed":
                    now = commit_save_id(self.storage, res["step"], r)
                    if now is not None and res["save_id"] in (None, now):
                        self.violation("verify never fails a complete step", rank=r,
                                       result=res)
                    else:
                        self.stats["verify_failed_raced_prune"] += 1
        return codes


def run_reader(args: argparse.Namespace) -> dict[str, Any]:
    with start_blocking_portal() as portal:
        return _read_until_stopped(Reader(args.root, args.ctl, args.world, portal), args)


def _read_until_stopped(reader: Reader, args: argparse.Namespace) -> dict[str, Any]:
    touch(args.ctl / f"ready-{args.name}")
    stop = args.ctl / "stop"
    started = time.monotonic()
    while not args.root.exists() and not stop.exists():  # the first writer creates it
        time.sleep(0.002)
    rounds = 0
    while not stop.exists():
        reader.observe_safely(tools=rounds % TOOLS_EVERY == 0)
        rounds += 1
        if time.monotonic() - started > WAIT_MAX_S:
            reader.violation("the test stops the readers in time")
            break
    for _ in range(2):  # the writers are done: nothing moves, every rule must hold
        reader.observe_safely(tools=True)
    return {"stats": reader.stats, "violations": reader.violations}


# ---------------------------------------------------------------- main

def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("role", choices=("writer", "reader"))
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--ctl", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--init", type=Path)
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--last", type=int, default=0)
    parser.add_argument("--keep-last", type=int, default=1)
    parser.add_argument("--pause-ms", type=float, default=30.0)
    parser.add_argument("--go", default="go")
    parser.add_argument("--restore-first", action="store_true")
    parser.add_argument("--final-restore", action="store_true")
    parser.add_argument("--opened", action="store_true")
    parser.add_argument("--retry-locked", action="store_true")
    parser.add_argument("--hold-prune", type=int)
    parser.add_argument("--release", default="")
    parser.add_argument("--hold-create-temp", type=int)
    parser.add_argument("--scrub-after-dir", type=int)
    parser.add_argument("--tolerate-failures", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = _parse(argv)
    cp.enable_logging(logging.ERROR)
    faulthandler.dump_traceback_later(MAX_SECONDS, exit=True)
    torch.set_num_threads(1)
    out_path = args.ctl / f"out-{args.name}.json"
    try:
        out = run_writer(args) if args.role == "writer" else run_reader(args)
    except BaseException as exc:
        write_json(out_path, {"error": error_text(exc)})
        return 1
    write_json(out_path, out)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's teardown (and gloo's): every result is written by now
