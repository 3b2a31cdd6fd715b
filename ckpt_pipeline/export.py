"""``cp.export``: a checkpoint's tensors as safetensors or torch files, for inference and the
Hugging Face hub layout.

The step is read with ``cp.load`` (every byte verified; a checkpoint saved by several ranks is
consolidated). A subtree (``only="model"``) is flattened into ``name -> tensor`` the way
``state_dict()`` names them (``"layers.0.weight"``); plain values are left out. Then:

- ``strip_prefix``: removed from the names that start with it (``"_orig_mod."``, which
  ``torch.compile`` adds). When every name starts with ``_orig_mod.`` and no prefix is given,
  ``ExportResult.suggested_prefix`` says so (the CLI prints it as a hint).
- ``dtype``: floating-point tensors cast to it (``torch.bfloat16``); integer ones kept.
- **Tied weights** (one storage viewed the same way under two names, such as an input
  embedding and an output projection): stored once. For safetensors, under the first name in
  order; the others are listed in the file's metadata (``ckpt_pipeline.tied``: ``{name: kept
  name}``) and left for the model to tie again (``safetensors.torch.load_model`` does, as it
  does for files written by ``save_model``). For torch, both names are in the dict and share
  one storage, so ``torch.load`` gives them back tied. Two different views of one storage are
  written as two tensors.
- ``max_shard_bytes``: more bytes than that are split into numbered files with an index, as the
  Hugging Face hub lays them out: ``model-00001-of-00003.safetensors`` ... and
  ``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``), named after
  ``out``.

Files are written under a temporary name and renamed; an existing file is an error unless
``force``. Neither format uses pickle for anything but the torch file's container (a dict of
names to tensors, which ``torch.load(path, weights_only=True)`` reads); safetensors needs
``pip install 'ckpt_pipeline[export]'``.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from .errors import CheckpointError, CheckpointIntegrityError, ConfigError
from .loading import LoadedCheckpoint, load

__all__ = ("ExportResult", "export", "flatten_tensors")

Format = Literal["safetensors", "torch"]
_COMPILED_PREFIX = "_orig_mod."


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What ``export`` wrote: the files (index file last), the tensors, their bytes, the
    names stored once for several (``tied``: {dropped or shared name: kept name}), and the
    plain values left out (``skipped``: their paths)."""

    step: int
    files: tuple[str, ...]
    tensors: int
    bytes: int
    tied: Mapping[str, str] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    suggested_prefix: str | None = None


def _check_out(out: Path) -> None:
    """Refuse an output that cannot be a file before anything is read: a directory (with or
    without ``force``), or a path under an existing file."""
    if out.is_dir():
        raise CheckpointError(f"{out} is a directory; export writes a file",
                              path=str(out), hint=f"give the file to write, for example "
                                                  f"{out / 'model.safetensors'}")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"cannot write {out}: {parent} is a file, not a "
                                      "directory", path=str(parent),
                                      hint="give a path in a directory")
            return


def export(root: str | os.PathLike[str], out: str | os.PathLike[str], *,
           step: int | None = None, to: Format = "safetensors", only: str | None = None,
           strip_prefix: str | None = None, dtype: torch.dtype | None = None,
           max_shard_bytes: int | None = None, force: bool = False,
           progress: Callable[[int, int], None] | None = None,
           options: Mapping[str, Any] | None = None) -> ExportResult:
    """Write the tensors of ``step`` (None: the newest) under ``root`` (a local root, or a
    persistent tier's URL with its ``options``, as ``cp.load`` takes them) to ``out`` (see
    the module docstring). ``progress(done, total)`` is called with bytes written."""
    if to not in ("safetensors", "torch"):
        raise ConfigError(f"to={to!r}: export to 'safetensors' or 'torch'")
    if max_shard_bytes is not None and (type(max_shard_bytes) is not int
                                        or max_shard_bytes < 1):
        raise ConfigError(f"max_shard_bytes={max_shard_bytes!r}: give a positive size")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"dtype={dtype!r}: give a floating-point torch dtype "
                          "(torch.bfloat16, torch.float16, torch.float32)")
    if to == "safetensors":
        _safetensors()  # fail before reading anything
    _check_out(Path(out))
    # one rank's own, or every rank's assembled
    loaded = load(root, step, consolidate=True, options=options)
    tree = _subtree(loaded, only)
    tensors, skipped = _placed(loaded, lambda: flatten_tensors(tree))
    if not tensors:
        raise CheckpointError(f"no tensors under {only or 'the state'} in step {loaded.step}",
                              step=loaded.step, path=loaded.path,
                              hint="pick a subtree that holds tensors (ckpt-pipeline show)")
    suggested = None
    if strip_prefix:
        named = tensors
        tensors = _placed(loaded, lambda: _stripped(named, strip_prefix))
    elif all(k.startswith(_COMPILED_PREFIX) for k in tensors):
        suggested = _COMPILED_PREFIX
    if to == "safetensors":
        _check_dtypes(tensors, loaded)
    tied = _shared(tensors)
    own = _placed(loaded, lambda: _own_memory(tensors, dtype))
    kept = {k: v for k, v in own.items() if k not in tied} if to == "safetensors" else own
    shards = _split({k: v for k, v in kept.items() if k not in tied}, max_shard_bytes)
    for alias, name in tied.items():  # torch: a tied name goes with the one it shares
        if alias in kept:
            next(s for s in shards if name in s).append(alias)
    files = _targets(Path(out), to, len(shards))
    index = _index_path(Path(out), to) if len(shards) > 1 else None
    # The other layout's entry point (a single file beside a new index, or an index beside a
    # new single file) would leave a loader two answers: it counts as in the way too.
    stale = Path(out) if index is not None else _index_path(Path(out), to)
    for path in [*files, *([index] if index is not None else []), stale]:
        if path.exists() and not force:
            raise CheckpointError(f"{path} exists", step=loaded.step, path=str(path),
                                  hint="pass force=True (--force) to replace it")
    if stale.exists():
        stale.unlink()
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {Path(out).parent}: {exc.strerror or exc}",
                              path=str(Path(out).parent)) from exc
    total = sum(_nbytes(own[name]) for name in own if name not in tied)
    done = 0
    metadata = {"ckpt_pipeline.step": str(loaded.step), "format": "pt"}
    if tied:
        metadata["ckpt_pipeline.tied"] = json.dumps(tied, sort_keys=True)
    weight_map: dict[str, str] = {}
    for shard, path in zip(shards, files, strict=True):
        part = {name: kept[name] for name in shard}
        _write(path, part, to, metadata)
        weight_map.update({name: path.name for name in part})
        done += sum(_nbytes(kept[name]) for name in shard if name not in tied)
        if progress is not None:
            progress(done, total)
    written = [str(p) for p in files]
    if index is not None:
        _write_json(index, {"metadata": {"total_size": total, "ckpt_pipeline.step": loaded.step},
                            "weight_map": dict(sorted(weight_map.items()))})
        written.append(str(index))
    return ExportResult(loaded.step, tuple(written), len(own) - len(tied), total, tied,
                        tuple(skipped), suggested)


def flatten_tensors(tree: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], list[str]]:
    """``({dotted name: tensor}, [paths of plain values])`` of a loaded tree.

    Two tensors that would get one dotted name (a key with a dot beside a nested map that
    spells the same path, an int key beside the same digits as a string key) are a
    CheckpointError naming both: one of them would be lost."""
    tensors: dict[str, torch.Tensor] = {}
    origins: dict[str, str] = {}
    skipped: list[str] = []

    def walk(node: Any, path: str, keys: str) -> None:
        if isinstance(node, torch.Tensor):
            if path in tensors:
                raise _collision(path, f"state{origins[path]}", f"state{keys}")
            tensors[path] = node
            origins[path] = keys
        elif isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key), f"{keys}[{key!r}]")
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{path}.{i}" if path else str(i), f"{keys}[{i}]")
        else:
            skipped.append(path)

    walk(tree, prefix, "")
    return tensors, skipped


def _collision(name: str, first: str, second: str, what: str = "") -> CheckpointError:
    return CheckpointError(
        f"two tensors would be exported as {name!r}{what}: {first} and {second}; "
        "one of them would be lost", hint="export one of them with --only (only=), or drop "
        "--strip-prefix; the names of the saved state are left as they are")


_T = TypeVar("_T")


def _placed(loaded: LoadedCheckpoint, work: Callable[[], _T]) -> _T:
    """``work()``, its CheckpointError naming the step and the step's path when it does not."""
    try:
        return work()
    except CheckpointError as exc:
        if exc.step is None:
            exc.step = loaded.step
        if exc.path is None or exc.path == "":
            exc.path = loaded.path
        raise


def _stripped(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """``tensors`` with ``prefix`` removed from the names that start with it; two names that
    become one are a CheckpointError naming both."""
    out: dict[str, torch.Tensor] = {}
    was: dict[str, str] = {}
    for name, tensor in tensors.items():
        new = name[len(prefix):] if name.startswith(prefix) else name
        if new in out:
            raise _collision(new, repr(was[new]), repr(name), f" after --strip-prefix {prefix!r}")
        out[new] = tensor
        was[new] = name
    return out


# ------------------------------------------------------------------------------ helpers


def _subtree(loaded: LoadedCheckpoint, only: str | None) -> Any:
    if not only:
        return loaded.tree
    node: Any = loaded.tree
    walked: list[str] = []
    for part in only.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            here = ".".join(walked) or "the state"
            keys = (sorted(map(str, node)) if isinstance(node, Mapping)
                    else list(range(len(node))) if isinstance(node, (list, tuple)) else [])
            raise CheckpointError(
                f"no subtree {only!r} in step {loaded.step}: {here} has no {part!r} (it has: "
                f"{', '.join(map(str, keys[:20])) or 'nothing'})", step=loaded.step,
                path=loaded.path, hint="see the structure with `ckpt-pipeline show ROOT`")
        walked.append(part)
    return node


def _key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape),
            tuple(t.stride()), t.dtype)


def _shared(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{name: the first name} of tensors that are the same view of one storage."""
    first: dict[Any, str] = {}
    tied: dict[str, str] = {}
    for name in sorted(tensors):
        t = tensors[name]
        if t.numel() == 0:
            continue
        key = _key(t)
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


_SAFETENSORS_NO = (torch.complex128,)


def _check_dtypes(tensors: Mapping[str, torch.Tensor], loaded: LoadedCheckpoint) -> None:
    bad = [f"{name!r} ({str(t.dtype).removeprefix('torch.')})" for name, t in tensors.items()
           if t.dtype in _SAFETENSORS_NO]
    if bad:
        raise CheckpointError(f"safetensors has no type for {', '.join(bad[:5])} in step "
                              f"{loaded.step}", step=loaded.step, path=loaded.path,
                              hint="export with --to torch, or leave them out with --only")


def _check_materializable(name: str, t: torch.Tensor, *, step: int | None = None,
                         path: str | None = None) -> None:
    """Refuse a tensor whose elements are more bytes than its storage holds: a view with
    overlapping strides (a stride of 0) that a header may declare over a few stored bytes.
    Writing it out whole, or assembling it, would allocate what the file does not hold."""
    whole = t.numel() * t.element_size()
    stored = t.untyped_storage().nbytes()
    if whole > stored:
        raise CheckpointIntegrityError(
            f"tensor {name} is a view of {whole} bytes over {stored} stored bytes "
            f"(shape {list(t.shape)}, stride {list(t.stride())}): writing it whole would "
            "allocate memory the checkpoint does not hold", step=step, path=path,
            hint="a crafted or corrupt header; check the step with `ckpt-pipeline verify`, "
                 "or leave the tensor out with --only")


def _own_memory(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None
                ) -> dict[str, torch.Tensor]:
    """Every tensor in memory of its own, cast to ``dtype`` if floating: a loaded tensor may
    view a larger block that holds other tensors too, which neither format must write. The
    same view under two names gets one copy, shared by both names."""
    copies: dict[Any, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        t = tensors[name]
        _check_materializable(name, t)
        key: Any = _key(t) if t.numel() else ("empty", name)
        if key not in copies:
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                copies[key] = t.to(dtype).contiguous()
            elif (t.is_contiguous() and t.storage_offset() == 0
                  and t.untyped_storage().nbytes() == _nbytes(t)):
                copies[key] = t
            else:
                copies[key] = t.contiguous().clone()
        out[name] = copies[key]
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _split(tensors: Mapping[str, torch.Tensor], limit: int | None) -> list[list[str]]:
    """Names in order, in shards of at most ``limit`` bytes (a larger tensor alone)."""
    names = sorted(tensors)
    if limit is None:
        return [names]
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = _nbytes(tensors[name])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _targets(out: Path, to: Format, count: int) -> list[Path]:
    if count == 1:
        return [out]
    stem, suffix = _stem(out, to)
    return [out.with_name(f"{stem}-{i:05d}-of-{count:05d}{suffix}") for i in range(1, count + 1)]


def _stem(out: Path, to: Format) -> tuple[str, str]:
    suffix = out.suffix or (".safetensors" if to == "safetensors" else ".bin")
    return (out.name[:-len(out.suffix)] if out.suffix else out.name), suffix


def _index_path(out: Path, to: Format) -> Path:
    stem, suffix = _stem(out, to)
    return out.with_name(f"{stem}{suffix}.index.json")


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError("exporting to safetensors needs the safetensors package",
                          hint="pip install 'ckpt_pipeline[export]'") from None
    return safetensors.torch


def _write(path: Path, tensors: dict[str, torch.Tensor], to: Format,
           metadata: dict[str, str]) -> None:
    if to == "safetensors":
        save_file = _safetensors().save_file
        _atomic(path, lambda temp: save_file(tensors, str(temp), metadata=metadata))
    else:
        _atomic(path, lambda temp: torch.save(tensors, str(temp)))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    _atomic(path, lambda temp: temp.write_text(json.dumps(data, indent=2) + "\n"))


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` a temporary file beside ``path``, fsync it, rename it over ``path``, fsync the
    directory; nothing is left behind when it fails."""
    temp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
    try:
        write(temp)
        _fsync(temp)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
