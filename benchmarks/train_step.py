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

from mila_py import BuildContext, RuntimeMode
from mila_py.components import Llama, LlamaConfig, SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.optim import AdamW

CFG = LlamaConfig(
    vocab_size=256, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=1024, max_seq_len=256
)


def _interleaved(candidates: dict[str, Callable[[], object]], steps: int) -> dict[str, list[float]]:
    """Seconds per step of every candidate, in rounds that run each candidate's step once.

    Alternating keeps both under the same background load (a shared VM drifts by 10-20% over a
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


def torch_step(n_b: int, n_t: int, tokens: np.ndarray, targets: np.ndarray) -> Callable[[], object]:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    d, hq, hk = CFG.dim, CFG.n_heads, CFG.n_kv_heads
    hd = d // hq

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1 = torch.nn.RMSNorm(d, eps=CFG.norm_eps)
            self.n2 = torch.nn.RMSNorm(d, eps=CFG.norm_eps)
            self.qkv = torch.nn.Linear(d, (hq + 2 * hk) * hd, bias=False)
            self.o = torch.nn.Linear(hq * hd, d, bias=False)
            self.gate = torch.nn.Linear(d, CFG.hidden_dim, bias=False)
            self.up = torch.nn.Linear(d, CFG.hidden_dim, bias=False)
            self.down = torch.nn.Linear(CFG.hidden_dim, d, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).split([hq * hd, hk * hd, hk * hd], dim=-1)
            q = q.view(b, t, hq, hd).transpose(1, 2)
            k = k.view(b, t, hk, hd).transpose(1, 2)
            v = v.view(b, t, hk, hd).transpose(1, 2)

            def rot(x: torch.Tensor) -> torch.Tensor:
                x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
                return x * cos + torch.cat((-x2, x1), dim=-1) * sin

            q, k = rot(q), rot(k)
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = x + self.o(a.transpose(1, 2).reshape(b, t, hq * hd))
            m = self.n2(h)
            return h + self.down(F.silu(self.gate(m)) * self.up(m))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(CFG.vocab_size, d)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(CFG.n_layers))
            self.norm = torch.nn.RMSNorm(d, eps=CFG.norm_eps)
            self.head = torch.nn.Linear(d, CFG.vocab_size, bias=False)
            inv = 1.0 / (CFG.rope_base ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.outer(torch.arange(n_t).float(), inv)
            emb = torch.cat((ang, ang), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()

        def forward(self, tok: torch.Tensor) -> torch.Tensor:
            x = self.emb(tok)
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            return self.head(self.norm(x))

    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tok = torch.from_numpy(tokens)
    tgt = torch.from_numpy(targets)

    def step() -> float:
        logits = model(tok)
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), tgt.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return float(loss.detach())

    return step


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

        candidates[f"PyTorch {torch.__version__} eager"] = torch_step(
            args.batch, args.seq, tokens, targets
        )
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
