"""Every limit a reader enforces, in one table.

What ``save()`` acknowledges, restore must accept: each limit below is enforced by the decoders
(``_format``) and checked on the training thread by ``save()`` first, before anything is copied
or written (``_tree.flatten_state`` per tensor and container, ``_save/checks.py`` for what needs
the whole save). Both sides take their numbers from here.

Nesting is counted the way the decoder counts it (``_format._unpack``): the outermost map of a
document is depth 0, each container (map, list, tuple) one deeper than the one holding it, and a
container at depth ``MAX_NESTING`` or deeper is refused. The state tree is its own document: the
state mapping is depth 0, so ``state["model"]`` is at depth 1. The TrainState sits inside the
shard header: header map 0, ``train_state`` 1, ``extra`` 2, a container in ``extra`` 3.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = (
    "ALIGN",
    "CHECKSUM_BLOCK_BYTES",
    "DEVICE_PATTERN",
    "DEVICE_TYPES",
    "DTYPES",
    "DTYPE_NAMES",
    "INT_MAX",
    "INT_MIN",
    "LIMITS",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "MAX_NESTING",
    "MAX_PATH_LEN",
    "MAX_SAVE_ID_LEN",
    "MAX_SMALL_FILE_BYTES",
    "MAX_TENSORS",
    "MIN_CHUNK_BYTES",
    "PLACEMENT_PATTERN",
    "TRAIN_STATE_DEPTH",
    "Limit",
)

ALIGN = 4096
"""Alignment of the shard's regions; the checksum chunk size is a multiple of it."""
MIN_CHUNK_BYTES = 1024 * 1024
"""The smallest write chunk a writer picks, unless ``chunk_bytes`` is smaller still."""
CHECKSUM_BLOCK_BYTES = 4 * 1024 * 1024
"""The checksum block a writer records (the header's ``chunk_bytes``), or its write chunk when
that is smaller: a range read verifies whole blocks, so it reads at most this much beyond
each end of the range (docs/format.md)."""
MAX_HEADER_BYTES = 256 * 1024 * 1024
MAX_SMALL_FILE_BYTES = 1024 * 1024
MAX_TENSORS = 1_000_000
MAX_NDIM = 64
MAX_PATH_LEN = 4096
MAX_NESTING = 100
MAX_SAVE_ID_LEN = 128
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
"""msgpack integers: int64 and uint64."""
DEVICE_TYPES = ("cpu", "cuda")
DEVICE_PATTERN = re.compile(r"[a-z]{2,16}(:[0-9]{1,4})?")  # "cpu", "cuda:0" (str(torch.device))
PLACEMENT_PATTERN = re.compile(r"R|S[0-9]{1,2}")  # used with fullmatch: no trailing newline
TRAIN_STATE_DEPTH = 1
"""Depth of the ``train_state`` map in the shard header (``encode_header``: a value of the
header map); its ``extra`` map is one deeper."""

DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
"""The dtype allow-list (those the installed torch has): raw bytes that read back exactly."""
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

PLAIN_TYPES = ("nil", "bool", "int", "float", "str", "bin", "array", "map", "tuple")


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit: what it bounds, and which code enforces it on each side."""

    name: str
    value: object
    what: str
    checked_by_save: str
    checked_by_restore: str


LIMITS: tuple[Limit, ...] = (
    Limit("path_length", MAX_PATH_LEN,
          "characters in a tensor's path (the '/'-joined keys leading to it)",
          "_tree.flatten_state, per tensor",
          "_format._decode_record"),
    Limit("nesting", MAX_NESTING,
          "containers nested in one msgpack document; a container at this depth or deeper is "
          "refused (state tree: the state mapping is depth 0; shard header: TrainState.extra "
          "is depth 2)",
          "_tree.flatten_state (state tree), check_save (TrainState.extra)",
          "_format._unpack"),
    Limit("header_bytes", MAX_HEADER_BYTES,
          "bytes of a shard header (tensor index, state tree, TrainState); it also bounds "
          "every string, bin, array and map in it, which the decoder caps at the document's "
          "length",
          "check_save: the header planned from the real records, each checksum counted at "
          "its largest encoding (9 bytes)",
          "_format.decode_preamble, _format._unpack (max_*_len)"),
    Limit("tensor_count", MAX_TENSORS,
          "tensors in one rank's shard",
          "_tree.flatten_state",
          "_format.decode_header"),
    Limit("ndim", MAX_NDIM,
          "dimensions of a tensor, and of a DTensor's device mesh",
          "_tree.flatten_state (tensors), check_save (meshes)",
          "_format._decode_record, _format._decode_dist"),
    Limit("dtype", tuple(DTYPES),
          "dtypes a tensor may have (its raw bytes read back exactly)",
          "_tree.flatten_state",
          "_format._decode_record"),
    Limit("device", DEVICE_TYPES,
          "devices a tensor may live on; the recorded device must match "
          f"{DEVICE_PATTERN.pattern}",
          "_tree.flatten_state",
          "_format._decode_record"),
    Limit("int_range", (INT_MIN, INT_MAX),
          "integers in any document (msgpack int64/uint64): leaves, map keys, the step, the "
          "TrainState counters",
          "_tree.flatten_state (state tree), check_save (step, TrainState)",
          "msgpack (encoder and decoder)"),
    Limit("map_keys", ("str", "int"),
          "map keys: str or int (not bool); the state's and TrainState.extra's own keys str",
          "_tree.flatten_state (state tree), check_save (TrainState.extra)",
          "_format._checked_map, _format.decode_tree, TrainState.from_plain"),
    Limit("value_types", PLAIN_TYPES,
          "values a document may hold; msgpack timestamps and other extension types are "
          "refused",
          "_tree.flatten_state (state tree), check_save (TrainState.extra)",
          "_format._unpack"),
    Limit("save_id_length", MAX_SAVE_ID_LEN,
          "characters in a save id ('<run id>-<step>')",
          "check_save",
          "_format.decode_header, _format._placement"),
    Limit("small_file_bytes", MAX_SMALL_FILE_BYTES,
          "bytes of a manifest or commit record",
          "check_save: the largest encoding of both for this save",
          "_format._small, _format.steps.read_small"),
    Limit("chunk_bytes", ALIGN,
          "checksum granularity: a positive multiple of this many bytes",
          "PipelineConfig (at construction)",
          "_format.decode_header"),
    Limit("dtensor_layout", PLACEMENT_PATTERN.pattern,
          "a DTensor's layout: one placement per mesh dimension, 'R' or 'S<dim>' with "
          "0 <= dim < ndim; a mesh of positive sizes; global shape and stride as long as the "
          "local shape, non-negative",
          "_tree.dist_layout (placement kinds), check_save",
          "_format._decode_dist"),
)
"""The one table. ``tests/format/test_limits.py`` holds a case for each entry."""
