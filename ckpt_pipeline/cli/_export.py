"""``ckpt-pipeline export ROOT|URL OUT``: a step's tensors as safetensors or torch files
(``ckpt_pipeline.export``), with a progress bar on a terminal."""

from __future__ import annotations

import argparse
import re
import sys

import torch

from ..export import ExportResult, export
from ..storage import Storage
from ._output import Progress, human_bytes, print_json
from ._remote import parse_options
from ._status import EXIT_OK, UsageError

__all__ = ("cmd_export", "parse_size")

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``5GB``, ``500MiB``, ``1000000`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise UsageError(f"--max-shard-size {text!r}: give a size such as 5GB or 500MiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size < 1:
        raise UsageError(f"--max-shard-size {text!r} is not a positive size")
    return size


def cmd_export(storage: Storage | str, args: argparse.Namespace) -> int:
    """Export from a local root (``storage``) or a persistent tier's URL."""
    root = storage if isinstance(storage, str) else str(storage.root)
    options = parse_options(args.option) if isinstance(storage, str) else None
    dtype = None
    if args.dtype is not None:
        if args.dtype.lower() not in _DTYPES:
            raise UsageError(f"--dtype {args.dtype!r}: give bf16, fp16 or fp32")
        dtype = _DTYPES[args.dtype.lower()]
    limit = None if args.max_shard_size is None else parse_size(args.max_shard_size)
    bar: Progress | None = None
    seen = [0]

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(total, "exporting", sys.stderr if sys.stderr.isatty() else None)
        bar(done - seen[0])
        seen[0] = done

    try:
        result = export(root, args.out, step=args.step, to=args.to, only=args.only,
                        strip_prefix=args.strip_prefix, dtype=dtype, max_shard_bytes=limit,
                        force=args.force, progress=progress, options=options)
    finally:
        if bar is not None:
            bar.close()
    _report(result, args)
    return EXIT_OK


def _report(result: ExportResult, args: argparse.Namespace) -> None:
    if args.json:
        print_json({"step": result.step, "files": list(result.files),
                     "tensors": result.tensors, "bytes": result.bytes,
                     "tied": dict(result.tied), "skipped": list(result.skipped),
                     "suggested_prefix": result.suggested_prefix})
        return
    print(f"step {result.step}: {result.tensors} tensors, {human_bytes(result.bytes)} "
          f"-> {', '.join(result.files)}")
    for alias, name in sorted(result.tied.items()):
        print(f"  {alias} is tied to {name} (stored once)")
    if result.tied and args.to == "safetensors":
        print("  load it with safetensors.torch.load_model(model, file), which ties them "
              "again; model.load_state_dict(strict=True) would report the tied names as "
              "missing (or pass strict=False)")
    if result.skipped:
        shown = ", ".join(result.skipped[:5]) + (" ..." if len(result.skipped) > 5 else "")
        print(f"  {len(result.skipped)} plain value(s) left out: {shown}")
    if result.suggested_prefix:
        print(f"hint: every name starts with {result.suggested_prefix!r} (torch.compile); "
              f"pass --strip-prefix {result.suggested_prefix} for the uncompiled model's names",
              file=sys.stderr)
