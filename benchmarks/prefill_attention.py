"""Prefill attention in query blocks vs one call, on the CPU, in one run.

An INFERENCE prefill keeps no attention probabilities, so ``CpuAttentionOp.prefill`` runs
:func:`mila_py.ops.cpu.attention.attention_prefill`: query blocks of ``PREFILL_BLOCK`` rows, each
against the keys up to its last query. The baseline is :func:`attention_forward` over the whole
chunk (what a TRAINING forward runs, scoring and masking every key past each query). Both use
the fused softmax when Numba is installed; they alternate, and the best of the rounds counts.

Shapes: one sequence, 6 query / 2 key heads of 64 (the ~10M Llama of ``generate.py``), chunks
of 256, 900 and 2048 tokens at position 0 and a 512-token chunk after 512 cached ones.

Run: ``python benchmarks/prefill_attention.py [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from mila_py.ops.cpu import _fused_attention
from mila_py.ops.cpu.attention import PREFILL_BLOCK, attention_forward, attention_prefill

HEADS, KV_HEADS, HEAD_DIM, SCALE = 6, 2, 64, 0.125
CASES = ((256, 0), (900, 0), (2048, 0), (512, 512))  # (chunk, position offset)


def best_seconds(candidates: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best wall-clock seconds of each candidate over ``rounds`` alternating rounds."""
    for fn in candidates.values():
        fn()
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    softmax = _fused_attention.causal_softmax if _fused_attention.AVAILABLE else None
    rng = np.random.default_rng(0)
    print(f"fp32, heads {HEADS}/{KV_HEADS} of {HEAD_DIM}, blocks of {PREFILL_BLOCK} queries, "
          f"{'fused' if softmax else 'NumPy'} softmax, best of {args.rounds} rounds")  # fmt: skip
    print(f"{'chunk':>6} {'offset':>6} | {'one call ms':>11} {'blocked ms':>10} {'x':>6}")
    for n_tq, offset in CASES:
        q = rng.standard_normal((1, n_tq, HEADS * HEAD_DIM)).astype(np.float32)
        k = rng.standard_normal((1, offset + n_tq, KV_HEADS * HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal(k.shape).astype(np.float32)
        one, blocked = np.empty_like(q), np.empty_like(q)
        heads = (HEADS, KV_HEADS, SCALE)
        best = best_seconds(
            {
                "one": partial(
                    attention_forward, q, k, v, *heads, one, q_offset=offset, softmax=softmax
                ),
                "blocked": partial(attention_prefill, q, k, v, *heads, blocked, offset, softmax),
            },
            args.rounds,
        )
        np.testing.assert_allclose(blocked, one, rtol=1e-4, atol=1e-5)
        print(
            f"{n_tq:>6} {offset:>6} | {best['one'] * 1e3:11.2f} {best['blocked'] * 1e3:10.2f} "
            f"{best['one'] / best['blocked']:6.2f}"
        )


if __name__ == "__main__":
    main()
