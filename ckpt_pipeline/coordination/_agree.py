"""Agreements between ranks, built on the coordinator's all-gather of msgpack messages.

Every function here is called by every rank, in the same order; each returns the same decision
on every rank, so that no rank can take a path the others do not take.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from .._format.documents import decode_message, encode_message
from ..errors import CheckpointError, CheckpointIntegrityError, CoordinationError
from ._control_plane import Coordinator
from ._runs import Runs

__all__ = ("Ballot", "Candidates", "Opening", "Runs", "Tally", "VotePart", "agree_barrier",
           "agree_candidates", "agree_open", "agree_outcome", "gather_outcome", "gather_parts",
           "gather_shared", "gather_vote")


async def _exchange(coordinator: Coordinator, message: dict[str, Any], *, what: str,
                    step: int | None = None) -> Runs[dict[str, Any]]:
    """Every rank's ``message``, indexed by rank, as runs of equal answers (``Runs``). Each
    distinct message is decoded once, and ranks that sent the same bytes get the same
    object: read the answers, never change them. From the per-node coordinator this costs
    O(runs), not O(ranks)."""
    raw = await coordinator.all_gather(encode_message(message), what=what, step=step)
    if len(raw) != coordinator.world_size:
        raise CoordinationError(f"{what}: {len(raw)} answers for {coordinator.world_size} "
                                "ranks", step=step, rank=coordinator.rank)
    stops: list[int] = []
    out: list[dict[str, Any]] = []
    seen: dict[bytes, dict[str, Any]] = {}
    for rank, stop, payload in (raw if isinstance(raw, Runs) else Runs.of(raw)).runs():
        decoded = seen.get(payload)
        if decoded is None:
            try:
                decoded = decode_message(payload, f"{what} message of rank {rank}")
            except CheckpointIntegrityError as exc:  # a peer's message, not a file on disk
                raise CoordinationError(f"{what}: rank {rank} sent a malformed message "
                                        f"({exc.message})", step=step, rank=coordinator.rank,
                                        hint=_VERSIONS_HINT, ranks=(rank,)) from exc
            seen[payload] = decoded
        stops.append(stop)
        out.append(decoded)
    return Runs(stops, out)


@dataclass(frozen=True, slots=True)
class Opening:
    """What the ranks agreed at open: rank 0's run id and token, every rank's node name and
    copy-server address (None where a rank runs none)."""

    run_id: str
    token: str
    nodes: tuple[str, ...]
    addresses: tuple[tuple[str, int] | None, ...]


async def agree_open(coordinator: Coordinator, node: str,
                     address: tuple[str, int] | None) -> Opening:
    """At open: rank 0's run id and copy token; every rank's node and copy-server address."""
    answers = await _exchange(coordinator, {
        "run_id": secrets.token_hex(8), "token": secrets.token_hex(16), "node": node,
        "address": None if address is None else [address[0], address[1]]}, what="start")
    run_id, token = answers[0].get("run_id"), answers[0].get("token")
    if not isinstance(run_id, str) or not run_id or not isinstance(token, str):
        raise CoordinationError("start: rank 0 sent no run id", rank=coordinator.rank)
    nodes: list[str] = []
    addresses: list[tuple[str, int] | None] = []
    for rank, answer in enumerate(answers):
        name, addr = answer.get("node"), answer.get("address")
        if not isinstance(name, str) or not (addr is None or (
            isinstance(addr, list) and len(addr) == 2 and isinstance(addr[0], str)
            and isinstance(addr[1], int)
        )):
            raise CoordinationError(f"start: rank {rank} sent a malformed node or address",
                                    rank=coordinator.rank, ranks=(rank,),
                                    hint="ranks running different versions of ckpt_pipeline?")
        nodes.append(name)
        addresses.append(None if addr is None else (addr[0], addr[1]))
    return Opening(run_id, token, tuple(nodes), tuple(addresses))


async def agree_outcome(coordinator: Coordinator, step: int, save_id: str,
                        error: str | None, *, what: str, fatal: bool = False
                        ) -> tuple[dict[int, str], bool]:
    """Every rank's outcome of one operation on ``step``: ({rank: error}, any fatal).

    A rank that answers for another step or save id counts as failed too.
    """
    failures, any_fatal, _ = await gather_outcome(coordinator, step, save_id, error,
                                                  what=what, fatal=fatal)
    return failures, any_fatal


async def gather_outcome(coordinator: Coordinator, step: int, save_id: str,
                         error: str | None, *, what: str, fatal: bool = False,
                         extra: Any = None) -> tuple[dict[int, str], bool, Runs[Any]]:
    """``agree_outcome``, and every rank's ``extra`` (None for a rank that answered for
    another step or save id), by rank."""
    answers = await _exchange(coordinator, {"step": step, "save_id": save_id, "error": error,
                                            "fatal": fatal, "extra": extra},
                              what=what, step=step)
    failures, any_fatal = _outcomes(answers, step, save_id)
    extras = answers.map(lambda a: a.get("extra") if _same(a, step, save_id) else None)
    return failures, any_fatal, extras


def _same(answer: Mapping[str, Any], step: int, save_id: str) -> bool:
    return answer.get("step") == step and answer.get("save_id") == save_id


def _outcomes(answers: Runs[Mapping[str, Any]], step: int, save_id: str
              ) -> tuple[dict[int, str], bool]:
    """({rank: error}, any fatal) of one outcome exchange: a rank that answered for another
    step or save id counts as failed. O(runs + failed ranks)."""
    failures: dict[int, str] = {}
    any_fatal = False
    read: dict[int, str | None] = {}  # id of a distinct answer: its failure (shared answers)
    for start, stop, answer in answers.runs():
        key = id(answer)
        if key not in read:
            err = answer.get("error")
            read[key] = (f"was at step {answer.get('step')} (save {answer.get('save_id')}), "
                         f"not step {step}" if not _same(answer, step, save_id)
                         else None if err is None else str(err))
            any_fatal = any_fatal or bool(answer.get("fatal"))
        failure = read[key]
        if failure is not None:
            failures.update(dict.fromkeys(range(start, stop), failure))
    return failures, any_fatal


class VotePart(Protocol):
    """One participant's part of a rank's vote: a frozen dataclass that packs to msgpack
    types (never pickle), read back on every rank by the participant's strict decoder."""

    def to_msg(self) -> Any:
        """The part as msgpack types."""
        ...


P = TypeVar("P", bound=VotePart)


@dataclass(frozen=True, slots=True)
class Ballot(Generic[P]):
    """What one participant puts into one vote: this rank's ``part`` (None: nothing to say)
    and how every rank's part is read back (``decode``: a ValueError or CheckpointError for a
    malformed one). ``any_step``: the part counts from a rank that votes on another save too
    (the persistent tier's reports are about earlier steps); otherwise such a rank's is None."""

    part: P | None
    decode: Callable[[Any], P]
    any_step: bool = False


@dataclass(frozen=True, slots=True)
class Tally:
    """Every rank's outcome of one vote: ({rank: error}, any fatal) as ``agree_outcome``
    says it, and every participant's parts by key, indexed by rank (``Runs``)."""

    failures: Mapping[int, str]
    fatal: bool
    parts: Mapping[str, Runs[VotePart | None]]


async def gather_vote(coordinator: Coordinator, step: int, save_id: str, error: str | None,
                      *, what: str, ballots: Mapping[str, Ballot[Any]]) -> Tally:
    """``agree_outcome`` with the participants' typed parts (``ballots``, by key). A part
    that does not decode is a CoordinationError, the same on every rank."""
    answers = await _exchange(coordinator, {
        "step": step, "save_id": save_id, "error": error, "fatal": False,
        "parts": {key: None if b.part is None else b.part.to_msg()
                  for key, b in ballots.items()}}, what=what, step=step)
    failures, any_fatal = _outcomes(answers, step, save_id)
    parts: dict[str, Runs[VotePart | None]] = {}
    for key, ballot in ballots.items():
        parts[key] = _decode_parts(
            answers, key, ballot, what=what, me=coordinator.rank,
            counts=None if ballot.any_step else lambda a: _same(a, step, save_id))
    return Tally(failures, any_fatal, parts)


async def gather_parts(coordinator: Coordinator, key: str, ballot: Ballot[P], *, what: str,
                       step: int | None = None) -> Runs[P | None]:
    """Every rank's part of one participant outside a save's vote, indexed by rank."""
    answers = await _exchange(coordinator, {"parts": {key: None if ballot.part is None
                                                      else ballot.part.to_msg()}},
                              what=what, step=step)
    return _decode_parts(answers, key, ballot, what=what, me=coordinator.rank)


def _decode_parts(answers: Runs[Mapping[str, Any]], key: str, ballot: Ballot[P], *,
                  what: str, me: int, counts: Callable[[Mapping[str, Any]], bool] | None = None
                  ) -> Runs[P | None]:
    """Every rank's ``key`` part (None where ``counts`` says the answer does not count),
    decoded once per distinct answer (``_exchange`` shares equal ones): O(runs)."""
    done: dict[int, P | None] = {}
    stops: list[int] = []
    out: list[P | None] = []
    for rank, stop, answer in answers.runs():
        if id(answer) not in done:
            done[id(answer)] = (None if counts is not None and not counts(answer) else
                                _decode_part(answer, key, ballot, what=what, rank=rank, me=me))
        stops.append(stop)
        out.append(done[id(answer)])
    return Runs(stops, out)


def _decode_part(answer: Mapping[str, Any], key: str, ballot: Ballot[P], *, what: str,
                 rank: int, me: int) -> P | None:
    parts = answer.get("parts")
    if not isinstance(parts, dict):
        raise CoordinationError(f"{what}: rank {rank} sent a malformed message (no parts)",
                                rank=me, ranks=(rank,), hint=_VERSIONS_HINT)
    raw = parts.get(key)
    if raw is None:
        return None
    try:
        return ballot.decode(raw)
    except (ValueError, CheckpointError) as exc:
        why = exc.message if isinstance(exc, CheckpointError) else str(exc)
        raise CoordinationError(f"{what}: rank {rank} sent a malformed {key} part ({why})",
                                rank=me, ranks=(rank,), hint=_VERSIONS_HINT) from exc


_VERSIONS_HINT = ("ranks running different versions of ckpt_pipeline? restart the job with "
                  "the same version everywhere")


@dataclass(frozen=True, slots=True)
class Candidates:
    """What the ranks hold: steps whose every rank's shard is held somewhere (its own root, or
    a copy on another rank) with the same save id, newest first."""

    steps: tuple[tuple[int, str], ...]
    valid_by_rank: Mapping[int, tuple[int, ...]]
    world_sizes: Mapping[int, int]
    """World sizes recorded in the valid steps of any rank, by step (only those != this job's)."""
    held_any: bool
    """Some rank holds a complete step (valid or not): starting from scratch would lose it."""
    holders: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    """{(step, source rank): ranks holding a valid copy of that shard with the step's save
    id}, for the steps in ``steps``."""
    copied: frozenset[tuple[int, int]] = frozenset()
    """(step, source) of every valid copy any rank holds, of any step."""
    persisted: frozenset[tuple[int, str]] = frozenset()
    """(step, save id) of every step some rank found complete in the persistent tier."""
    unresolved: Mapping[int, str] = field(default_factory=dict)
    """{step: why no save id of it could be agreed on} for the steps left out of ``steps``
    (no save makes the step whole, or two do alike: see ``_resolve_step``)."""

    def copies_of(self, step: int, source: int) -> bool:
        return (step, source) in self.copied


async def agree_candidates(coordinator: Coordinator, valid: Mapping[int, tuple[str, int]],
                           *, held_any: bool,
                           copies: Sequence[tuple[int, int, str, int]] = (),
                           persisted: Sequence[tuple[int, str, int]] = ()) -> Candidates:
    """Exchange {step: (save_id, world_size)} of every rank's valid steps, the valid copies
    it holds for other ranks as (step, source, save_id, world_size), and the steps it found
    complete in the persistent tier as (step, save_id, world_size). A rank's shard of a step
    counts as held when it is in the rank's root, in a copy, or in the persistent tier."""
    answers = await _exchange(
        coordinator, {"valid": [[s, sid, ws] for s, (sid, ws) in sorted(valid.items())],
                      "copies": [list(c) for c in copies],
                      "persisted": [list(p) for p in persisted],
                      "held_any": held_any}, what="restore candidates")
    world = coordinator.world_size
    held: list[dict[int, str]] = []
    held_copies: dict[tuple[int, int], dict[int, str]] = {}  # (step, source) -> {holder: id}
    other_sizes: dict[int, int] = {}
    persisted_ids: dict[int, set[str]] = {}
    for rank, answer in enumerate(answers):
        steps: dict[int, str] = {}
        for entry in _entries(answer, "valid", 3, coordinator.rank, rank):
            steps[entry[0]] = entry[1]
            if entry[2] != world:
                other_sizes[entry[0]] = entry[2]
        held.append(steps)
        for step, source, save_id, size in _entries(answer, "copies", 4, coordinator.rank,
                                                    rank):
            if size != world:
                other_sizes.setdefault(step, size)
            elif 0 <= source < world and source != rank:
                held_copies.setdefault((step, source), {})[rank] = save_id
        for step, save_id, size in _entries(answer, "persisted", 3, coordinator.rank, rank):
            if size != world:
                other_sizes.setdefault(step, size)
            else:
                persisted_ids.setdefault(step, set()).add(save_id)
    agreed: list[tuple[int, str]] = []
    holders: dict[tuple[int, int], tuple[int, ...]] = {}
    unresolved: dict[int, str] = {}
    every = (set().union(*held) | {step for step, _ in held_copies} | set(persisted_ids))
    for step in sorted(every, reverse=True):
        if step in other_sizes:
            continue
        save_id, found, why = _resolve_step(step, held, held_copies,
                                            persisted_ids.get(step, set()), world)
        if save_id is None:
            unresolved[step] = why
        else:
            agreed.append((step, save_id))
            holders.update(found)
    return Candidates(tuple(agreed),
                      {r: tuple(sorted(h, reverse=True)) for r, h in enumerate(held)},
                      other_sizes, any(bool(a.get("held_any")) for a in answers), holders,
                      frozenset(held_copies),
                      frozenset((s, sid) for s, ids in persisted_ids.items() for sid in ids),
                      unresolved)


def _resolve_step(step: int, held: Sequence[Mapping[int, str]],
                  held_copies: Mapping[tuple[int, int], Mapping[int, str]],
                  persisted: set[str], world: int
                  ) -> tuple[str | None, dict[tuple[int, int], tuple[int, ...]], str]:
    """The save id of ``step`` that the ranks agree on, with its copies' holders, or (None,
    {}, why not).

    A save id is a candidate when it makes the step whole: every rank's shard of that save is
    in the rank's root, in a copy on another rank, or in the persistent tier. One such save id
    is the step's. When several are (a root of another run came back with the same step
    numbers, and its copies make that run's step whole too), the one most ranks hold their
    own shard of wins, then the one with more copies, then the one in the persistent tier; a
    tie is ambiguous and nothing of the step is used. Files of the other saves are never
    mixed in: the caller sets a rank's own files of another save aside and reads its shard
    from a copy.
    """
    ids = ({h[step] for h in held if step in h}
           | {sid for (s, _src), by in held_copies.items() if s == step for sid in by.values()}
           | persisted)
    whole: dict[str, tuple[dict[tuple[int, int], tuple[int, ...]], tuple[int, int, int]]] = {}
    covered: dict[str, list[int]] = {}
    for save_id in sorted(ids):
        found: dict[tuple[int, int], tuple[int, ...]] = {}
        in_tier = save_id in persisted
        covered[save_id] = []
        for source in range(world):
            copies_of = tuple(sorted(h for h, sid in held_copies.get((step, source), {}).items()
                                     if sid == save_id))
            if copies_of:
                found[(step, source)] = copies_of
            if held[source].get(step) == save_id or copies_of or in_tier:
                covered[save_id].append(source)
        if len(covered[save_id]) == world:
            support = (sum(1 for h in held if h.get(step) == save_id),
                       sum(len(c) for c in found.values()), int(in_tier))
            whole[save_id] = (found, support)
    if not whole:
        return None, {}, "no save makes it whole (" + "; ".join(
            f"save {sid} holds the shards of rank(s) {ranks}"
            for sid, ranks in sorted(covered.items())) + ")"
    best = max(support for _found, support in whole.values())
    winners = sorted(sid for sid, (_found, support) in whole.items() if support == best)
    if len(winners) > 1:
        return None, {}, (f"saves {winners} are each whole, held alike (own shards, copies, "
                          "persistent tier): which one is this run's is ambiguous")
    return winners[0], whole[winners[0]][0], ""


def _entries(answer: dict[str, Any], key: str, width: int, me: int, rank: int
             ) -> list[tuple[Any, ...]]:
    entries = answer.get(key, [])
    if not isinstance(entries, list):
        raise CoordinationError(f"restore candidates: rank {rank} sent a malformed list",
                                rank=me)
    out = []
    for entry in entries:
        if (not isinstance(entry, list) or len(entry) != width
                or not all(isinstance(v, str if i == width - 2 else int)
                           for i, v in enumerate(entry))):
            raise CoordinationError(f"restore candidates: rank {rank} sent a malformed entry",
                                    rank=me)
        out.append(tuple(entry))
    return out


async def gather_shared(coordinator: Coordinator, message: Any, *, what: str,
                        step: int | None = None) -> Runs[Any]:
    """Every rank's ``message``, indexed by rank (equal ones as one shared object: read
    them, never change them)."""
    answers = await _exchange(coordinator, {"shared": message}, what=what, step=step)
    return answers.map(lambda answer: answer.get("shared"))


async def agree_barrier(coordinator: Coordinator, *, what: str, step: int | None = None
                        ) -> None:
    """Return once every rank got here."""
    await _exchange(coordinator, {}, what=what, step=step)
