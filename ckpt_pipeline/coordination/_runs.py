"""Every rank's answer, held as runs of equal answers: what an exchange hands back.

On the good path every rank of a job answers alike, and the per-node control plane carries
such answers as one run (``_hierarchy.pack_distinct``). ``Runs`` keeps them so after the
exchange: one entry a run, not a reference a rank, so that reading a vote in which every rank
succeeded costs the same at 8 ranks as at 16,000, and one that some ranks failed costs a
little more for each. It is a ``Sequence`` (``answers[rank]`` in O(log runs), ``len``, plain
iteration over every rank for code that wants it); ``runs()`` and ``map()`` are the O(runs)
ways through it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar, overload

__all__ = ("Runs", "spans_text")

T = TypeVar("T", covariant=True)
U = TypeVar("U")


class Runs(Sequence[T], Generic[T]):
    """A sequence indexed by rank, stored as runs of the same object: ``stops[i]`` is one
    past the last index of run ``i``, ``items[i]`` its object. Adjacent runs hold distinct
    objects (by identity), and no run is empty. Read it, never change it."""

    __slots__ = ("_items", "_stops")

    def __init__(self, stops: Sequence[int], items: Sequence[T]) -> None:
        if len(stops) != len(items):
            raise ValueError(f"{len(stops)} run ends for {len(items)} items")
        self._stops: list[int] = []
        self._items: list[T] = []
        start = 0
        for stop, item in zip(stops, items, strict=True):
            if stop <= start:
                raise ValueError(f"a run ends at {stop}, not after {start}")
            if self._items and self._items[-1] is item:
                self._stops[-1] = stop
            else:
                self._stops.append(stop)
                self._items.append(item)
            start = stop

    @classmethod
    def of(cls, items: Iterable[T]) -> Runs[T]:
        """``items`` (one a rank), adjacent equal ones (equal value) as one run of the first
        of them: O(ranks), for a coordinator that hands back a plain list."""
        stops: list[int] = []
        kept: list[T] = []
        for at, item in enumerate(items):
            if kept and (kept[-1] is item or kept[-1] == item):
                stops[-1] = at + 1
            else:
                stops.append(at + 1)
                kept.append(item)
        return cls(stops, kept)

    @classmethod
    def join(cls, parts: Iterable[Runs[T]]) -> Runs[T]:
        """``parts`` one after the other, in O(runs); where one part ends with an object equal
        to the one the next begins with, the two runs are one (of the first's object)."""
        stops: list[int] = []
        items: list[T] = []
        base = 0
        for part in parts:
            for _start, stop, item in part.runs():
                if items and (items[-1] is item or items[-1] == item):
                    stops[-1] = base + stop
                else:
                    stops.append(base + stop)
                    items.append(item)
            base += len(part)
        return cls(stops, items)

    def runs(self) -> Iterator[tuple[int, int, T]]:
        """(first index, one past the last, the object) of each run, in order."""
        start = 0
        for stop, item in zip(self._stops, self._items, strict=True):
            yield start, stop, item
            start = stop

    def distinct(self) -> list[T]:
        """Each run's object, in order (an object may come back in several runs)."""
        return list(self._items)

    def map(self, fn: Callable[[T], U]) -> Runs[U]:
        """``fn`` of every index's object, called once per distinct object (by identity)."""
        done: dict[int, U] = {}
        items = []
        for item in self._items:
            key = id(item)
            if key not in done:
                done[key] = fn(item)
            items.append(done[key])
        return Runs(self._stops, items)

    def by_index(self) -> Mapping[int, T]:
        """A read-only {index: object} view (O(log runs) a lookup, O(len) to walk), for an
        API that hands out a mapping by rank."""
        return _ByIndex(self)

    def indices(self, keep: Callable[[T], bool]) -> Iterator[int]:
        """The indices whose object ``keep`` says yes of, ascending; ``keep`` is called once
        a run."""
        for start, stop, item in self.runs():
            if keep(item):
                yield from range(start, stop)

    def __len__(self) -> int:
        return self._stops[-1] if self._stops else 0

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} of {n}")
        return self._items[bisect.bisect_right(self._stops, index)]

    def __iter__(self) -> Iterator[T]:
        for start, stop, item in self.runs():
            for _ in range(stop - start):
                yield item

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other,
                                                                      strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{stop - start}x{item!r:.40}" for start, stop, item in self.runs())
        return f"Runs([{shown}])"


class _ByIndex(Mapping[int, T], Generic[T]):
    """``Runs.by_index``: the runs as a mapping from index to object."""

    __slots__ = ("_runs",)

    def __init__(self, runs: Runs[T]) -> None:
        self._runs = runs

    def __getitem__(self, key: int) -> T:
        if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < len(self._runs):
            raise KeyError(key)
        return self._runs[key]

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._runs)))

    def __len__(self) -> int:
        return len(self._runs)

    def __repr__(self) -> str:
        return f"by_index({self._runs!r})"


def spans_text(spans: Iterable[tuple[int, int]]) -> str:
    """Ranks given as spans [start, stop), as "[0-7, 9, 12, 13]": a span of three or more as
    first-last, shorter ones rank by rank; adjacent spans are one. The ranks of a whole node
    or job take one entry, not one a rank."""
    merged: list[list[int]] = []
    for start, stop in sorted(spans):
        if stop <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    parts: list[str] = []
    for start, stop in merged:
        if stop - start >= 3:
            parts.append(f"{start}-{stop - 1}")
        else:
            parts.extend(str(r) for r in range(start, stop))
    return "[" + ", ".join(parts) + "]"
