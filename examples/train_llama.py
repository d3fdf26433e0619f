"""Train a small byte-level Llama with mila_py on a real text corpus.

By default the corpus is the Python standard library's own source code (every Python install has
it); ``--data PATH`` trains on any text file instead. Prints a progress bar with the loss and
tokens/s, then the held-out loss before and after training and the memory table of the build.
``examples/train_and_generate.py`` goes on to generate text with the trained weights.

Run: ``python examples/train_llama.py --steps 200`` (``--help`` for the model and run options).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mila_py import BuildContext, RuntimeMode, TrainingMode
from mila_py.components import Llama, LlamaConfig, SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.optim import AdamW, clip_grad_norm


def load_corpus(path: str | None, max_bytes: int) -> np.ndarray:
    """Bytes of ``path``, or of the standard library's ``*.py`` files, as uint8 tokens."""
    if path:
        data = Path(path).read_bytes()[:max_bytes]
    else:
        stdlib = Path(os.path.dirname(os.__file__))
        chunks, size = [], 0
        for file in sorted(stdlib.glob("*.py")):
            blob = file.read_bytes()
            chunks.append(blob)
            size += len(blob)
            if size >= max_bytes:
                break
        data = b"".join(chunks)[:max_bytes]
    if len(data) < 1024:
        sys.exit(f"corpus too small: {len(data)} bytes")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64)


def batches(tokens: np.ndarray, batch: int, seq: int, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """Random windows: inputs ``[B, T]`` and next-token targets ``[B, T]``."""
    while True:
        starts = rng.integers(0, tokens.size - seq - 1, size=batch)
        window = np.stack([tokens[s : s + seq + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def evaluate(
    model: Llama, loss_fn: SoftmaxCrossEntropy, data: list[tuple[np.ndarray, np.ndarray]]
) -> float:
    return float(np.mean([loss_fn.forward(model.forward(x), y) for x, y in data]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data", help="a text file (default: the Python standard library source)")
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokens = load_corpus(args.data, args.max_bytes)
    split = int(tokens.size * 0.95)
    train_tokens, held_out = tokens[:split], tokens[split:]
    rng = np.random.default_rng(args.seed)
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
    opt = AdamW(model, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    print(f"{model.parameter_count():,} parameters, {tokens.size:,} tokens of text")

    eval_batches = [
        next(batches(held_out, args.batch, args.seq, np.random.default_rng(1))) for _ in range(4)
    ]
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
        clip_grad_norm(model, 1.0)
        opt.lr = args.lr * min(1.0, (step + 1) / 20)  # short warmup
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
