"""CPU RoPE benchmark: mila_py against the memory-bound limit and Hugging Face, in one run.

Measures, for Q ``[B, T, Hq*d]`` and K ``[B, T, Hk*d]`` in fp32:

- the limit: an in-place pass that reads and writes every byte of Q and K once (NumPy, one
  thread; and a Numba pass split over every core when Numba is installed) — the best of them;
- mila_py ``Rope.forward`` (whole component call) with the fused and the NumPy paths;
- mila_py ``Rope.rotate`` at explicit positions ``[B, T]`` and, with a Qwen2-VL M-RoPE config
  (``mrope_section`` 16/24/24 for head_dim 128, else a third each), at positions ``[3, B, T]``;
- Hugging Face ``apply_rotary_pos_emb`` in torch eager, when torch and transformers are installed;
- ``Rope.decode`` for B=1 (whole component calls, every call checked), in microseconds per call:
  at an int position and with a position per sequence (``[B]``).

Run: ``python benchmarks/rope_cpu.py`` (``--help`` for shapes). Prints a table with ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import numpy as np

from mila_py import BuildContext, RuntimeMode
from mila_py.components import Rope, RopeConfig
from mila_py.ops.cpu import _rope_fused


def _interleaved_seconds(
    candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Seconds per call of every candidate, measured in rounds that run each candidate once.

    Interleaving puts every candidate under the same background load (other processes on a shared machine
    come and go over seconds), so ratios taken round by round are steadier than ratios of
    medians measured one candidate after another.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _per_call_seconds(fn: Callable[[], object], calls: int, rounds: int = 5) -> float:
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _threaded_negate() -> Callable[[np.ndarray], None] | None:
    """An in-place pass over ``x`` split over every core (Numba ``nogil`` kernel, thread pool).

    The same threading the fused RoPE kernel uses; Numba's ``parallel=True`` is not used here
    either, because its OpenMP threads keep spinning after the call and slow the next candidate.
    """
    if not _rope_fused.AVAILABLE:
        return None
    import numba

    from mila_py.ops.cpu.rope import _in_parallel, _row_ranges

    @numba.njit(nogil=True)
    def negate(part: np.ndarray) -> None:  # reads and writes every element once
        for i in range(part.size):  # from 0: no wraparound checks, a vectorized loop
            part[i] = -part[i]

    def run(x: np.ndarray) -> None:
        flat = x.reshape(-1)
        ranges = _row_ranges(x.shape[0] * x.shape[1])
        row = x.shape[2]
        _in_parallel(lambda r: negate(flat[r[0] * row : r[1] * row]), ranges)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    n_b, n_t, hq, hk, d = args.batch, args.tokens, args.heads, args.kv_heads, args.head_dim

    rng = np.random.default_rng(0)
    q = rng.standard_normal((n_b, n_t, hq * d), dtype=np.float32)
    k = rng.standard_normal((n_b, n_t, hk * d), dtype=np.float32)
    traffic = 2 * (q.nbytes + k.nbytes)  # read + write of Q and K
    cfg = RopeConfig(
        channels=hq * d, n_heads=hq, n_kv_heads=hk, max_seq_len=max(8192, n_t), base=500000.0
    )
    rope = Rope("rope", cfg, device="CPU")
    rope.build(BuildContext((n_b, n_t, hq * d), RuntimeMode.INFERENCE))

    def numpy_negate() -> None:
        np.negative(q, out=q)
        np.negative(k, out=k)

    limits = {"limit: NumPy in-place pass, 1 thread": numpy_negate}
    negate = _threaded_negate()
    if negate is not None:

        def numba_negate() -> None:
            negate(q)
            negate(k)

        limits["limit: Numba in-place pass, all cores"] = numba_negate

    backends = ["fused", "numpy"] if _rope_fused.AVAILABLE else ["numpy"]

    def forward(backend: str) -> Callable[[], object]:
        def call() -> None:
            rope.op.backend = backend
            rope.forward(q, k)

        return call

    third = d // 6
    section = (16, 24, 24) if d == 128 else (d // 2 - 2 * third, third, third)
    mrope = Rope("mrope", dataclasses.replace(cfg, mrope_section=section), device="CPU")
    mrope.build(BuildContext((n_b, n_t, hq * d), RuntimeMode.INFERENCE))
    explicit = np.broadcast_to(np.arange(n_t), (n_b, n_t))
    per_axis = np.stack([explicit, explicit % 64, explicit // 64])  # a 64-wide image grid

    def rotate(component: Rope, positions: np.ndarray, backend: str) -> Callable[[], object]:
        def call() -> None:
            component.op.backend = backend
            component.rotate(q, k, positions)

        return call

    candidates: dict[str, Callable[[], object]] = dict(limits)
    for backend in backends:
        candidates[f"mila_py Rope.forward ({backend})"] = forward(backend)
    for backend in backends:
        candidates[f"mila_py Rope.rotate [B,T] ({backend})"] = rotate(rope, explicit, backend)
        candidates[f"mila_py M-RoPE rotate [3,B,T] ({backend})"] = rotate(mrope, per_axis, backend)
    hf = "HF apply_rotary_pos_emb (torch eager)"
    try:
        import torch
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        torch.set_num_threads(max(1, torch.get_num_threads()))
        tq = torch.from_numpy(q.reshape(n_b, n_t, hq, d)).transpose(
            1, 2
        )  # [B, H, T, d] as HF has it
        tk = torch.from_numpy(k.reshape(n_b, n_t, hk, d)).transpose(1, 2)
        inv = 1.0 / (cfg.base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(n_t, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        cos, sin = emb.cos(), emb.sin()

        def hf_call() -> None:
            with torch.inference_mode():
                apply_rotary_pos_emb(tq, tk, cos, sin)

        candidates[hf] = hf_call
    except ImportError as exc:
        print(f"(Hugging Face skipped: {exc})")

    times = _interleaved_seconds(candidates, args.repeats)
    # each round's limit is the faster of the limit passes in that round
    round_limits = [min(rounds) for rounds in zip(*(times[name] for name in limits), strict=True)]
    print(
        f"\nRoPE fp32 prefill, B={n_b} T={n_t} heads={hq}/{hk} head_dim={d}; "
        f"Q+K traffic {traffic / 2**20:.1f} MiB (read + write); {args.repeats} interleaved rounds"
    )
    print(f"{'what':<44} {'ms':>9} {'GB/s':>8} {'x limit':>8}")
    print(f"{'(median time; median of per-round ratios)':<44}")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        ratio = statistics.median(t / lim for t, lim in zip(times[name], round_limits, strict=True))
        print(f"{name:<44} {seconds * 1e3:9.3f} {traffic / seconds / 1e9:8.2f} {ratio:8.2f}")
    if hf in times:
        for backend in backends:
            speedup = statistics.median(
                h / m
                for h, m in zip(times[hf], times[f"mila_py Rope.forward ({backend})"], strict=True)
            )
            print(f"speedup of mila_py ({backend}) over HF eager: {speedup:.1f}x")

    # decode: the whole component call for B=1, T=1
    dq = rng.standard_normal((1, 1, hq * d), dtype=np.float32)
    dk = rng.standard_normal((1, 1, hk * d), dtype=np.float32)
    each = np.array([1234])  # a position per sequence (B=1)

    print(f"\n{'Rope.decode B=1 (whole call)':<46} {'us/call':>9}")
    for backend in backends:
        rope.op.backend = backend
        for label, call in (
            ("position int", lambda: rope.decode(dq, dk, 1234)),
            ("positions [B]", lambda: rope.decode(dq, dk, each)),
        ):
            seconds = _per_call_seconds(call, calls=2000)
            print(f"{'  ' + backend + ', ' + label:<46} {seconds * 1e6:9.2f}")
    rope.op.backend = "auto"


if __name__ == "__main__":
    main()
