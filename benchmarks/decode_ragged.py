"""Ragged vs uniform batched decode: the cost of per-sequence positions, in one run.

A batch of ``--batch`` sequences decodes one token each through a ~10M-parameter Llama (random
weights, fp32, CPU): once with every sequence at the same position (the baseline: no mask) and
once with every sequence at its own position (each attends to its own cached keys). Prints
ms per decode step of each and the ratio.

Run: ``python benchmarks/decode_ragged.py [--batch 8] [--steps 100]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from mila_py import BuildContext, RuntimeMode
from mila_py.models import Llama, LlamaConfig

CFG = LlamaConfig(
    vocab_size=4096, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=1024, max_seq_len=1024
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    model = Llama("llama", CFG, device="CPU")
    model.build(
        BuildContext(
            (args.batch, CFG.max_seq_len),
            RuntimeMode.INFERENCE,
            initialize_parameters=True,
            prefill_size=args.prompt,
        )
    )
    rng = np.random.default_rng(0)
    model.prefill(rng.integers(0, CFG.vocab_size, size=(args.batch, args.prompt)))
    tokens = rng.integers(0, CFG.vocab_size, size=args.batch)
    last = args.prompt - 1
    cases = {
        "uniform (all at one position)": last,
        "ragged (one position each)": np.arange(last - args.batch + 1, last + 1),
    }
    prompt = [args.prompt] * args.batch

    def decode(position: Any) -> None:
        # every call decodes over the same prompt: its cache rows are all still the prefill's
        # (a decode rewrites one row per sequence), so the record of cached positions, which
        # a rewind shortens, is set back to the whole prompt first
        model._cached.lengths[:] = prompt  # type: ignore[union-attr]
        model.decode(tokens, position)

    for position in cases.values():  # warm caches and compiled kernels
        decode(position)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.steps):  # interleaved: both see the same background load
        for name, position in cases.items():
            start = time.perf_counter()
            decode(position)
            times[name].append(time.perf_counter() - start)
    base = times["uniform (all at one position)"]
    print(
        f"\nbatched decode, B={args.batch}, {model.parameter_count() / 1e6:.1f}M params, fp32 CPU"
    )
    print(f"{'what':<32} {'ms/step':>8} {'x uniform':>10}")
    for name, seconds in times.items():
        ratio = statistics.median(t / b for t, b in zip(seconds, base, strict=True))
        print(f"{name:<32} {statistics.median(seconds) * 1e3:8.2f} {ratio:10.2f}")


if __name__ == "__main__":
    main()
