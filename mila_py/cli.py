"""The ``mila-py`` command line (also ``python -m mila_py``): ``generate`` and ``chat`` (text
streamed to the terminal), ``serve`` (the OpenAI-compatible server of :mod:`mila_py.serve`) and
``prepare-data`` (token files for training).

Each subcommand is a pair of functions: ``_add_<name>(subparsers)`` declares its options and
``_<name>(args) -> int`` runs it; :func:`build_parser` registers every pair.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``mila-py`` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="mila-py", description="mila_py: build, train and serve Llama-style models."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(subparsers)
    _add_chat(subparsers)
    _add_serve(subparsers)
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
    except (OSError, ValueError, RuntimeError, MemoryError, ImportError) as exc:
        print(f"mila-py {args.command}: {exc}", file=sys.stderr)
        return 1


def _add_model_options(command: argparse.ArgumentParser, *, sampling: bool = True) -> None:
    """MODEL_DIR and the options of loading it (and, with ``sampling``, of generating)."""
    command.add_argument(
        "model_dir", metavar="MODEL_DIR", help="a Hugging Face folder with tokenizer.json"
    )
    command.add_argument("--device", default="CPU", help="CPU or CUDA:N (default: %(default)s)")
    command.add_argument(
        "--seq-len",
        type=int,
        metavar="N",
        help="the context the model is built for (default: the checkpoint's)",
    )
    if not sampling:
        return
    command.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="at most N new tokens (default: the checkpoint's, else 64)",
    )
    for name, kind, metavar, what in (
        ("--temperature", float, "T", "0 is greedy; default: the checkpoint's, else 0"),
        ("--top-p", float, "P", "nucleus sampling's probability mass"),
        ("--top-k", int, "K", "sample among the K most likely tokens"),
    ):
        command.add_argument(
            name,
            type=kind,
            metavar=metavar,
            help=what if name == "--temperature" else f"{what}; default: the checkpoint's",
        )
    command.add_argument("--seed", type=int, metavar="S", help="seeds the sampling")


def _load(args: argparse.Namespace, batch_size: int = 1) -> Any:
    from mila_py.models import Llama

    model = Llama.from_pretrained(
        args.model_dir, device=args.device, batch_size=batch_size, seq_len=args.seq_len
    )
    if model.tokenizer is None:  # refused before a first line is read or a port is opened
        raise ValueError(
            f"{args.model_dir} has no tokenizer.json; {args.command} needs the checkpoint's "
            "tokenizer in the folder"
        )
    return model


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
    }


def _write(stream: Any, out: TextIO) -> None:
    """Write the pieces of a text stream as they come (closing it, even when interrupted)."""
    with stream:
        for piece in stream:
            out.write(piece)
            out.flush()
    out.write("\n")
    out.flush()


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    command = subparsers.add_parser(
        "generate",
        help="continue a prompt, streaming the text to stdout",
        description="Load MODEL_DIR (config.json, weights, tokenizer.json) and write the "
        "text generated after --prompt to stdout as it is generated.",
    )
    _add_model_options(command)
    command.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    command.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    model = _load(args)
    _write(model.stream_text(args.prompt, **_sampling(args)), sys.stdout)
    return 0


def _add_chat(subparsers: argparse._SubParsersAction) -> None:
    command = subparsers.add_parser(
        "chat",
        help="talk with a chat model on the terminal",
        description="Load MODEL_DIR and chat: each line read from stdin is a user turn, "
        "answered as it is generated, with the whole conversation as context; end with "
        "/exit or end of input (Ctrl-D).",
    )
    _add_model_options(command)
    command.add_argument("--system", metavar="TEXT", help="a system message to start with")
    command.set_defaults(func=_chat)


def _chat(args: argparse.Namespace) -> int:
    model = _load(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        history.append({"role": "user", "content": line.rstrip("\n")})
        stream = model.stream_text(history, **_sampling(args))
        _write(stream, sys.stdout)
        history.append({"role": "assistant", "content": stream.text})


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    command = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Load MODEL_DIR and serve it at http://HOST:PORT/v1 (/models, "
        "/completions, /chat/completions) for OpenAI clients. Needs the serve extra "
        '(pip install "mila-py[serve]").',
    )
    _add_model_options(command, sampling=False)
    command.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    command.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    command.add_argument(
        "--model-name", metavar="NAME", help="the name clients ask for (default: the folder's)"
    )
    command.add_argument(
        "--batch-size",
        type=int,
        default=1,
        metavar="N",
        help="prompts generated together in a request (default: %(default)s)",
    )
    command.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from mila_py.serve import require_serving, run_server

    require_serving()  # before the model is loaded
    name = args.model_name or Path(args.model_dir).resolve().name
    model = _load(args, batch_size=args.batch_size)
    print(f"serving {name} at http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    run_server(model, name, host=args.host, port=args.port)
    return 0


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
