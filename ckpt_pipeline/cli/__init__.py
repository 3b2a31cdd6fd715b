"""The ``ckpt-pipeline`` command: list the checkpoints under a root, verify, show and export
them.

``ls`` takes a cheap look (names, sizes, commit records, manifests, shard headers); ``verify``
reads every byte of tensor data and checks it against its checksum, as a restore would;
``show`` prints a step's tensors and TrainState from its header; ``export`` writes a step's
tensors as safetensors or torch files. These only read the root: nothing under it is created,
changed or removed. ``clean`` is the exception: it removes a job's memory tier files. Given a URL (a persistent tier, ``_remote``), they list its steps, and
download, verify, show or export its complete steps through a temporary directory.

This module is the entry point (``main``, the console script ``ckpt_pipeline.cli:main``) and
the command line: it parses the arguments, opens the root and runs the command (``_ls``,
``_verify``), turning errors into an exit status and a message. ``python -m
ckpt_pipeline.cli`` runs it too (``__main__``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from .._format.names import parse_rank_file
from .._format.steps import step_dirs
from .._tiers.persistent.urls import is_url
from ..errors import CheckpointError
from ..storage import LocalStorage, Storage
from ._clean import cmd_clean
from ._export import cmd_export
from ._ls import cmd_ls
from ._remote import cmd_ls_remote, cmd_verify_remote
from ._show import cmd_show, cmd_show_remote
from ._status import EXIT_FAILED, EXIT_USAGE, UsageError
from ._verify import cmd_verify

__all__ = ("main",)

_PROG = "ckpt-pipeline"


def _open_root(root: str) -> LocalStorage:
    """The root the command reads; a usage error when it is not a directory."""
    path = os.path.abspath(root)
    if not os.path.exists(path):
        raise UsageError(f"no checkpoint root at {path}")
    if not os.path.isdir(path):
        raise UsageError(f"{path} is not a directory")
    return LocalStorage(path)


def _default_rank(storage: Storage) -> int:
    """The rank to look at without ``--rank``: 0, unless the root holds one other rank's
    files only (the one-root-per-rank layout: rank 1's own root holds rank 1's files)."""
    ranks: set[int] = set()
    try:
        for dir_name in step_dirs(storage).values():
            for entry in storage.list_dir(dir_name):
                parsed = parse_rank_file(entry.name)
                if parsed is not None:
                    ranks.add(parsed[0])
            if len(ranks) > 1 or 0 in ranks:
                return 0
    except CheckpointError:
        return 0
    return ranks.pop() if len(ranks) == 1 else 0


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG, description="Inspect and verify ckpt_pipeline checkpoints (read-only).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ls = commands.add_parser("ls", help="list the steps under a checkpoint root",
                             description="List every step directory under ROOT, newest "
                                         "first, as one rank sees it.")
    ls.set_defaults(handler=cmd_ls)

    verify = commands.add_parser(
        "verify", help="read a step back and check every checksum",
        description="Read every byte of tensor data of the newest valid step (or the step "
                    "given) and check it against its checksum; decode the state tree and the "
                    "TrainState. Exit status 0 when every step verified, 1 when one failed.")
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--step", type=_nonneg_int, metavar="N", help="verify step N")
    which.add_argument("--all", action="store_true", help="verify every step")
    verify.set_defaults(handler=cmd_verify)

    show = commands.add_parser(
        "show", help="the tensors and TrainState of a step (from its header)",
        description="Print every tensor of the newest step (or --step N) with its path, "
                    "dtype, shape and bytes, and the TrainState with its extra fields. Reads "
                    "the step's header only.")
    show.add_argument("root", metavar="ROOT", help="the checkpoint root directory, or the URL "
                      "of a persistent tier (its complete steps)")
    show.add_argument("--step", type=_nonneg_int, metavar="N", help="show step N")
    show.set_defaults(handler=cmd_show)

    export = commands.add_parser(
        "export", help="write a step's tensors as safetensors or torch files",
        description="Read the newest step (or --step N), verify it, and write its tensors "
                    "to OUT as safetensors (Hugging Face layout, sharded with an index file "
                    "past --max-shard-size) or as a torch file that torch.load(..., "
                    "weights_only=True) reads. Tied weights are stored once. The root is "
                    "only read.")
    export.add_argument("root", metavar="ROOT", help="the checkpoint root directory, or the "
                        "URL of a persistent tier (its complete steps)")
    export.add_argument("out", metavar="OUT",
                        help="the file to write (model.safetensors, pytorch_model.bin); shards "
                             "and the index file go beside it")
    export.add_argument("--step", type=_nonneg_int, metavar="N", help="export step N")
    export.add_argument("--to", choices=("safetensors", "torch"), default="safetensors",
                        help="the format (default safetensors)")
    export.add_argument("--only", metavar="SUBTREE",
                        help="export this subtree of the saved state only (e.g. model)")
    export.add_argument("--strip-prefix", metavar="PREFIX",
                        help="remove PREFIX from tensor names (e.g. _orig_mod. of "
                             "torch.compile)")
    export.add_argument("--dtype", metavar="DTYPE",
                        help="cast floating-point tensors to bf16, fp16 or fp32")
    export.add_argument("--max-shard-size", metavar="SIZE",
                        help="split into files of at most SIZE (5GB, 500MiB) with an index")
    export.add_argument("--force", action="store_true", help="replace existing files")
    export.set_defaults(handler=cmd_export)

    clean = commands.add_parser(
        "clean", help="remove a job's memory tier files (memory=)",
        description="Remove the memory steps and shared-memory buffers under DIR, a memory "
                    "tier's directory (MemoryConfig(path=)), of every rank or of --rank R. "
                    "A rank whose pipeline is still open is left as it is (exit status 1). "
                    "Memory steps that are not on disk are lost: this is for a job that is "
                    "done, or that will restart from disk.")
    clean.add_argument("root", metavar="DIR", help="the memory tier's directory")
    clean.add_argument("--rank", type=_nonneg_int, default=None, metavar="R",
                       help="only rank R's files")
    clean.add_argument("--json", action="store_true", help="print JSON for scripts")
    clean.add_argument("--option", action="append", help=argparse.SUPPRESS)
    clean.set_defaults(handler=cmd_clean)

    for sub in (show, export):
        sub.add_argument("--rank", type=_nonneg_int, default=None, metavar="R",
                         help="the files of rank R (default 0)" if sub is show else
                         argparse.SUPPRESS)
        sub.add_argument("--json", action="store_true", help="print JSON for scripts")
        sub.add_argument("--option", action="append", metavar="KEY=VALUE",
                         help="for a URL: a setting of its store, such as "
                              "endpoint=http://host:9000 for S3 (repeatable)")

    for sub in (ls, verify):
        sub.add_argument("root", metavar="ROOT",
                         help="the checkpoint root directory, or the URL (or shared directory, "
                              "as file://PATH) of a persistent tier")
        sub.add_argument("--rank", type=_nonneg_int, default=None, metavar="R",
                         help="look at the files of rank R (default 0; for a persistent tier: "
                              "every rank)")
        sub.add_argument("--option", action="append", metavar="KEY=VALUE",
                         help="for a URL: a setting of its store, such as "
                              "endpoint=http://host:9000 for S3 (repeatable)")
        sub.add_argument("--json", action="store_true", help="print JSON for scripts")
    return parser


def _error(message: str) -> None:
    print(f"{_PROG}: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit status (0 ok, 1 a check failed, 2 usage error)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    handler: Callable[[Storage, argparse.Namespace], int] = args.handler
    try:
        if is_url(args.root):
            if handler is cmd_export:
                return cmd_export(args.root, args)
            if handler is cmd_show:
                args.rank = 0 if args.rank is None else args.rank
                return cmd_show_remote(args.root, args)
            remote = cmd_ls_remote if handler is cmd_ls else cmd_verify_remote
            return remote(args.root, args)
        if args.option:
            raise UsageError("--option applies to a URL only")
        storage = _open_root(args.root)
        if args.rank is None and handler is not cmd_clean:
            args.rank = _default_rank(storage)
        return handler(storage, args)
    except UsageError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except CheckpointError as exc:
        _error(str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (``| head``): silence the flush at exit too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except OSError as exc:  # a file the command was pointed at or writes (not a root's)
        _error(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
        return EXIT_FAILED
    except Exception as exc:  # a bug: one line, never a traceback (docs/cli.md)
        _error(f"internal error: {type(exc).__name__}: {exc} (a bug of ckpt-pipeline: "
               "please report it with the command line)")
        return EXIT_FAILED
