"""Agreements between ranks, built on the coordinator's all-gather of msgpack messages.

Every function here is called by every rank, in the same order; each returns the same decision
on every rank, so that no rank can take a path the others do not take.
"""

from __future__ import annotations

import bisect
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from .._format.documents import decode_message, encode_message
from .._logging import log
from ..errors import CheckpointError, CheckpointIntegrityError, CoordinationError
from ._control_plane import Coordinator, pack_frames, unpack_frames
from ._runs import Runs, spans_text

__all__ = ("Ballot", "Candidates", "Opening", "RootedPart", "Runs", "Tally", "VotePart",
           "agree_barrier", "agree_candidates", "agree_open", "agree_outcome", "candidates_message",
           "encode_piece", "gather_outcome", "gather_parts", "gather_shared", "gather_vote",
           "read_piece")


async def _exchange(coordinator: Coordinator, message: dict[str, Any], *, what: str,
                    step: int | None = None) -> Runs[dict[str, Any]]:
    """Every rank's ``message``, indexed by rank, as runs of equal answers (``Runs``). Each
    distinct message is decoded once, and ranks that sent the same bytes get the same
    object: read the answers, never change them. From the per-node coordinator this costs
    O(runs), not O(ranks)."""
    raw = await coordinator.all_gather(encode_message(message), what=what, step=step)
    return _answers(coordinator, raw, what=what, step=step)


async def _exchange_rooted(coordinator: Coordinator, message: dict[str, Any],
                           for_root: Mapping[str, bytes], *, what: str,
                           step: int | None = None
                           ) -> tuple[Runs[dict[str, Any]], dict[int, dict[str, bytes]]]:
    """``_exchange``, and what every rank has for rank 0 alone (``for_root``: its pieces by
    participant, as bytes; {} for none): on rank 0, {rank: its pieces} for the ranks that
    sent any; {} on the others. Through a coordinator's ``all_gather_root`` the other ranks
    never receive those pieces, so that answers stay equal where only they differ; a
    coordinator without it carries them in the message (every rank then decodes every
    answer). Rank 0 only splits them (O(1) a piece, no msgpack): each participant reads its
    own where it wants (``read_piece``). Pieces rank 0 cannot split are logged and left out:
    they are rank 0's alone, so they never make the exchange fail on one rank."""
    blob = _pack_pieces(for_root)
    gather = getattr(coordinator, "all_gather_root", None)
    raws: dict[int, Any]
    if gather is None:
        answers = await _exchange(coordinator, {**message, "for_root": blob}, what=what,
                                  step=step)
        raws = {} if coordinator.rank != 0 else {
            rank: answer.get("for_root") for start, stop, answer in answers.runs()
            if answer.get("for_root") for rank in range(start, stop)}
    else:
        raw, raws = await gather(encode_message(message), blob, what=what, step=step)
        answers = _answers(coordinator, raw, what=what, step=step)
    roots: dict[int, dict[str, bytes]] = {}
    for rank, data in sorted(raws.items()):
        try:
            if not isinstance(data, bytes):
                raise ValueError(f"a {type(data).__name__}, not bytes")
            roots[rank] = _unpack_pieces(data)
        except ValueError as exc:
            log.error("ckpt.control.root_piece_malformed", what=what, step=step, rank=rank,
                      error=str(exc), hint=_VERSIONS_HINT)
    return answers, roots


def _pack_pieces(pieces: Mapping[str, bytes]) -> bytes:
    """Pieces for rank 0 by participant (``pack_frames``: each key in UTF-8, then its
    piece); b"" for none."""
    if not pieces:
        return b""
    return pack_frames([part for key, data in pieces.items() for part in (key.encode(), data)])


def _unpack_pieces(blob: bytes) -> dict[str, bytes]:
    """The inverse of ``_pack_pieces``; ValueError for anything else."""
    if not blob:
        return {}
    items = unpack_frames(blob)
    if len(items) % 2:
        raise ValueError(f"{len(items)} items, not pairs of a key and a piece")
    return {key.decode("utf-8", "replace"): data for key, data in zip(items[::2], items[1::2])}


def encode_piece(piece: Any) -> bytes:
    """A participant's piece for rank 0 (msgpack types) as it travels."""
    return encode_message({"piece": piece})


def read_piece(data: bytes, what: str) -> Any:
    """A piece for rank 0 as its participant sent it (``RootedPart.root_msg``), decoded with
    the readers' limits; CheckpointIntegrityError otherwise."""
    message = decode_message(data, what)
    if set(message) != {"piece"}:
        raise CheckpointIntegrityError(f"{what} is not a piece")
    return message["piece"]


def _answers(coordinator: Coordinator, raw: Sequence[bytes], *, what: str,
             step: int | None) -> Runs[dict[str, Any]]:
    """Every rank's gathered message, decoded once per distinct one (see ``_exchange``)."""
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
    copy-server address (None where a rank runs none), indexed by rank (``Runs`` from the
    exchange: the ranks of a node that runs no copy server answer alike)."""

    run_id: str
    token: str
    nodes: Sequence[str]
    addresses: Sequence[tuple[str, int] | None]


async def agree_open(coordinator: Coordinator, node: str,
                     address: tuple[str, int] | None) -> Opening:
    """At open: rank 0's run id and copy token; every rank's node and copy-server address.
    Only rank 0 sends a run id and token, so that the ranks of a node without copy servers
    send equal messages: the answers are read in O(runs), not O(ranks)."""
    first = coordinator.rank == 0
    answers = await _exchange(coordinator, {
        "run_id": secrets.token_hex(8) if first else None,
        "token": secrets.token_hex(16) if first else None, "node": node,
        "address": None if address is None else [address[0], address[1]]}, what="start")
    run_id, token = answers[0].get("run_id"), answers[0].get("token")
    if not isinstance(run_id, str) or not run_id or not isinstance(token, str):
        raise CoordinationError("start: rank 0 sent no run id", rank=coordinator.rank)

    def read(rank: int, answer: Mapping[str, Any]) -> tuple[str, tuple[str, int] | None]:
        name, addr = answer.get("node"), answer.get("address")
        if not isinstance(name, str) or not (addr is None or (
            isinstance(addr, list) and len(addr) == 2 and isinstance(addr[0], str)
            and isinstance(addr[1], int)
        )):
            raise CoordinationError(f"start: rank {rank} sent a malformed node or address",
                                    rank=coordinator.rank, ranks=(rank,),
                                    hint="ranks running different versions of ckpt_pipeline?")
        return name, None if addr is None else (addr[0], addr[1])

    read_once: dict[int, tuple[str, tuple[str, int] | None]] = {}
    for start, _stop, answer in answers.runs():
        if id(answer) not in read_once:
            read_once[id(answer)] = read(start, answer)
    entries = answers.map(lambda answer: read_once[id(answer)])
    return Opening(run_id, token, entries.map(lambda e: e[0]), entries.map(lambda e: e[1]))


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


@runtime_checkable
class RootedPart(VotePart, Protocol):
    """A part with a piece that rank 0 alone reads (``root_msg``), sent apart from the vote
    (``Ballot.rooted``) so that the other ranks neither receive nor decode it: what differs
    from rank to rank but only rank 0 needs, such as the persistent tier's object sums."""

    def root_msg(self) -> Any:
        """The piece for rank 0 as msgpack types; None: nothing."""
        ...


P = TypeVar("P", bound=VotePart)


@dataclass(frozen=True, slots=True)
class Ballot(Generic[P]):
    """What one participant puts into one vote: this rank's ``part`` (None: nothing to say)
    and how every rank's part is read back (``decode``: a ValueError or CheckpointError for a
    malformed one). ``any_step``: the part counts from a rank that votes on another save too
    (the persistent tier's reports are about earlier steps); otherwise such a rank's is None.
    ``rooted``: a ``RootedPart``'s ``root_msg`` goes to rank 0 alone (``Tally.roots``); the
    same on every rank, since it decides how the vote travels."""

    part: P | None
    decode: Callable[[Any], P]
    any_step: bool = False
    rooted: bool = False


@dataclass(frozen=True, slots=True)
class Tally:
    """Every rank's outcome of one vote: ({rank: error}, any fatal) as ``agree_outcome``
    says it, and every participant's parts by key, indexed by rank (``Runs``)."""

    failures: Mapping[int, str]
    fatal: bool
    parts: Mapping[str, Runs[VotePart | None]]
    roots: Mapping[str, Mapping[int, bytes]] = field(default_factory=dict)
    """Rank 0: each rooted participant's pieces for rank 0 by rank, as they travelled (read
    each with ``read_piece``), from the ranks that sent one (and, unless ``any_step``, voted
    on this save). Empty on the other ranks."""


async def gather_vote(coordinator: Coordinator, step: int, save_id: str, error: str | None,
                      *, what: str, ballots: Mapping[str, Ballot[Any]]) -> Tally:
    """``agree_outcome`` with the participants' typed parts (``ballots``, by key). A part
    that does not decode is a CoordinationError, the same on every rank."""
    message = {"step": step, "save_id": save_id, "error": error, "fatal": False,
               "parts": {key: None if b.part is None else b.part.to_msg()
                         for key, b in ballots.items()}}
    answers, roots = await _gather_rooted(coordinator, message, ballots, what=what, step=step)
    failures, any_fatal = _outcomes(answers, step, save_id)
    parts: dict[str, Runs[VotePart | None]] = {}
    for key, ballot in ballots.items():
        parts[key] = _decode_parts(
            answers, key, ballot, what=what, me=coordinator.rank,
            counts=None if ballot.any_step else lambda a: _same(a, step, save_id))
    pieces = {key: {rank: got[key] for rank, got in roots.items() if key in got and (
                  ballot.any_step or _same(answers[rank], step, save_id))}
              for key, ballot in ballots.items() if ballot.rooted}
    return Tally(failures, any_fatal, parts, pieces)


async def gather_parts(coordinator: Coordinator, key: str, ballot: Ballot[P], *, what: str,
                       step: int | None = None) -> tuple[Runs[P | None], Mapping[int, bytes]]:
    """Every rank's part of one participant outside a save's vote, indexed by rank, and on
    rank 0 (when ``ballot.rooted``) their pieces for rank 0 by rank."""
    answers, roots = await _gather_rooted(
        coordinator, {"parts": {key: None if ballot.part is None else ballot.part.to_msg()}},
        {key: ballot}, what=what, step=step)
    return (_decode_parts(answers, key, ballot, what=what, me=coordinator.rank),
            {rank: got[key] for rank, got in roots.items() if key in got})


async def _gather_rooted(coordinator: Coordinator, message: dict[str, Any],
                         ballots: Mapping[str, Ballot[Any]], *, what: str, step: int | None
                         ) -> tuple[Runs[dict[str, Any]], dict[int, dict[str, bytes]]]:
    """The vote's exchange: plain, or (when a ballot is rooted) with this rank's pieces for
    rank 0 beside it (``_exchange_rooted``)."""
    if not any(ballot.rooted for ballot in ballots.values()):
        return await _exchange(coordinator, message, what=what, step=step), {}
    for_root: dict[str, bytes] = {}
    for key, ballot in ballots.items():
        if ballot.rooted and isinstance(ballot.part, RootedPart):
            piece = ballot.part.root_msg()
            if piece is not None:
                for_root[key] = encode_piece(piece)
    return await _exchange_rooted(coordinator, message, for_root, what=what, step=step)


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
    valid: Runs[tuple[int, ...]]
    """Every rank's valid steps (in its own root), newest first, indexed by rank: runs of
    ranks that hold the same, read in O(runs)."""
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

    @property
    def valid_by_rank(self) -> Mapping[int, tuple[int, ...]]:
        """``valid`` as {rank: steps}: a view, O(log runs) a lookup."""
        return self.valid.by_index()

    @property
    def newest_valid(self) -> int | None:
        """The newest step some rank holds valid in its own root (None: none)."""
        return max((steps[0] for steps in self.valid.distinct() if steps), default=None)


@dataclass(frozen=True, slots=True)
class _Held:
    """One distinct answer to ``agree_candidates``, read: the sender's valid steps {step:
    save id} with their world sizes, the copies it holds (step, offset of the source rank,
    save id, world size: ``candidates_message``), and the persistent tier's steps it found
    (step, save id, world size)."""

    steps: Mapping[int, str]
    sizes: Mapping[int, int]
    copies: tuple[tuple[Any, ...], ...]
    persisted: tuple[tuple[Any, ...], ...]
    held_any: bool

    @classmethod
    def read(cls, answer: dict[str, Any], me: int, rank: int) -> _Held:
        valid = _entries(answer, "valid", 3, me, rank)
        return cls({s: sid for s, sid, _ in valid}, {s: ws for s, _, ws in valid},
                   tuple(_entries(answer, "copies", 4, me, rank)),
                   tuple(_entries(answer, "persisted", 3, me, rank)),
                   bool(answer.get("held_any")))


def candidates_message(rank: int, world: int, valid: Mapping[int, tuple[str, int]], *,
                       held_any: bool, copies: Sequence[tuple[int, int, str, int]] = (),
                       persisted: Sequence[tuple[int, str, int]] = ()) -> dict[str, Any]:
    """Rank ``rank``'s message to ``agree_candidates`` (of ``world`` ranks).

    A copy is sent as (step, offset, save id, world size), its source rank as an offset from
    the sender: ``(source - rank) mod world``, or -1 for a copy of another world size or of a
    source outside this world (only its world size counts). The placement puts the k-th copy
    of every shard the same number of ranks away wherever nodes are of one size
    (``_tiers.replica.placement``), so ranks that hold the same steps send the same bytes,
    copies included, and are read once (``_exchange``); the lists are sorted for the same
    reason."""
    shifted = [[step, (source - rank) % world if size == world and 0 <= source < world
                else -1, save_id, size] for step, source, save_id, size in copies]
    return {"valid": [[s, sid, ws] for s, (sid, ws) in sorted(valid.items())],
            "copies": sorted(shifted), "persisted": sorted(list(p) for p in persisted),
            "held_any": held_any}


async def agree_candidates(coordinator: Coordinator, valid: Mapping[int, tuple[str, int]],
                           *, held_any: bool,
                           copies: Sequence[tuple[int, int, str, int]] = (),
                           persisted: Sequence[tuple[int, str, int]] = ()) -> Candidates:
    """Exchange {step: (save_id, world_size)} of every rank's valid steps, the valid copies
    it holds for other ranks as (step, source, save_id, world_size), and the steps it found
    complete in the persistent tier as (step, save_id, world_size). A rank's shard of a step
    counts as held when it is in the rank's root, in a copy on another rank, or in the
    persistent tier.

    Each distinct answer is read once and ranks that answered alike are taken together, so
    that the cost is O(runs of equal answers + copies), not O(ranks): on the good path every
    rank of a job holds the same steps, and its copies at the same offsets
    (``candidates_message``)."""
    answers = await _exchange(
        coordinator, candidates_message(coordinator.rank, coordinator.world_size, valid,
                                        held_any=held_any, copies=copies,
                                        persisted=persisted),
        what="restore candidates")
    world, me = coordinator.world_size, coordinator.rank
    read: dict[int, _Held] = {}
    stops: list[int] = []
    items: list[_Held] = []
    for start, stop, answer in answers.runs():
        if id(answer) not in read:
            read[id(answer)] = _Held.read(answer, me, start)
        stops.append(stop)
        items.append(read[id(answer)])
    held = Runs(stops, items)
    held_copies: dict[int, dict[int, dict[int, str]]] = {}  # step -> source -> {holder: id}
    other_sizes: dict[int, int] = {}
    persisted_ids: dict[int, set[str]] = {}
    for start, stop, h in held.runs():
        other_sizes.update((s, ws) for s, ws in h.sizes.items() if ws != world)
        for step, offset, save_id, size in h.copies:
            if size != world:
                other_sizes.setdefault(step, size)
            elif 0 < offset < world:  # 0: a copy of its own, which is none
                sources = held_copies.setdefault(step, {})
                for r in range(start, stop):
                    sources.setdefault((r + offset) % world, {})[r] = save_id
        for step, save_id, size in h.persisted:
            if size != world:
                other_sizes.setdefault(step, size)
            else:
                persisted_ids.setdefault(step, set()).add(save_id)
    agreed: list[tuple[int, str]] = []
    holders: dict[tuple[int, int], tuple[int, ...]] = {}
    unresolved: dict[int, str] = {}
    every = ({s for h in read.values() for s in h.steps} | set(held_copies)
             | set(persisted_ids))
    for step in sorted(every, reverse=True):
        if step in other_sizes:
            continue
        save_id, found, why = _resolve_step(step, held, held_copies.get(step, {}),
                                            persisted_ids.get(step, set()), world)
        if save_id is None:
            unresolved[step] = why
        else:
            agreed.append((step, save_id))
            holders.update(found)
    return Candidates(tuple(agreed),
                      held.map(lambda h: tuple(sorted(h.steps, reverse=True))),
                      other_sizes, any(h.held_any for h in read.values()), holders,
                      frozenset((s, src) for s, by in held_copies.items() for src in by),
                      frozenset((s, sid) for s, ids in persisted_ids.items() for sid in ids),
                      unresolved)


def _resolve_step(step: int, held: Runs[_Held], copies: Mapping[int, Mapping[int, str]],
                  persisted: set[str], world: int
                  ) -> tuple[str | None, dict[tuple[int, int], tuple[int, ...]], str]:
    """The save id of ``step`` that the ranks agree on, with its copies' holders, or (None,
    {}, why not). ``copies``: {source: {holder: save id}} of the step's copies.

    A save id is a candidate when it makes the step whole: every rank's shard of that save is
    in the rank's root, in a copy on another rank, or in the persistent tier. One such save id
    is the step's. When several are (a root of another run came back with the same step
    numbers, and its copies make that run's step whole too), the one most ranks hold their
    own shard of wins, then the one with more copies, then the one in the persistent tier; a
    tie is ambiguous and nothing of the step is used. Files of the other saves are never
    mixed in: the caller sets a rank's own files of another save aside and reads its shard
    from a copy. O(runs + copies) a save id.
    """
    ids = ({h.steps[step] for h in held.distinct() if step in h.steps}
           | {sid for by in copies.values() for sid in by.values()} | persisted)
    whole: dict[str, tuple[dict[tuple[int, int], tuple[int, ...]], tuple[int, int, int]]] = {}
    covered: dict[str, list[tuple[int, int]]] = {}  # save id -> spans of ranks [start, stop)
    for save_id in sorted(ids):
        found = {(step, source): hs for source, by in copies.items()
                 if (hs := tuple(sorted(h for h, sid in by.items() if sid == save_id)))}
        sources = sorted(source for _, source in found)
        in_tier = save_id in persisted
        spans: list[tuple[int, int]] = []
        own = 0
        for start, stop, h in held.runs():
            if h.steps.get(step) == save_id:
                spans.append((start, stop))
                own += stop - start
            elif in_tier:
                spans.append((start, stop))
            else:
                spans.extend((s, s + 1) for s in sources[bisect.bisect_left(sources, start):
                                                         bisect.bisect_left(sources, stop)])
        covered[save_id] = spans
        if sum(stop - start for start, stop in spans) == world:
            whole[save_id] = (found, (own, sum(len(c) for c in found.values()),
                                      int(in_tier)))
    if not whole:
        return None, {}, "no save makes it whole (" + "; ".join(
            f"save {sid} holds the shards of rank(s) {spans_text(spans)}"
            for sid, spans in sorted(covered.items())) + ")"
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
