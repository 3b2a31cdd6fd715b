"""What ``ckpt-pipeline`` prints: aligned tables, human sizes and ages, JSON, a progress bar.

Every command prints through these, so that ``ls`` and ``verify`` look alike: binary units
(``1.2 GiB``), short ages (``5m``), rank ranges (``0-3 of 8``), two-space aligned columns, and
indented JSON for scripts. The progress bar is drawn only on a terminal, and best-effort: a
terminal that goes away stops the bar, never the command.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = (
    "Progress",
    "_progress_text",
    "human_age",
    "human_bytes",
    "print_json",
    "ranks_text",
    "rounded",
    "table_lines",
)

_PROGRESS_WIDTH = 30
_PROGRESS_INTERVAL_S = 0.1


# --------------------------------------------------------------------------- tables


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[str]], *,
           right: set[int]) -> list[str]:
    """Lines of an aligned table; columns in ``right`` are right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = []
    for cells in [headers, *rows]:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(cells, widths))]
        lines.append("  ".join(parts).rstrip())
    return lines


_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def _unit_for(nbytes: int) -> tuple[str, int]:
    """The largest binary unit in which ``nbytes`` is at least 1."""
    unit, scale = "B", 1
    for name in _UNITS:
        if nbytes < scale * 1024:
            break
        unit, scale = name, scale * 1024
    return unit, scale


def human_bytes(nbytes: int) -> str:
    """``96 B``, ``411.1 KiB``, ``1.2 GiB``."""
    unit, scale = _unit_for(nbytes)
    return f"{nbytes} B" if scale == 1 else f"{nbytes / scale:.1f} {unit}"


def human_age(seconds: float | None) -> str:
    """``42s``, ``5m``, ``3h``, ``2d``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def ranks_text(ranks: Sequence[int], world_size: int | None) -> str:
    """Ranks as ranges (``0-3``, ``0,2,5-7``); ``of N`` when some of the job's are missing."""
    if not ranks:
        return "-"
    spans: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    text = ",".join(spans)
    if world_size is not None and list(ranks) != list(range(world_size)):
        text += f" of {world_size}"
    return text


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def print_json(data: dict[str, Any]) -> None:
    """``data`` as strict JSON: bytes as ``{"bytes_hex": ...}``, a NaN or infinite float as
    the string ``"nan"``, ``"inf"`` or ``"-inf"`` (TrainState.extra may hold both), any other
    value JSON lacks as its ``repr``."""
    print(json.dumps(_jsonable(data), indent=2, allow_nan=False))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes_hex": bytes(value).hex()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


# --------------------------------------------------------------------------- progress


class Progress:
    """Counts the bytes checked; on a terminal, draws ``[#####.....] 45% 1.2/2.7 GiB``.

    ``read_shard`` calls it from several worker threads at once.
    """

    def __init__(self, total: int, label: str, stream: TextIO | None) -> None:
        self.total = total
        self.done = 0
        self._label = label
        self._stream = stream
        self._lock = threading.Lock()
        self._drawn_at = 0.0

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self._stream is None:
                return
            now = time.monotonic()
            if now - self._drawn_at >= _PROGRESS_INTERVAL_S or self.done >= self.total:
                self._drawn_at = now
                self._draw(f"\r{self._label} {_progress_text(self.done, self.total)}")

    def _draw(self, text: str) -> None:
        """Best-effort: a terminal that went away stops the bar, never the verification."""
        if self._stream is None:
            return
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            self._stream = None

    def close(self) -> None:
        """Erase the bar, so that the result line takes its place."""
        with self._lock:
            if self._stream is not None and self._drawn_at:
                width = len(self._label) + 1 + len(_progress_text(self.total, self.total))
                self._draw("\r" + " " * width + "\r")
            self._stream = None


def _progress_text(done: int, total: int, width: int = _PROGRESS_WIDTH) -> str:
    """``[#####.....] 45% 1.2/2.7 GiB``: the fraction done, in the unit of the total."""
    fraction = min(1.0, done / total) if total > 0 else 1.0
    filled = int(fraction * width)
    unit, scale = _unit_for(total)
    return (f"[{'#' * filled}{'.' * (width - filled)}] {int(fraction * 100):3d}% "
            f"{done / scale:.1f}/{total / scale:.1f} {unit}")
