"""TrainState: where training stands, saved beside the tensors and restored whole.

It is msgpack-encoded (never pickled). RNG states are captured on the training thread when a save
is requested, so the checkpoint holds the generators as they were at that step.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ._hostmem import byte_view
from .errors import StateError

__all__ = ("RNGState", "TrainState")


@dataclass(frozen=True, slots=True)
class RNGState:
    """Generator states of Python, NumPy (legacy global), torch CPU and every CUDA device."""

    python: tuple[Any, ...] | None = None
    numpy: tuple[Any, ...] | None = None
    torch_cpu: bytes | None = None
    torch_cuda: tuple[bytes, ...] | None = None

    def __repr__(self) -> str:
        held = [name for name in ("python", "numpy", "torch_cpu", "torch_cuda")
                if getattr(self, name) is not None]
        return f"RNGState({', '.join(held) or 'empty'})"

    @classmethod
    def capture(cls) -> RNGState:
        """Read the current global generator states."""
        np_state: tuple[Any, ...] | None = None
        try:
            import numpy as np
        except ImportError:  # numpy is optional
            pass
        else:
            name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
            np_state = (str(name), np.asarray(keys, dtype=np.uint32).tobytes(), int(pos),
                        int(has_gauss), float(cached))
        cuda: tuple[bytes, ...] | None = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = tuple(_tensor_bytes(s) for s in torch.cuda.get_rng_state_all())
        return cls(
            python=_python_state_to_plain(random.getstate()),
            numpy=np_state,
            torch_cpu=_tensor_bytes(torch.get_rng_state()),
            torch_cuda=cuda,
        )

    def apply(self) -> None:
        """Set the global generators to this state (those that were captured)."""
        if self.python is not None:
            version, internal, gauss = self.python
            random.setstate((int(version), tuple(int(x) for x in internal), gauss))
        if self.numpy is not None:
            try:
                import numpy as np
            except ImportError:  # saved where NumPy was installed: nothing here uses its RNG
                pass
            else:
                name, keys, pos, has_gauss, cached = self.numpy
                np.random.set_state(
                    (name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached)
                )
        if self.torch_cpu is not None:
            torch.set_rng_state(torch.frombuffer(bytearray(self.torch_cpu), dtype=torch.uint8))
        if self.torch_cuda is not None and torch.cuda.is_available():
            count = torch.cuda.device_count()
            for index, blob in enumerate(self.torch_cuda[:count]):
                state = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                torch.cuda.set_rng_state(state, device=index)

    def to_plain(self) -> dict[str, Any]:
        return {
            "python": None if self.python is None else [
                self.python[0], list(self.python[1]), self.python[2]],
            "numpy": None if self.numpy is None else list(self.numpy),
            "torch_cpu": self.torch_cpu,
            "torch_cuda": None if self.torch_cuda is None else list(self.torch_cuda),
        }

    @classmethod
    def from_plain(cls, data: Any) -> RNGState:
        if not isinstance(data, Mapping):
            raise StateError("rng state is not a map")
        python = data.get("python")
        numpy_state = data.get("numpy")
        cpu = data.get("torch_cpu")
        cuda = data.get("torch_cuda")
        if python is not None and (not isinstance(python, list) or len(python) != 3
                or not isinstance(python[1], list)
                or not all(isinstance(x, int) for x in python[1])):
            raise StateError("python rng state is malformed")
        if numpy_state is not None and (
            not isinstance(numpy_state, list) or len(numpy_state) != 5
            or not isinstance(numpy_state[1], bytes)
        ):
            raise StateError("numpy rng state is malformed")
        if cpu is not None and not isinstance(cpu, bytes):
            raise StateError("torch cpu rng state is malformed")
        if cuda is not None and (
            not isinstance(cuda, list) or not all(isinstance(x, bytes) for x in cuda)
        ):
            raise StateError("torch cuda rng state is malformed")
        state = cls(
            python=None if python is None else (python[0], tuple(python[1]), python[2]),
            numpy=None if numpy_state is None else tuple(numpy_state),
            torch_cpu=cpu,
            torch_cuda=None if cuda is None else tuple(cuda),
        )
        state.check()
        return state

    def check(self) -> None:
        """Raise StateError unless every state would be accepted by its generator.

        Each is set on a scratch generator, never on the global ones, so that a bad state is
        found before a restore touches anything. CUDA states are checked when CUDA is in use.
        """
        try:
            if self.python is not None:
                version, internal, gauss = self.python
                random.Random().setstate((version, tuple(internal), gauss))
            if self.numpy is not None:
                try:
                    import numpy as np
                except ImportError:
                    pass
                else:
                    name, keys, pos, has_gauss, cached = self.numpy
                    np.random.RandomState().set_state(
                        (name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss,
                         cached))
            if self.torch_cpu is not None:
                torch.Generator().set_state(
                    torch.frombuffer(bytearray(self.torch_cpu), dtype=torch.uint8))
            if self.torch_cuda is not None and torch.cuda.is_available() and (
                torch.cuda.is_initialized()
            ):
                for blob in self.torch_cuda[:torch.cuda.device_count()]:
                    torch.Generator(device="cuda").set_state(
                        torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        except (TypeError, ValueError, RuntimeError, OverflowError, IndexError,
                KeyError) as exc:
            raise StateError(f"an rng state is not accepted by its generator: {exc}") from exc


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a CPU generator state (NumPy is optional: no ``.numpy()``)."""
    return bytes(byte_view(t.detach().cpu().contiguous()))


def _python_state_to_plain(state: tuple[Any, ...]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (int(version), tuple(int(x) for x in internal), gauss)


@dataclass(frozen=True, slots=True)
class TrainState:
    """Progress of training, saved with every checkpoint.

    ``extra`` holds the user's own msgpack-able values (numbers, strings, bytes, lists, maps with
    string keys). ``rng`` is filled by the pipeline at save time when ``capture_rng`` is on.
    """

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    floating_point_operations_so_far: float = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    rng: RNGState | None = None

    def __post_init__(self) -> None:
        for name in ("step", "consumed_train_samples", "skipped_train_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StateError(f"TrainState.{name} must be a non-negative int, got {value!r}")
        flops = self.floating_point_operations_so_far
        if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not (
            0 <= flops < math.inf
        ):
            raise StateError(
                f"TrainState.floating_point_operations_so_far must be a non-negative number, "
                f"got {flops!r}"
            )
        if not isinstance(self.extra, Mapping) or not all(isinstance(k, str) for k in self.extra):
            raise StateError("TrainState.extra must be a mapping with string keys")

    def advanced(
        self,
        *,
        step: int | None = None,
        samples: int = 0,
        skipped: int = 0,
        flops: float = 0,
        **extra: Any,
    ) -> TrainState:
        """A copy moved forward: ``step`` set (or +1), counters increased, ``extra`` updated."""
        merged = {**self.extra, **extra} if extra else self.extra
        return replace(
            self,
            step=self.step + 1 if step is None else step,
            consumed_train_samples=self.consumed_train_samples + samples,
            skipped_train_samples=self.skipped_train_samples + skipped,
            floating_point_operations_so_far=self.floating_point_operations_so_far + flops,
            extra=merged,
        )

    def with_rng(self, rng: RNGState | None) -> TrainState:
        return replace(self, rng=rng)

    def to_plain(self) -> dict[str, Any]:
        """A msgpack-able map of this state."""
        return {
            "step": self.step,
            "consumed_train_samples": self.consumed_train_samples,
            "skipped_train_samples": self.skipped_train_samples,
            "floating_point_operations_so_far": self.floating_point_operations_so_far,
            "extra": {k: _plain_number(v) for k, v in self.extra.items()},
            "rng": None if self.rng is None else self.rng.to_plain(),
        }

    @classmethod
    def from_plain(cls, data: Any) -> TrainState:
        """Rebuild from :meth:`to_plain` output, validating every field."""
        if not isinstance(data, Mapping):
            raise StateError("train state is not a map")
        known = {
            "step", "consumed_train_samples", "skipped_train_samples",
            "floating_point_operations_so_far", "extra", "rng",
        }
        unknown = set(data) - known
        if unknown:
            raise StateError(f"train state has unknown fields {sorted(map(str, unknown))}")
        rng = data.get("rng")
        extra = data.get("extra", {})
        if not isinstance(extra, Mapping):
            raise StateError("train state extra is not a map")
        return cls(
            step=data.get("step", 0),
            consumed_train_samples=data.get("consumed_train_samples", 0),
            skipped_train_samples=data.get("skipped_train_samples", 0),
            floating_point_operations_so_far=data.get("floating_point_operations_so_far", 0),
            extra=dict(extra),
            rng=None if rng is None else RNGState.from_plain(rng),
        )


def _plain_number(value: Any) -> Any:
    """A number of another type that converts exactly (``numpy.float64``, ``numpy.int64``,
    a float subclass) as the plain int or float it equals, in lists and maps too; anything
    else unchanged (the save's checks name a value ``extra`` cannot hold)."""
    if type(value) in (int, float, bool, str, bytes) or value is None:
        return value
    if type(value) is dict:  # subclasses stay as they are: the checks refuse them
        return {k: _plain_number(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain_number(v) for v in value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        if number == value or (math.isnan(number) and value != value):
            return number
    return value
