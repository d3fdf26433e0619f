"""The ``mila-py`` command line (also ``python -m mila_py``).

Each subcommand is a pair of functions: ``_add_<name>(subparsers)`` declares its options and
``_<name>(args) -> int`` runs it; :func:`build_parser` registers every pair.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``mila-py`` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="mila-py", description="mila_py: build, train and serve Llama-style models."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_prepare_data(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mila-py`` with ``argv`` (default: the process's arguments); the exit status.

    A usage error exits with status 2 (argparse); an error of the command itself prints
    ``mila-py <command>: <message>`` and returns 1.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (OSError, ValueError) as exc:
        print(f"mila-py {args.command}: {exc}", file=sys.stderr)
        return 1


def _add_prepare_data(subparsers: argparse._SubParsersAction) -> None:
    command = subparsers.add_parser(
        "prepare-data",
        help="tokenize text files into a memory-mapped token file",
        description=(
            "Tokenize text files (each one document) into OUT/tokens.bin and OUT/tokens.json "
            "for mila_py.data.TokenDataset. Without --tokenizer the ids are the bytes (0..255)."
        ),
    )
    command.add_argument(
        "--tokenizer", metavar="DIR", help="a folder with tokenizer.json (default: byte-level)"
    )
    command.add_argument("--out", metavar="DIR", required=True, help="the output folder")
    command.add_argument(
        "--eos-token", metavar="TEXT", help="the end-of-sequence token put between documents "
        "(default: tokenizer_config.json's eos_token, if any)",
    )  # fmt: skip
    command.add_argument("files", nargs="+", metavar="FILES", help="text files, in order")
    command.set_defaults(func=_prepare_data)


def _prepare_data(args: argparse.Namespace) -> int:
    from mila_py.data import META_FILE, prepare_data, read_meta

    out = prepare_data(args.tokenizer, args.out, args.files, eos_token=args.eos_token)
    meta = read_meta(out)
    print(
        f"{meta['count']:,} tokens ({meta['dtype']}, vocabulary {meta['vocab_size']:,}) from "
        f"{len(args.files)} file(s) in {out} ({META_FILE} describes them)"
    )
    return 0
