"""Train a small byte-level Llama with mila_py on a real text corpus.

By default the corpus is the Python standard library's own source code (every Python install has
it); ``--data PATH`` trains on any text file instead. Prints a progress bar with the loss and
tokens/s, then the held-out loss before and after training and the memory table of the build.
``examples/train_and_generate.py`` goes on to generate text with the trained weights.

Run: ``python examples/train_llama.py --steps 200`` (``--help`` for the model and run options).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from mila_py import BuildContext, RuntimeMode, TrainingMode
from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW, clip_grad_norm


def load_corpus(path: str | None, max_bytes: int) -> np.ndarray:
    """The first ``max_bytes`` bytes of ``path``, or of the standard library's ``*.py`` files,
    as uint8 tokens (a file is read no further than that)."""
    if path:
        try:
            with open(path, "rb") as file:
                data = file.read(max_bytes)
        except OSError as exc:
            sys.exit(f"--data {path}: cannot read it ({exc.strerror or exc})")
    else:
        stdlib = Path(os.path.dirname(os.__file__))
        chunks, size = [], 0
        for file_path in sorted(stdlib.glob("*.py")):
            blob = file_path.read_bytes()
            chunks.append(blob)
            size += len(blob)
            if size >= max_bytes:
                break
        data = b"".join(chunks)[:max_bytes]
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64)


def split_corpus(tokens: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """95% for training, 5% held out; each part must hold a window of ``seq + 1`` tokens."""
    split = int(tokens.size * 0.95)
    train, held_out = tokens[:split], tokens[split:]
    if held_out.size < seq + 1:
        need = 20 * (seq + 1)
        sys.exit(
            f"corpus too small: {tokens.size:,} bytes; --seq {seq} needs at least {need:,} "
            "(5% of the corpus is held out and must hold one window of seq + 1 bytes)"
        )
    return train, held_out


def batches(tokens: np.ndarray, batch: int, seq: int, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """Random windows: inputs ``[B, T]`` and next-token targets ``[B, T]`` (any start whose
    window of ``seq + 1`` tokens fits)."""
    while True:
        starts = rng.integers(0, tokens.size - seq, size=batch)
        window = np.stack([tokens[s : s + seq + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def held_out_batches(
    tokens: np.ndarray, batch: int, seq: int, count: int = 4
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` different batches of held-out windows, the same on every run."""
    windows = batches(tokens, batch, seq, np.random.default_rng(1))
    return [next(windows) for _ in range(count)]


def check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """``parser.error`` (a usage line and exit code 2) for an option below its minimum."""
    for name in names:
        value = getattr(args, name)
        least = 0 if name == "steps" else 1
        if value < least:
            parser.error(f"--{name.replace('_', '-')} must be >= {least}, got {value}")


def build_or_exit(parser: argparse.ArgumentParser, build: Any) -> Any:
    """``build()``, with a bad device or model option as a usage error, not a traceback."""
    try:
        return build()
    except (ValueError, RuntimeError, TypeError) as exc:
        parser.error(str(exc))


def evaluate(
    model: Llama, loss_fn: SoftmaxCrossEntropy, data: list[tuple[np.ndarray, np.ndarray]]
) -> float:
    return float(np.mean([loss_fn.forward(model.forward(x), y) for x, y in data]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data", help="a text file (default: the Python standard library source)")
    parser.add_argument("--device", default="CPU", help="CPU or CUDA:N (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="training steps (%(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (%(default)s)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (%(default)s)")
    parser.add_argument("--dim", type=int, default=128, help="model width (%(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (%(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="query heads (%(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (%(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW peak rate (%(default)s)")
    parser.add_argument(
        "--max-bytes", type=int, default=4_000_000, help="corpus bytes read (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="batch order seed (%(default)s)")
    args = parser.parse_args()
    check_positive(parser, args, "steps", "batch", "seq", "dim", "layers", "heads", "kv_heads")
    check_positive(parser, args, "max_bytes")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")

    tokens = load_corpus(args.data, args.max_bytes)
    train_tokens, held_out = split_corpus(tokens, args.seq)
    rng = np.random.default_rng(args.seed)

    def build() -> tuple[Llama, SoftmaxCrossEntropy]:
        cfg = LlamaConfig(
            vocab_size=256,
            dim=args.dim,
            n_layers=args.layers,
            n_heads=args.heads,
            n_kv_heads=args.kv_heads,
            hidden_dim=3 * args.dim,
            max_seq_len=max(256, args.seq),
        )
        model = Llama("llama", cfg, device=args.device)
        model.build(BuildContext((args.batch, args.seq), RuntimeMode.TRAINING))
        loss_fn = SoftmaxCrossEntropy(
            "loss", SoftmaxCrossEntropyConfig(cfg.vocab_size), device=args.device
        )
        loss_fn.build(BuildContext((args.batch, args.seq, cfg.vocab_size), RuntimeMode.TRAINING))
        return model, loss_fn

    model, loss_fn = build_or_exit(parser, build)
    opt = AdamW(model, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    print(f"{model.parameter_count():,} parameters, {tokens.size:,} tokens of text")

    eval_batches = held_out_batches(held_out, args.batch, args.seq)
    model.set_training_mode(TrainingMode.EVAL)
    before = evaluate(model, loss_fn, eval_batches)
    model.set_training_mode(TrainingMode.NORMAL)

    stream = batches(train_tokens, args.batch, args.seq, rng)
    bar = tqdm(range(args.steps), desc="train", unit="step", mininterval=1.0)
    start = time.perf_counter()
    for step in bar:
        x, y = next(stream)
        loss = loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        opt.lr = args.lr * min(1.0, (step + 1) / 20)  # short warmup
        if math.isfinite(clip_grad_norm(model, 1.0)):  # an inf/NaN gradient: skip the step
            opt.step()
        model.zero_gradients()
        rate = (step + 1) * x.size / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}", refresh=False)

    model.set_training_mode(TrainingMode.EVAL)
    after = evaluate(model, loss_fn, eval_batches)
    print(f"held-out loss: {before:.3f} before training, {after:.3f} after {args.steps} steps")
    print(model.get_memory_stats())


if __name__ == "__main__":
    main()
