"""Property: an in-place restore into live tensors that share memory is bit-exact, or refused.

States are built from a few raw byte buffers ("bases") and tensors that view them in random
ways: another dtype (bool, uint8, int8, float16, bfloat16, float32, int32, int64: every byte
value, so bools holding 2 and NaNs with payloads), a region of it, then a strided slice, a
transpose, a narrow, or an expansion (a dimension of stride 0). Such a state is saved with a
real pipeline, the live tensors are scrambled, and the state is restored in place.

The oracle is computed here, byte by byte, from the strides alone: a restore can be exact when
every live tensor that covers a byte of live memory was saved with the same byte there. Then the
restore must succeed, every live tensor must hold its saved bits, and every live byte that no
tensor covers must be untouched. Otherwise it must raise StateError and leave every live byte as
it was. Bytes are compared as integers of the element's width, so NaNs and odd bools compare.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt_pipeline as cp

pytestmark = pytest.mark.timeout(300)

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32,
          torch.int32, torch.int64]
OPS = ["region", "slice", "transpose", "narrow", "expand"]
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class View(NamedTuple):
    """How one tensor views a base: ``base.view(dtype)[offset:offset + count]``, then ``op``."""

    base: int
    dtype: torch.dtype
    offset: int
    count: int
    op: str
    a: int
    b: int

    def of(self, bases: list[torch.Tensor]) -> torch.Tensor:
        region = bases[self.base].view(self.dtype).narrow(0, self.offset, self.count)
        if self.op == "slice":
            return region[self.a % self.count::1 + self.b % 3]
        if self.op == "transpose":
            rows = 1 + self.a % self.count
            cols = self.count // rows
            return region[:rows * cols].view(rows, cols).t()
        if self.op == "narrow":
            start = self.a % self.count
            return region.narrow(0, start, self.b % (self.count - start + 1))
        if self.op == "expand":
            return region.unsqueeze(0).expand(2 + self.a % 3, self.count)
        return region


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as flat integers of their width (row-major): NaN- and bool-safe."""
    return t.view(_INTS[t.element_size()]).reshape(-1).clone(memory_format=torch.contiguous_format)


def byte_positions(t: torch.Tensor) -> torch.Tensor:
    """For each byte of ``bits(t).view(uint8)``, its offset in the base's memory."""
    k = t.element_size()
    pos = torch.tensor(t.storage_offset() * k)
    for d, (n, s) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * (t.dim() + 1)
        shape[d] = n
        pos = pos + (torch.arange(n) * s * k).view(shape)
    pos = pos + torch.arange(k).view([1] * t.dim() + [k])
    return pos.expand(*t.shape, k).reshape(-1)


def random_bases(sizes: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]


@st.composite
def views(draw: st.DrawFn, sizes: list[int]) -> View:
    base = draw(st.integers(0, len(sizes) - 1))
    dtype = draw(st.sampled_from(DTYPES))
    n = sizes[base] // dtype.itemsize
    count = draw(st.integers(1, n))
    offset = draw(st.integers(0, n - count))
    return View(base, dtype, offset, count, draw(st.sampled_from(OPS)),
                draw(st.integers(0, 63)), draw(st.integers(0, 63)))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[int], list[View]]:
    sizes = [8 * draw(st.integers(1, 6)) for _ in range(draw(st.integers(1, 3)))]
    return sizes, draw(st.lists(views(sizes), min_size=1, max_size=6))


@st.composite
def relaid(draw: st.DrawFn, saved: tuple[list[int], list[View]]
           ) -> tuple[list[int], list[View]]:
    """The same tensors (dtypes, shapes) viewing live bases in another arrangement."""
    sizes, vs = saved
    live_sizes = [max(sizes)] * draw(st.integers(1, 3))
    out = []
    for v in vs:
        n = live_sizes[0] // v.dtype.itemsize
        out.append(v._replace(base=draw(st.integers(0, len(live_sizes) - 1)),
                              offset=draw(st.integers(0, n - v.count))))
    return live_sizes, out


def state_of(bases: list[torch.Tensor], vs: list[View]) -> dict[str, Any]:
    return {"t": {f"v{i}": v.of(bases) for i, v in enumerate(vs)}}


def exact_possible(live: dict[str, torch.Tensor], saved: dict[str, torch.Tensor],
                   sizes: list[int], bases: list[torch.Tensor]) -> tuple[bool, set[str]]:
    """Whether every live byte is covered only by tensors saved with the same byte there; and
    the paths of the tensors that disagree somewhere."""
    want: list[dict[int, int]] = [{} for _ in sizes]
    writers: list[dict[int, str]] = [{} for _ in sizes]
    bad: set[str] = set()
    index = {b.untyped_storage().data_ptr(): i for i, b in enumerate(bases)}
    for key, t in live.items():
        if t.numel() == 0:
            continue
        base = index[t.untyped_storage().data_ptr()]
        values = bits(saved[key]).view(torch.uint8).tolist()
        for pos, value in zip(byte_positions(t).tolist(), values):
            if want[base].setdefault(pos, value) != value:
                bad.update((key, writers[base][pos]))
            writers[base].setdefault(pos, key)
    return not bad, {f"t/{k}" for k in bad}


def covered(live: dict[str, torch.Tensor], bases: list[torch.Tensor]) -> list[torch.Tensor]:
    masks = [torch.zeros(b.numel(), dtype=torch.bool) for b in bases]
    index = {b.untyped_storage().data_ptr(): i for i, b in enumerate(bases)}
    for t in live.values():
        if t.numel():
            masks[index[t.untyped_storage().data_ptr()]][byte_positions(t)] = True
    return masks


class Unloadable:
    """A stateful object, applied last, whose first load fails: the restore must roll back
    (and the rollback's load of the old state succeeds)."""

    def __init__(self) -> None:
        self.loads = 0

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loads += 1
        if self.loads == 1:
            raise RuntimeError("injected: refusing the load")


def save_and_restore(saved_state: dict[str, Any], live_state: dict[str, Any]
                     ) -> cp.CheckpointError | None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        with cp.CheckpointPipeline(root, capture_rng=False) as pipe:
            pipe.save(1, saved_state).result(60)
        with cp.CheckpointPipeline(root) as pipe:
            try:
                pipe.restore_latest(live_state, restore_rng=False)
            except cp.CheckpointError as exc:
                return exc
    return None


def check(sizes: list[int], vs: list[View], live_sizes: list[int], live_vs: list[View],
          seed: int) -> None:
    bases = random_bases(sizes, seed)
    saved_state = state_of(bases, vs)
    saved_bits = {k: bits(t) for k, t in saved_state["t"].items()}
    original = [b.clone() for b in bases]
    live_bases = random_bases(live_sizes, seed + 1)  # scrambled: other bytes
    live_state = state_of(live_bases, live_vs)
    before = [b.clone() for b in live_bases]
    possible, conflicting = exact_possible(live_state["t"], saved_state["t"], live_sizes,
                                           live_bases)

    error = save_and_restore(saved_state, live_state)

    for b, o in zip(bases, original):  # saving never writes into the saved state
        assert torch.equal(b, o)
    if not possible:
        assert isinstance(error, cp.StateError), error
        assert error.path in conflicting, (error.path, conflicting, str(error))
        for b, o in zip(live_bases, before):
            assert torch.equal(b, o), "a refused restore changed a live byte"
        return
    assert error is None, str(error)
    for key, t in live_state["t"].items():
        assert torch.equal(bits(t), saved_bits[key]), key
    for b, o, mask in zip(live_bases, before, covered(live_state["t"], live_bases)):
        assert torch.equal(b[~mask], o[~mask]), "a byte no tensor covers was written"


@SETTINGS
@given(layout=layouts(), seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_restore_into_the_saved_aliasing_gives_back_every_byte(
        layout: tuple[list[int], list[View]], seed: int) -> None:
    sizes, vs = layout
    check(sizes, vs, sizes, vs, seed)


@SETTINGS
@given(data=st.data(), layout=layouts(), seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_restore_into_another_aliasing_is_exact_or_refused_untouched(
        data: st.DataObject, layout: tuple[list[int], list[View]], seed: int) -> None:
    live_sizes, live_vs = data.draw(relaid(layout))
    check(*layout, live_sizes, live_vs, seed)


@SETTINGS
@given(layout=layouts(), seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_failed_restore_into_aliased_tensors_leaves_every_byte_as_it_was(
        layout: tuple[list[int], list[View]], seed: int) -> None:
    sizes, vs = layout
    saved_state = {**state_of(random_bases(sizes, seed), vs), "z": Unloadable()}
    live_bases = random_bases(sizes, seed + 1)
    live_state = {**state_of(live_bases, vs), "z": Unloadable()}
    before = [b.clone() for b in live_bases]
    error = save_and_restore(saved_state, live_state)
    assert isinstance(error, cp.StateError) and "injected" in str(error), error
    assert "every change was undone" in str(error)
    for b, o in zip(live_bases, before):
        assert torch.equal(b, o), "the rollback left other bytes"
