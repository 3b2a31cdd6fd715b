"""Every dtype, shape and layout torch offers: round-trips bit for bit, or is refused in save().

A refusal is a StateError raised by save() before anything is written, naming the tensor's path
and saying what the tensor is.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._format.limits import DTYPES, MAX_NDIM
from tests._support.roundtrip import assert_bit_equal, assert_refused, restore, round_trip, save

ALL_DTYPES: list[torch.dtype] = sorted(
    {value for name in dir(torch) if isinstance(value := getattr(torch, name), torch.dtype)},
    key=str)
SUPPORTED = set(DTYPES.values())
QUANTIZED = {d for d in ALL_DTYPES if str(d).startswith(("torch.qint", "torch.quint"))}


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0,
                  device: str = "cpu") -> torch.Tensor:
    """Random bytes of any dtype (NaNs and all); bool holds 0 or 1."""
    gen = torch.Generator().manual_seed(seed)
    count = 1
    for d in shape:
        count *= d
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (count * dtype.itemsize,),
                        dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


def make_any(dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype``, whatever kind of tensor torch gives for it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dtype in (torch.qint8, torch.quint8, torch.qint32):
            return torch.quantize_per_tensor(torch.randn(2, 3), 0.1, 0, dtype)
        if dtype in QUANTIZED:
            return torch.empty(2, 3, dtype=dtype)  # quint4x2, quint2x4: quantized empties
        return random_tensor((2, 3), dtype)


def test_the_dtypes_are_enumerated_from_torch() -> None:
    assert len(ALL_DTYPES) >= 30
    assert set(ALL_DTYPES) > SUPPORTED
    for name in ("float8_e4m3fn", "complex32", "uint16", "uint64", "bits8", "qint8", "quint8"):
        if hasattr(torch, name):
            assert getattr(torch, name) in ALL_DTYPES


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_exactly_or_is_refused_naming_it(root: Path,
                                                                 dtype: torch.dtype) -> None:
    t = make_any(dtype)
    if dtype in SUPPORTED:
        save(root, {"model": {"w": t}})
        live = {"model": {"w": torch.zeros(2, 3, dtype=dtype)}}
        target = live["model"]["w"]
        restore(root, live)
        assert live["model"]["w"] is target, "loaded in place"
        assert_bit_equal(target, t, str(dtype))
        materialized: dict[str, Any] = {"model": {}}
        restore(root, materialized)
        assert_bit_equal(materialized["model"]["w"], t, str(dtype))
    elif dtype in QUANTIZED:
        assert_refused(root, {"model": {"w": t}}, path="model/w",
                       match=rf"tensor model/w is a quantized tensor \({dtype}\)")
    else:
        error = assert_refused(root, {"model": {"w": t}}, path="model/w",
                               match=rf"tensor model/w has dtype {dtype}: dtype {dtype} is "
                                     r"not supported: supported dtypes are float64, ")
        for supported in DTYPES:
            assert supported in error.message


# --------------------------------------------------------------------------- shapes


SHAPES = [(), (0,), (0, 5), (3, 0, 2), (1,), (7,), (2, 3, 4), (1,) * MAX_NDIM,
          (2,) + (1,) * (MAX_NDIM - 2) + (3,)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d-{'x'.join(map(str, s[:4]))}")
def test_shapes_round_trip(root: Path, shape: tuple[int, ...]) -> None:
    state = {"m": {str(dtype): random_tensor(shape, dtype, seed=i)
                   for i, dtype in enumerate(DTYPES.values())}}
    round_trip(root, state)
    live = {"m": {name: torch.zeros(shape, dtype=t.dtype) for name, t in state["m"].items()}}
    restore(root, live)
    for name, t in state["m"].items():
        assert_bit_equal(live["m"][name], t, name)


def test_more_dimensions_than_a_reader_accepts_are_refused(root: Path) -> None:
    assert_refused(root, {"m": {"t": torch.zeros((1,) * (MAX_NDIM + 1))}}, path="m/t",
                   match=rf"has {MAX_NDIM + 1} dimensions")


def _views() -> dict[str, torch.Tensor]:
    base = random_tensor((6, 8), torch.float32, seed=1)
    cbase = random_tensor((4, 5), torch.complex64, seed=2)
    wide = random_tensor((4, 6, 5), torch.float64, seed=3)
    return {
        "transposed": base.t(),
        "sliced": base[1::2, ::3],
        "offset": base.reshape(-1)[5:29],
        "offset_2d": base[2:, 3:],
        "permuted": wide.permute(2, 0, 1),
        "expanded": random_tensor((1, 5), torch.float16, seed=4).expand(7, 5),
        "expanded_0d": torch.tensor(2.5).expand(3, 4),
        "diagonal": base[:, :6].diagonal(),
        "conj": cbase.conj(),
        "conj_transposed": cbase.t().conj(),
        "conj_of_real": base.conj(),
        "neg": torch._neg_view(base),
        "neg_of_conj": torch._neg_view(cbase.conj()),
        "zero_tensor": torch._efficientzerotensor(3, 2),
        "bool_strided": random_tensor((5, 4), torch.bool, seed=5)[::2],
        "bf16_offset": random_tensor((50,), torch.bfloat16, seed=6)[7:],
    }


@pytest.mark.parametrize("name", list(_views()))
def test_views_round_trip_by_value(root: Path, name: str) -> None:
    view = _views()[name]
    expected = view.resolve_conj().resolve_neg().clone()
    save(root, {"m": {"v": view}})
    live = {"m": {"v": torch.zeros(view.shape, dtype=view.dtype)}}
    restore(root, live)
    assert_bit_equal(live["m"]["v"], expected, name)
    materialized: dict[str, Any] = {"m": {}}
    restore(root, materialized)
    got = materialized["m"]["v"]
    assert_bit_equal(got, expected, name)
    assert got.is_contiguous() and not got.is_conj() and not got.is_neg()


@pytest.mark.parametrize("name", ["conj", "neg", "zero_tensor"])
def test_views_without_their_values_in_memory_are_refused_when_streamed(root: Path,
                                                                        name: str) -> None:
    """A state larger than host_buffer_bytes is copied as raw bytes, which such views lack."""
    big = {"conj": random_tensor((2048,), torch.complex64).conj(),  # 16 KiB each
           "neg": torch._neg_view(random_tensor((4096,), torch.float32)),
           "zero_tensor": torch._efficientzerotensor(4096)}[name]
    assert_refused(root, {"m": {"v": big}}, path="m/v", match=r"tensor m/v is a ",
                   chunk_bytes=4096, host_buffer_bytes=8192)
    round_trip(root, {"m": {"v": big.resolve_conj().resolve_neg().clone()}},
               chunk_bytes=4096, host_buffer_bytes=8192)


def test_parameters_with_requires_grad_round_trip(root: Path) -> None:
    p = torch.nn.Parameter(random_tensor((3, 4), torch.float32, seed=7))
    q = torch.nn.Parameter(random_tensor((5,), torch.bfloat16, seed=8), requires_grad=False)
    save(root, {"m": {"p": p, "q": q}})
    live = {"m": {"p": torch.nn.Parameter(torch.zeros(3, 4)),
                  "q": torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16),
                                          requires_grad=False)}}
    target = live["m"]["p"]
    restore(root, live)
    assert live["m"]["p"] is target and target.requires_grad
    assert_bit_equal(live["m"]["p"], p)
    assert_bit_equal(live["m"]["q"], q)
    materialized: dict[str, Any] = {"m": {}}
    restore(root, materialized)
    assert_bit_equal(materialized["m"]["p"], p)


# --------------------------------------------------------------------------- refused kinds


def _sparse(layout: str) -> torch.Tensor:
    dense = torch.eye(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if layout == "sparse_coo":
            return dense.to_sparse()
        if layout in ("sparse_csr", "sparse_csc"):
            return dense.to_sparse(layout=getattr(torch, layout))
        return dense.to_sparse(layout=getattr(torch, layout), blocksize=(2, 2))


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                                    "sparse_bsc"])
def test_sparse_tensors_are_refused_naming_their_layout(root: Path, layout: str) -> None:
    t = _sparse(layout)
    assert t.layout == getattr(torch, layout)
    error = assert_refused(root, {"model": {"w": t}}, path="model/w",
                           match=rf"tensor model/w is a {layout} tensor")
    assert "to_dense" in (error.hint or "")


@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_nested_tensors_are_refused_as_nested(root: Path, layout: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)],
                                       layout=getattr(torch, layout))
    assert_refused(root, {"model": {"w": t}}, path="model/w",
                   match=r"tensor model/w is a nested tensor")


@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8, torch.qint32], ids=str)
def test_quantized_tensors_are_refused_as_quantized(root: Path, dtype: torch.dtype) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_tensor = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, dtype)
        per_channel = torch.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2]),
                                                 torch.tensor([0, 0]), 0, dtype)
    for t in (per_tensor, per_channel):
        error = assert_refused(root, {"model": {"w": t}}, path="model/w",
                               match=rf"tensor model/w is a quantized tensor \({dtype}\)")
        assert "layout" not in error.message


def test_meta_tensors_are_refused_naming_the_device(root: Path) -> None:
    assert_refused(root, {"model": {"w": torch.empty(2, 3, device="meta")}}, path="model/w",
                   match=r"tensor model/w is on device meta")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs mkldnn")
def test_mkldnn_tensors_are_refused_naming_the_layout(root: Path) -> None:
    t = torch.randn(2, 3).to_mkldnn()
    assert_refused(root, {"model": {"w": t}}, path="model/w",
                   match=r"tensor model/w is a _mkldnn tensor")


class _Tagged(torch.Tensor):
    pass


def test_tensor_subclasses_are_refused_naming_the_class(root: Path) -> None:
    t = torch.ones(3).as_subclass(_Tagged)
    assert_refused(root, {"model": {"w": t}}, path="model/w",
                   match=r"tensor model/w is a tensor subclass .*_Tagged")


# --------------------------------------------------------------------------- CUDA


def _cuda_views() -> dict[str, torch.Tensor]:
    base = random_tensor((6, 8), torch.float32, seed=11, device="cuda")
    cbase = random_tensor((4, 5), torch.complex64, seed=12, device="cuda")
    return {
        "transposed": base.t(),
        "sliced": base[1::2, ::3],
        "offset": base.reshape(-1)[5:29],
        "expanded": random_tensor((1, 5), torch.float16, seed=13, device="cuda").expand(7, 5),
        "conj": cbase.conj(),
        "conj_transposed": cbase.t().conj(),
        "neg": torch._neg_view(base),
        "neg_of_conj": torch._neg_view(cbase.conj()),
        "bool_strided": random_tensor((5, 4), torch.bool, seed=14, device="cuda")[::2],
        "zero_size": torch.empty(0, 5, device="cuda"),
        "zero_dim": torch.tensor(1.5, device="cuda"),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"device_staging": True}], ids=["host", "staging"])
def test_cuda_tensors_of_every_dtype_and_view_round_trip(root: Path,
                                                         options: dict[str, Any]) -> None:
    state: dict[str, Any] = {
        "d": {name: random_tensor((3, 5), dtype, seed=i, device="cuda")
              for i, (name, dtype) in enumerate(DTYPES.items())},
        "v": _cuda_views(),
    }
    expected = {part: {k: v.resolve_conj().resolve_neg().clone() for k, v in values.items()}
                for part, values in state.items()}
    save(root, state, **options)
    live: dict[str, Any] = {"d": {}, "v": {}}
    restore(root, live)
    for part, values in expected.items():
        for name, want in values.items():
            assert_bit_equal(live[part][name], want, f"{part}/{name}")
    zeroed = {part: {k: torch.zeros_like(v) for k, v in values.items()}
              for part, values in expected.items()}
    restore(root, zeroed)
    for part, values in expected.items():
        for name, want in values.items():
            assert_bit_equal(zeroed[part][name], want, f"{part}/{name} in place")


@pytest.mark.gpu
def test_cuda_views_round_trip_when_streamed(root: Path) -> None:
    t = random_tensor((4096,), torch.float32, device="cuda")
    save(root, {"m": {"t": t, "s": t[1000:3000]}}, chunk_bytes=4096, host_buffer_bytes=8192)
    live: dict[str, Any] = {"m": {}}
    restore(root, live)
    assert_bit_equal(live["m"]["t"], t)
    assert_bit_equal(live["m"]["s"], t[1000:3000].clone())


def test_the_refusals_write_nothing_and_leave_the_pipeline_usable(root: Path) -> None:
    with cp.CheckpointPipeline(root, capture_rng=False) as pipe:
        with pytest.raises(cp.StateError):
            pipe.save(1, {"m": {"w": torch.empty(2, device="meta")}})
        pipe.save(1, {"m": {"w": torch.ones(2)}}).result(60)
    live: dict[str, Any] = {"m": {}}
    restore(root, live)
    assert_bit_equal(live["m"]["w"], torch.ones(2))
