"""Decode plan vs the components' own calls: the host work of one decode step, in one run.

``Llama.decode`` runs a *decode plan* (every layer's ops bound once to the build's buffers); the
baseline is ``Llama._decode_components``, the same step through the components' checked calls.
Both run on the same model, interleaved, one token per call at a fixed position, and the table
gives µs per token and per layer and the speedup of the plan.

A small model (dim 64, 4 layers) keeps the arithmetic negligible, so what is measured is the
host work per step, which bounds decode latency on a GPU (every op is a kernel launch of a few
microseconds there) and matters for small models on the CPU:

- ``--device CPU``: the CPU ops (BLAS, the fused kernels of the ``jit`` extra).
- ``--device CUDA:0``: a GPU, with a stream synchronization after each step.

Run: ``python benchmarks/decode_plan.py [--device CPU | --device CUDA:0] [--batch B [--ragged]]``
(``--ragged``: every sequence at its own position).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py import BuildContext, RuntimeMode
from mila_py.models import Llama, LlamaConfig

CFG = LlamaConfig(
    vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=192, max_seq_len=512
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--ragged", action="store_true", help="one position per sequence (needs --batch >= 2)"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = args.device
    prompt = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(args.batch, 33))
    model = prefilled_model(device, prompt[:, :32])
    ctx = model.execution_context
    token = prompt[:, 32]
    column = ctx.to_device(token.reshape(-1, 1))  # the components take device arrays
    at: Any = np.arange(32 - args.batch + 1, 33) if args.ragged else 32
    cases: dict[str, Callable[[], object]] = {
        "components (checked calls)": lambda: model._decode_components(column, at),
        "decode plan": lambda: model.decode(token, at),
    }
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm: plans, compiled kernels, caches
        fn()
    ctx.synchronize()
    for _ in range(args.rounds):  # interleaved rounds: both see the same background load
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                fn()
            ctx.synchronize()
            seconds[name].append((time.perf_counter() - start) / args.steps)
    print(
        f"\ndecode step, B={args.batch}{' (ragged)' if args.ragged else ''}, "
        f"{model.parameter_count() / 1e6:.2f}M params, "
        f"{CFG.n_layers} layers, fp32, {device}; best of {args.rounds} rounds of {args.steps}"
    )
    print(f"{'path':<28} {'us/token':>9} {'us/layer':>9} {'x components':>13}")
    base = min(seconds["components (checked calls)"])
    for name, times in seconds.items():
        best = min(times)
        print(f"{name:<28} {best * 1e6:9.1f} {best * 1e6 / CFG.n_layers:9.1f} {base / best:13.2f}")
    pairs = zip(seconds["components (checked calls)"], seconds["decode plan"], strict=True)
    ratios = [b / p for b, p in pairs]
    print(f"plan speedup per round: median {statistics.median(ratios):.2f}x")


def prefilled_model(device: str, prompt: np.ndarray) -> Llama:
    """The benchmark's model on ``device``, built for ``prompt``'s batch, ``prompt`` prefilled."""
    model = Llama("llama", CFG, device=device)
    model.build(
        BuildContext(
            (prompt.shape[0], CFG.max_seq_len),
            RuntimeMode.INFERENCE,
            initialize_parameters=True,
            prefill_size=32,
        )
    )
    model.prefill(prompt)
    return model


if __name__ == "__main__":
    main()
