"""The states of ``bench_format_cpu.py``: one case a shape of state, and what to know about it.

A case builds a state to checkpoint, the plain state dict of the same tensors for
``torch.save``, a live state of the same structure to restore into (preallocated tensors,
restored in place), and, for tied weights and views, an empty container to restore into and the
pair of tensors whose aliasing to check there. ``unique_bytes`` counts what any format must
store: the bytes of the distinct storages that the state's tensors cover.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from _baselines import iter_tensors

__all__ = (
    "AliasPair",
    "Built",
    "Case",
    "alias_report",
    "copy_into",
    "dtype_counts",
    "fingerprint",
    "get_path",
    "make_cases",
    "plain_state",
    "region_views",
    "select_cases",
    "storage_regions",
)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
COUNTS = (10, 100, 1_000, 10_000, 100_000, 1_000_000)
QUICK_COUNTS = (10, 100, 1_000)
SIZES = (1 * MiB, 16 * MiB, 256 * MiB, 1 * GiB, 4 * GiB)
QUICK_SIZES = (1 * MiB, 16 * MiB)
HEAVY_TENSORS = 1_000_000
HEAVY_BYTES = 4 * GiB
"""Cases this large run one round only (unless ``--no-cap``): a full run stays near 20 min."""


@dataclass(frozen=True, slots=True)
class AliasPair:
    """Two tensors that share memory in the saved state: ``second`` starts ``byte_offset``
    bytes into ``first``'s memory. Paths are keys joined by ``/``."""

    first: str
    second: str
    byte_offset: int


@dataclass(slots=True)
class Built:
    """A case's state, made when the case runs (and freed after)."""

    state: dict[str, Any]
    """What ``CheckpointPipeline.save`` gets (may hold an ``nn.Module``)."""
    plain: dict[str, Any]
    """The same tensors as nested dicts, for ``torch.save``."""
    make_live: Callable[[], dict[str, Any]]
    """A state of the same structure to restore into in place (zeros)."""
    empty: Callable[[], dict[str, Any]] | None = None
    """A live state whose containers are empty, so that restore materializes the tensors."""
    alias: AliasPair | None = None


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    kind: str
    """The group ``--cases`` can name: count, mixed, size, tied, view, one_tensor."""
    description: str
    build: Callable[[], Built]
    params: dict[str, Any] = field(default_factory=dict)
    heavy: bool = False


# --- the states -------------------------------------------------------------------------------


def _random_rows(count: int, numel: int, dtype: torch.dtype, gen: torch.Generator
                 ) -> list[torch.Tensor]:
    """``count`` tensors of ``numel`` random values, each with a storage of its own."""
    if count == 0:
        return []
    base = torch.randn(count * max(numel, 1), generator=gen)
    base = (base * 1e6 if dtype == torch.int64 else base).to(dtype)
    if numel == 0:
        return [base[i].clone() for i in range(count)]  # 0-dim: a scalar
    return [row.clone() for row in base.split(numel)]


def _copies(count: int, numel: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``count`` distinct float32 tensors of ``numel`` values: one random tensor, copied (random
    numbers for gigabytes are slow to draw, and no format here compresses)."""
    base = torch.randn(numel, generator=gen)
    out = []
    for i in range(count):
        t = base.clone()
        t[0] = float(i)
        out.append(t)
    return out


def _zeros_like_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeros_like_tree(v) for k, v in tree.items()}
    raise TypeError(f"unexpected {type(tree).__name__} in a plain state")


def _plain_case(plain: dict[str, Any]) -> Built:
    return Built(state=plain, plain=plain, make_live=lambda: _zeros_like_tree(plain))


def count_state(n: int) -> Built:
    """``n`` float32 tensors of 16 elements (64 bytes): biases, norms, optimizer step scalars."""
    gen = torch.Generator().manual_seed(n)
    return _plain_case({"t": {str(i): t for i, t in enumerate(_random_rows(n, 16, torch.float32,
                                                                            gen))}})


MIXED = (  # (group, count, elements, dtype) at 64 MiB; elements 0 is a 0-dim scalar
    ("large_f32", 13, MiB, torch.float32),
    ("large_bf16", 4, MiB, torch.bfloat16),
    ("vec1023_f32", 500, 1023, torch.float32),
    ("vec1023_bf16", 500, 1023, torch.bfloat16),
    ("scalar_f32", 4000, 0, torch.float32),
    ("vec16_f32", 4000, 16, torch.float32),
    ("vec3_f32", 1000, 3, torch.float32),
    ("vec7_bf16", 1000, 7, torch.bfloat16),
    ("vec7_i64", 1000, 7, torch.int64),
)


def mixed_state(total: int) -> Built:
    """Large tensors and many tiny ones of float32, bf16 and int64, about ``total`` bytes."""
    scale = total / (64 * MiB)
    gen = torch.Generator().manual_seed(64)
    plain: dict[str, Any] = {}
    for group, count, numel, dtype in MIXED:
        rows = _random_rows(max(1, round(count * scale)), numel, dtype, gen)
        plain[group] = {str(i): t for i, t in enumerate(rows)}
    return _plain_case(plain)


def size_state(total: int) -> Built:
    """float32 tensors of 64 MiB (a quarter of the total for small totals)."""
    per_tensor = min(64 * MiB, total // 4)
    gen = torch.Generator().manual_seed(total % (1 << 31))
    tensors = _copies(total // per_tensor, per_tensor // 4, gen)
    return _plain_case({"t": {str(i): t for i, t in enumerate(tensors)}})


def one_tensor_state(nbytes: int) -> Built:
    return _plain_case({"t": {"0": _copies(1, nbytes // 4, torch.Generator().manual_seed(2))[0]}})


class TiedLM(torch.nn.Module):
    """An embedding and an output projection sharing one weight, with a norm between."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight


def tied_state(vocab: int, dim: int) -> Built:
    torch.manual_seed(vocab)
    model = TiedLM(vocab, dim)
    return Built(state={"model": model}, plain={"model": model.state_dict()},
                 make_live=lambda: {"model": TiedLM(vocab, dim)},
                 empty=lambda: {"model": {}},
                 alias=AliasPair("model/emb.weight", "model/head.weight", 0))


def view_state(numel: int) -> Built:
    """One tensor and a view of 990 of its elements, ``{"x": {"a": t, "b": t[10:1000]}}``."""
    t = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    plain = {"x": {"a": t, "b": t[10:1000]}}
    return Built(state=plain, plain=plain,
                 make_live=lambda: {"x": {"a": torch.zeros_like(t),
                                          "b": torch.zeros(990, dtype=t.dtype)}},
                 empty=lambda: {"x": {}},
                 alias=AliasPair("x/a", "x/b", 10 * t.element_size()))


def _size_name(nbytes: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit:
            return f"{nbytes // unit}{name}"
    return f"{nbytes}B"


def make_cases(quick: bool) -> list[Case]:
    """Every case in run order; ``quick`` shrinks them for a smoke test of a few seconds."""
    cases = [
        Case(f"count_{n}", "count", f"{n} float32 tensors of 16 elements",
             functools.partial(count_state, n), {"tensors": n, "elements": 16},
             heavy=n >= HEAVY_TENSORS)
        for n in (QUICK_COUNTS if quick else COUNTS)
    ]
    mixed = 4 * MiB if quick else 64 * MiB
    cases.append(Case("mixed", "mixed", "large and tiny tensors of float32, bf16 and int64 "
                      "(4 MiB ones, scalars, 3 to 1023 elements)", lambda: mixed_state(mixed),
                      {"total_bytes_asked": mixed}))
    for total in (QUICK_SIZES if quick else SIZES):
        per = min(64 * MiB, total // 4)
        cases.append(Case(f"size_{_size_name(total)}", "size",
                          f"{total // per} float32 tensors of {_size_name(per)}",
                          functools.partial(size_state, total),
                          {"total_bytes": total, "tensor_bytes": per},
                          heavy=total >= HEAVY_BYTES))
    vocab, dim = (1024, 64) if quick else (8192, 256)
    cases.append(Case("tied", "tied", f"embedding and output projection sharing one "
                      f"{vocab}x{dim} float32 weight, and a LayerNorm",
                      lambda: tied_state(vocab, dim), {"vocab": vocab, "dim": dim}))
    numel = 4096 if quick else 262_144
    cases.append(Case("view", "view", f"a float32 tensor of {numel} elements and a view of 990 "
                      f"of them", lambda: view_state(numel), {"elements": numel}))
    one = 64 * MiB if quick else 2 * GiB
    cases.append(Case(f"one_tensor_{_size_name(one)}", "one_tensor",
                      f"one float32 tensor of {_size_name(one)}",
                      lambda: one_tensor_state(one), {"total_bytes": one}))
    return cases


def select_cases(cases: list[Case], wanted: Iterable[str]) -> list[Case]:
    """The cases named, by name or by kind, in run order; ValueError names an unknown one."""
    names = {w.strip() for item in wanted for w in item.split(",") if w.strip()}
    if not names:
        return cases
    known = {c.name for c in cases} | {c.kind for c in cases}
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    return [c for c in cases if c.name in names or c.kind in names]


# --- what the state holds ---------------------------------------------------------------------


def plain_state(state: Any) -> Any:
    """The state with every module (anything with ``state_dict()``) replaced by its state dict."""
    if isinstance(state, torch.Tensor):
        return state
    if isinstance(state, dict):
        return {k: plain_state(v) for k, v in state.items()}
    if callable(getattr(state, "state_dict", None)):
        return plain_state(state.state_dict())
    return state


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the storage bytes a tensor's elements lie in (gaps of a strided view
    included)."""
    if t.numel() == 0:
        return 0, 0
    size = t.element_size()
    start = int(t.storage_offset()) * size
    last = sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * size


def storage_regions(state: Any) -> list[tuple[torch.Tensor, int, int]]:
    """(a tensor on the storage, start, end) of each byte range of a distinct storage that the
    state's tensors cover, overlapping ranges merged; their lengths sum to the unique bytes."""
    spans: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}
    for t in iter_tensors(plain_state(state)):
        start, end = _byte_span(t)
        if end > start:
            key = t.untyped_storage().data_ptr()
            spans.setdefault(key, (t, []))[1].append((start, end))
    regions = []
    for owner, ranges in spans.values():
        ranges.sort()
        lo, hi = ranges[0]
        for start, end in ranges[1:]:
            if start > hi:
                regions.append((owner, lo, hi))
                lo, hi = start, end
            else:
                hi = max(hi, end)
        regions.append((owner, lo, hi))
    return regions


def region_views(regions: list[tuple[torch.Tensor, int, int]]) -> list[memoryview]:
    out = []
    for owner, start, end in regions:
        raw = torch.empty(0, dtype=torch.uint8).set_(owner.untyped_storage())
        out.append(raw[start:end].numpy().data)
    return out


def fingerprint(state: Any) -> list[int]:
    """xxh3-64 of each tensor's bytes, in order: compared after a restore, so that the original
    state can be freed before the reads."""
    out = []
    for t in iter_tensors(plain_state(state)):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        out.append(xxhash.xxh3_64_intdigest(flat.numpy().data))
    return out


def dtype_counts(state: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in iter_tensors(plain_state(state)):
        name = str(t.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + 1
    return counts


def copy_into(live: Any, loaded: Any) -> None:
    """Load a ``torch.load`` result into the live state in place, as a training script would."""
    if isinstance(live, torch.Tensor):
        with torch.no_grad():
            live.copy_(loaded)
    elif isinstance(live, dict):
        for key, value in live.items():
            copy_into(value, loaded[key])
    elif callable(getattr(live, "load_state_dict", None)):
        live.load_state_dict(loaded)
    else:
        raise TypeError(f"cannot load into {type(live).__name__}")


def get_path(tree: Any, path: str) -> Any:
    for key in path.split("/"):
        tree = tree[key]
    return tree


def alias_report(tree: Any, pair: AliasPair) -> dict[str, Any]:
    """Whether the two tensors of ``pair`` share memory after a load, the way they did.

    ``storage_shared`` is the comparison of their storages' addresses; it is also true for two
    unrelated tensors cut from one read buffer. ``aliased`` is the test that counts: a write
    into the first tensor, where the second one starts, shows in the second one.
    """
    a, b = get_path(tree, pair.first), get_path(tree, pair.second)
    report: dict[str, Any] = {
        "storage_shared": a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(),
        "second_at_saved_offset": b.data_ptr() - a.data_ptr() == pair.byte_offset,
        "first_bytes": a.nbytes,
        "first_storage_bytes": a.untyped_storage().nbytes(),
        "second_bytes": b.nbytes,
        "second_storage_bytes": b.untyped_storage().nbytes(),
    }
    index = pair.byte_offset // a.element_size()
    flat = a.detach().view(-1)
    with torch.no_grad():
        flat[index] = b.detach().reshape(-1)[0].item() + 12345.0
        report["aliased"] = bool(b.detach().reshape(-1)[0] == flat[index])
    return report
