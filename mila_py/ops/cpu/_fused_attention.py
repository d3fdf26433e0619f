"""Fused CPU kernels of attention (Numba, the ``jit`` extra).

- :func:`causal_softmax`: the softmax over each row's visible keys, in place (the masked keys are
  never exponentiated: they are set to 0);
- :func:`softmax_backward_rows`: ``dp = (dp - row) * p`` in one pass;
- :func:`decode_attention`: attention of one query token per sequence over its cached keys
  (scores, softmax and the weighted sum of values per head, no matmul calls).

:class:`mila_py.ops.cpu.attention.CpuAttentionOp` uses them when Numba is installed and
``MILA_PY_CPU_BACKEND`` is not ``numpy``; the NumPy passes of ``attention.py`` are the
references. Importing this module never fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.ops.cpu._fused_math import (
    AVAILABLE,
    jit_exp,
    k_exp_shifted,
    k_row_max,
    k_row_sum,
    kernel_exp,
    numba,
)

__all__ = ["causal_softmax", "decode_attention", "softmax_backward_rows"]


def _causal_softmax_rows(s, q_offset, causal):
    # s [R, Tq, Tk] scores -> probabilities; query t sees keys 0 .. q_offset + t if causal
    n_tq, n_tk = s.shape[1], s.shape[2]
    one = s.dtype.type(1.0)
    for r in range(s.shape[0]):
        for t in range(n_tq):
            row = s[r, t]
            n = min(q_offset + t + 1, n_tk) if causal else n_tk
            live = row[:n]
            top = k_row_max(live)
            for i in range(n):
                live[i] = kernel_exp(live[i] - top)
            inv = one / k_row_sum(live)
            for i in range(n):
                live[i] *= inv
            for i in range(n, n_tk):
                row[i] = 0


def causal_softmax(scores: np.ndarray, q_offset: int, causal: bool) -> None:
    """Softmax of ``scores [R, Tq, Tk]`` in place over each row's visible keys.

    Query ``t`` sees keys ``0 .. q_offset + t`` when ``causal`` (the rest become 0), else all.
    """
    _causal_softmax_kernel(scores, q_offset, causal)


def _softmax_backward_rows(dp, p, row):
    # dp, p [R, T, Tk]; row [R, T, 1]: dp = (dp - row) * p
    for r in range(dp.shape[0]):
        for t in range(dp.shape[1]):
            d = dp[r, t]
            q = p[r, t]
            c = row[r, t, 0]
            for i in range(d.size):
                d[i] = (d[i] - c) * q[i]


def _decode_attention(q, k, v, n, n_heads, n_kv_heads, scale, out, probs):
    # one sequence: q [Hq*d]; k, v [Tk, Hk*d]; the first n keys are visible; out [Hq*d];
    # probs [Hq, Tk] (0 past the visible keys). Keys outer: K, then V, are read once, front to
    # back, a whole row (every kv head) at a time: one sequential stream the prefetcher follows
    # (a cold cache costs ~30% less than a pass per head).
    d = q.size // n_heads
    groups = n_heads // n_kv_heads
    zero = q.dtype.type(0.0)
    one = q.dtype.type(1.0)
    for t in range(n):
        kr = k[t]
        for h in range(n_heads):
            qv = q[h * d : (h + 1) * d]
            lo = (h // groups) * d
            ks = kr[lo : lo + d]
            acc = zero
            for i in range(d):
                acc += qv[i] * ks[i]
            probs[h, t] = acc * scale
    for h in range(n_heads):
        live = probs[h, :n]
        top = k_row_max(live)
        k_exp_shifted(live, top)
        inv = one / k_row_sum(live)
        for t in range(n):
            live[t] *= inv
        for t in range(n, probs.shape[1]):
            probs[h, t] = zero
    total = np.zeros(q.size, q.dtype)  # a local buffer: its loop vectorizes without alias checks
    for t in range(n):
        vr = v[t]
        for h in range(n_heads):
            w = probs[h, t]
            lo = (h // groups) * d
            vs = vr[lo : lo + d]
            o = total[h * d : (h + 1) * d]
            for i in range(d):
                o[i] += w * vs[i]
    for i in range(q.size):
        out[i] = total[i]


def decode_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    visible: Any,
    n_heads: int,
    n_kv_heads: int,
    scale: float,
    out: np.ndarray,
) -> np.ndarray:
    """Attention of one query per sequence over its first ``visible[b]`` keys.

    Args:
        q: ``[B, 1, Hq*d]``; k, v: ``[B, Tk, Hk*d]`` (cache views: each ``k[b]`` is a dense
            ``[Tk, Hk*d]`` block, which keeps the kernel's inner loops on unit strides).
        visible: ``[B]`` ints, ``1 <= visible[b] <= Tk``.
        out: ``[B, 1, Hq*d]``, written (each ``out[b, 0]`` dense).

    Returns:
        the probabilities ``P [B, Hk, g, 1, Tk]`` (0 for keys a sequence does not see).
    """
    n_b, n_tk = q.shape[0], k.shape[1]
    probs = np.empty((n_b, n_heads, n_tk), dtype=q.dtype)
    scale = q.dtype.type(scale)
    for b in range(n_b):
        _decode_attention_kernel(
            q[b, 0], k[b], v[b], int(visible[b]), n_heads, n_kv_heads, scale, out[b, 0], probs[b]
        )
    return probs.reshape(n_b, n_kv_heads, n_heads // n_kv_heads, 1, n_tk)


if AVAILABLE:
    _causal_softmax_kernel: Any = jit_exp(_causal_softmax_rows)
    softmax_backward_rows: Any = jit_exp(_softmax_backward_rows)
    # reassociation vectorizes the dot products and sums; its exp runs in k_exp_shifted
    _decode_attention_kernel: Any = numba.njit(
        cache=True, fastmath={"reassoc", "contract"}, error_model="numpy"
    )(_decode_attention)
else:
    _causal_softmax_kernel = softmax_backward_rows = _decode_attention_kernel = None
