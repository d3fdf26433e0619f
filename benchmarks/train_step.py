"""Training-step throughput: mila_py Llama vs the same model in PyTorch eager, in one run.

A step is forward + cross-entropy + backward + AdamW on a ~10M-parameter byte-level Llama
(dim 384, 6 layers, 6/2 heads, SwiGLU 1024, vocab 256), B=4, T=256, fp32 on the CPU. PyTorch
runs when installed, with the same shapes and the same thread count.

Run: ``python benchmarks/train_step.py [--steps 10]``. Prints ms/step, tokens/s and, per round,
the throughput ratio of the two.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from _torch_llama import torch_train_step

from mila_py import BuildContext, RuntimeMode
from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW

CFG = LlamaConfig(
    vocab_size=256, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=1024, max_seq_len=256
)


def _interleaved(candidates: dict[str, Callable[[], object]], steps: int) -> dict[str, list[float]]:
    """Seconds per step of every candidate, in rounds that run each candidate's step once.

    Alternating keeps both under the same background load (a shared machine drifts by 10-20% over a
    minute), so the per-round ratios are steadier than a ratio of two separate medians.
    """
    for fn in candidates.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(steps):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def mila_step(
    n_b: int, n_t: int, tokens: np.ndarray, targets: np.ndarray
) -> tuple[Callable[[], object], int]:
    model = Llama("llama", CFG, device="CPU")
    model.build(BuildContext((n_b, n_t), RuntimeMode.TRAINING))
    loss_fn = SoftmaxCrossEntropy("loss", SoftmaxCrossEntropyConfig(CFG.vocab_size), device="CPU")
    loss_fn.build(BuildContext((n_b, n_t, CFG.vocab_size), RuntimeMode.TRAINING))
    opt = AdamW(model, lr=1e-3, weight_decay=0.1)

    def step() -> float:
        loss = loss_fn.forward(model.forward(tokens), targets)
        model.backward(loss_fn.backward())
        opt.step()
        model.zero_gradients()
        return loss

    return step, model.parameter_count()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, size=(args.batch, args.seq))
    targets = rng.integers(0, CFG.vocab_size, size=(args.batch, args.seq))
    n_tokens = args.batch * args.seq

    step, params = mila_step(args.batch, args.seq, tokens, targets)
    candidates: dict[str, Callable[[], object]] = {"mila_py (NumPy + Numba)": step}
    try:
        import torch

        candidates[f"PyTorch {torch.__version__} eager"] = torch_train_step(CFG, tokens, targets)
    except ImportError as exc:
        print(f"(PyTorch skipped: {exc})")
    times = _interleaved(candidates, args.steps)
    print(
        f"\nLlama training step, {params / 1e6:.1f}M parameters, B={args.batch} T={args.seq}, "
        f"fp32 CPU; {args.steps} interleaved rounds"
    )
    print(f"{'what':<28} {'ms/step':>9} {'tokens/s':>10} {'x mila_py':>10}")
    base = times["mila_py (NumPy + Numba)"]
    for name, seconds in times.items():
        median = statistics.median(seconds)
        # median over rounds of this round's throughput relative to mila_py's
        ratio = statistics.median(b / t for b, t in zip(base, seconds, strict=True))
        print(f"{name:<28} {median * 1e3:9.1f} {n_tokens / median:10,.0f} {ratio:10.2f}")
    for name, seconds in times.items():
        if seconds is not base:
            speed = statistics.median(t / b for b, t in zip(base, seconds, strict=True))
            print(f"mila_py throughput / {name}: {speed:.2f}x")


if __name__ == "__main__":
    main()
