"""Fused CPU kernels of attention (Numba, the ``jit`` extra).

- :func:`causal_softmax`: the softmax over each row's visible keys, in place (the masked keys are
  never exponentiated: they are set to 0);
- :func:`softmax_backward_rows`: ``dp = (dp - row) * p`` in one pass;
- :func:`decode_attention`: attention of one query token per sequence over its cached keys
  (scores, softmax and the weighted sum of values per head, no matmul calls). FP16 and BF16
  queries, caches and outputs are read as their bits and widened in registers (the scores,
  softmax and sums in float32), so a 16-bit KV cache is streamed as it is.

:class:`mila_py.ops.cpu.attention.CpuAttentionOp` uses them when Numba is installed and
``MILA_PY_CPU_BACKEND`` is not ``numpy``; the NumPy passes of ``attention.py`` are the
references. Importing this module never fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.ops.cpu._fused_math import (
    AVAILABLE,
    bits,
    jit_exp,
    k_exp_shifted,
    k_row_max,
    k_row_sum,
    kernel_exp,
    literally,
    narrow,
    numba,
    storage,
    types,
    widen,
)

__all__ = [
    "causal_softmax",
    "compute_dtype",
    "decode_attention",
    "decode_kernel",
    "softmax_backward_rows",
]


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


def _decode_attention(q, k, v, n, n_heads, n_kv_heads, scale, out, probs, d, g, fmt):
    # one sequence: q [Hq*d]; k, v [Tk, Hk*d]; the first n keys are visible; out [Hq*d];
    # probs [Hq, Tk] (0 past the visible keys) in the compute dtype; q, k, v and out stored as
    # the storage marker fmt says (16-bit bits, or floats of probs' dtype); d the head size and
    # g = Hq / Hk are compile-time
    # constants (literal types: one compilation per pair), so the inner loops unroll into
    # registers (1.6x over runtime sizes at d = 64). Keys outer: K, then V, are read once, front
    # to back, four whole rows (every kv head) at a time: one sequential stream the CPU's prefetcher
    # follows (a cold cache costs ~30% less than a pass per head), four independent sums per
    # query element.
    literally(d)
    literally(g)
    zero = probs.dtype.type(0.0)
    one = probs.dtype.type(1.0)
    qs = np.empty(n_heads * d, probs.dtype)
    for i in range(n_heads * d):
        qs[i] = widen(q[i], fmt) * scale
    t = 0
    while t + 4 <= n:
        k0, k1, k2, k3 = k[t], k[t + 1], k[t + 2], k[t + 3]
        for j in range(n_kv_heads):
            lo = j * d
            for gg in range(g):
                h = j * g + gg
                qh = h * d
                a0 = a1 = a2 = a3 = zero
                for i in range(d):
                    x = qs[qh + i]
                    a0 += x * widen(k0[lo + i], fmt)
                    a1 += x * widen(k1[lo + i], fmt)
                    a2 += x * widen(k2[lo + i], fmt)
                    a3 += x * widen(k3[lo + i], fmt)
                probs[h, t] = a0
                probs[h, t + 1] = a1
                probs[h, t + 2] = a2
                probs[h, t + 3] = a3
        t += 4
    for r in range(t, n):
        kr = k[r]
        for j in range(n_kv_heads):
            lo = j * d
            for gg in range(g):
                h = j * g + gg
                qh = h * d
                acc = zero
                for i in range(d):
                    acc += qs[qh + i] * widen(kr[lo + i], fmt)
                probs[h, r] = acc
    for h in range(n_heads):
        live = probs[h, :n]
        top = k_row_max(live)
        k_exp_shifted(live, top)
        inv = one / k_row_sum(live)
        for t in range(n):
            live[t] *= inv
        for t in range(n, probs.shape[1]):
            probs[h, t] = zero
    total = np.zeros(n_heads * d, probs.dtype)  # local: vectorizes without alias checks
    t = 0
    while t + 4 <= n:
        v0, v1, v2, v3 = v[t], v[t + 1], v[t + 2], v[t + 3]
        for j in range(n_kv_heads):
            lo = j * d
            for gg in range(g):
                h = j * g + gg
                w0, w1, w2, w3 = probs[h, t], probs[h, t + 1], probs[h, t + 2], probs[h, t + 3]
                oh = h * d
                for i in range(d):
                    total[oh + i] += (
                        w0 * widen(v0[lo + i], fmt) + w1 * widen(v1[lo + i], fmt)
                        + w2 * widen(v2[lo + i], fmt) + w3 * widen(v3[lo + i], fmt)
                    )  # fmt: skip
        t += 4
    for r in range(t, n):
        vr = v[r]
        for j in range(n_kv_heads):
            lo = j * d
            for gg in range(g):
                h = j * g + gg
                w = probs[h, r]
                oh = h * d
                for i in range(d):
                    total[oh + i] += w * widen(vr[lo + i], fmt)
    for i in range(n_heads * d):
        out[i] = narrow(total[i], fmt)


#: the decode kernel compiled per argument types and (head size, group), see :func:`decode_kernel`
_DECODE_KERNELS: dict[tuple[Any, ...], Any] = {}


def _array_key(a: np.ndarray) -> tuple[Any, ...]:
    """The properties of ``a`` its Numba type is made of (dtype, dimensions, layout, flags)."""
    flags = a.flags
    return (a.dtype, a.ndim, flags.c_contiguous, flags.f_contiguous, flags.writeable, flags.aligned)


def decode_kernel(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int, n_kv_heads: int, out: np.ndarray,
    probs: np.ndarray, dtype: Any = None,
) -> Any:  # fmt: skip
    """The decode kernel compiled for one sequence's arrays of these types (``q [Hq*d]``,
    ``k``, ``v [Tk, Hk*d]``, ``out [Hq*d]``, as the kernel takes them: 16-bit storage as its
    bits, see :func:`~._fused_math.bits`; ``probs [Hq, Tk]`` in the compute dtype) and this head
    geometry, as a plain function ``f(q, k, v, n, n_heads, n_kv_heads, scale, out, probs, d, g,
    fmt)`` (``fmt``: :func:`~._fused_math.storage` of the storage ``dtype``, ``q``'s own when
    None, which the caller passes).

    Kept per types and geometry; calling the returned function skips Numba's dispatch, which
    for the literal head size costs ~60-90 ms a call. Its arguments must have exactly the types
    given here (a decode plan binds the same arrays every step; :func:`decode_attention` asks
    for each call's arrays), ``scale`` a scalar of ``probs``' dtype: the compiled function checks
    little more than the arrays' item size, so an array of another dtype, dimension count or
    layout is read wrongly or crashes the process.

    Head counts may be NumPy integers; ``d`` and ``g`` are Python ints (literal types)."""
    n_heads, n_kv_heads = int(n_heads), int(n_kv_heads)
    d, g = q.size // n_heads, n_heads // n_kv_heads
    dtype = q.dtype if dtype is None else dtype
    # what Numba's array type depends on, read without numba.typeof (~7 us an array)
    key = (tuple(_array_key(a) for a in (q, k, v, out, probs)), d, g, np.dtype(dtype))
    kernel = _DECODE_KERNELS.get(key)
    if kernel is None:
        arrays = tuple(numba.typeof(a) for a in (q, k, v, out, probs))
        item = numba.from_dtype(probs.dtype)
        sig = (*arrays[:3], types.intp, types.intp, types.intp, item, *arrays[3:])
        sig = (*sig, types.literal(d), types.literal(g), numba.typeof(storage(dtype)))
        _decode_attention_kernel.compile(sig)
        kernel = _DECODE_KERNELS[key] = _decode_attention_kernel.get_overload(sig)
    return kernel


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
    n_heads, n_kv_heads = int(n_heads), int(n_kv_heads)
    dtype = q.dtype
    probs = np.empty((n_b, n_heads, n_tk), dtype=compute_dtype(dtype))
    scale = probs.dtype.type(scale)
    d, g = q.shape[2] // n_heads, n_heads // n_kv_heads
    q, k, v, out = bits(q), bits(k), bits(v), bits(out)
    fmt = storage(dtype)
    if n_b:  # every sequence's rows have the first one's types: one lookup
        kernel = decode_kernel(q[0, 0], k[0], v[0], n_heads, n_kv_heads, out[0, 0], probs[0], dtype)
    for b in range(n_b):
        kernel(q[b, 0], k[b], v[b], int(visible[b]), n_heads, n_kv_heads, scale, out[b, 0],
               probs[b], d, g, fmt)  # fmt: skip
    return probs.reshape(n_b, n_kv_heads, n_heads // n_kv_heads, 1, n_tk)


def compute_dtype(dtype: Any) -> np.dtype:
    """The dtype the decode kernel computes in for storage ``dtype``: float64 for float64,
    else float32 (the probabilities and a decode plan's scratch have it)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


if AVAILABLE:
    _causal_softmax_kernel: Any = jit_exp(_causal_softmax_rows)
    softmax_backward_rows: Any = jit_exp(_softmax_backward_rows)
    # reassociation vectorizes the dot products and sums; its exp runs in k_exp_shifted
    _decode_attention_kernel: Any = numba.njit(
        cache=True, fastmath={"reassoc", "contract"}, error_model="numpy"
    )(_decode_attention)
else:
    _causal_softmax_kernel = softmax_backward_rows = _decode_attention_kernel = None
