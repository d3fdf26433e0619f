"""Fused single-pass CPU kernels for the row-wise layers (Numba, the ``jit`` extra).

The NumPy ops make several passes over their data, one ufunc call each; for the one-row calls of
decode the cost is the calls, not the arithmetic (RMSNorm of one 384-wide row: ~15 us in NumPy).
These kernels do the same math in one pass:

- :func:`rms_norm_rows`: ``out = x * r * w`` with ``r = 1 / sqrt(mean(x^2) + eps)`` (the sum of
  squares accumulates in float64);
- :func:`swiglu_rows`: ``out = g * sigmoid(g) * u``;
- :func:`swiglu_backward_rows`: SwiGLU's backward in one pass, one ``exp`` per element;
- :func:`causal_softmax`: attention's softmax over each row's visible keys, in place (the masked
  keys are never exponentiated: they are set to 0);
- :func:`softmax_backward_rows`: ``dp = (dp - row) * p`` in one pass;
- :func:`decode_attention`: attention of one query token per sequence over its cached keys
  (scores, softmax and the weighted sum of values per head, no matmul calls).

``exp`` in float32 is :func:`_exp32`, a polynomial that LLVM vectorizes (Numba's ``np.exp`` is a
scalar libm call per element, 5x slower, and made the sigmoid dominate SwiGLU): Cephes' ``expf``
reduction ``x = n ln2 + r`` with ``|r| <= ln2 / 2`` and a degree-7 polynomial for ``e^r``, then
``2^n`` assembled from exponent bits. Within 1.03 ulp of the exact value over the normal range,
within one unit of the smallest subnormal below it, exact inf / 0 / NaN at the ends. float64 uses
``np.exp``.

The ops use them when Numba is installed and ``MILA_PY_CPU_BACKEND`` is not ``numpy``; the
NumPy functions stay the readable references the tests compare them with. Importing this
module never fails: ``AVAILABLE`` says whether Numba is installed.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

__all__ = [
    "AVAILABLE",
    "causal_softmax",
    "decode_attention",
    "enabled",
    "exp_rows",
    "rms_norm_rows",
    "softmax_backward_rows",
    "swiglu_backward_rows",
    "swiglu_rows",
]

numba: Any
try:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic, overload
except ImportError:  # the NumPy paths serve
    numba = None

AVAILABLE = numba is not None


def enabled(dtype: Any) -> bool:
    """Whether an op should call these kernels for arrays of ``dtype`` (float32/float64 only)."""
    return (
        AVAILABLE
        and os.environ.get("MILA_PY_CPU_BACKEND", "auto").lower() != "numpy"
        and np.dtype(dtype) in (np.float32, np.float64)
    )


def _rms_norm_rows(x, w, eps, out, rstd):
    # x, out [N, D]; w [D]; rstd [N]
    n_rows, dim = x.shape
    for r in range(n_rows):
        row = x[r]
        acc = 0.0  # float64
        for i in range(dim):
            v = np.float64(row[i])
            acc += v * v
        inv = 1.0 / math.sqrt(acc / dim + eps)
        rstd[r] = inv
        scale = row.dtype.type(inv)
        dst = out[r]
        for i in range(dim):
            dst[i] = row[i] * scale * w[i]


def _exp(x):
    """``exp`` inside the kernels: :func:`_exp32` for float32, ``np.exp`` otherwise."""
    return np.exp(x)


def _exp32(x):
    xc = min(max(x, np.float32(-104.0)), np.float32(88.75))
    n = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - n * np.float32(0.693359375)  # ln2 in two parts: n * 0.693359375 is exact
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    ni = np.int32(n)
    n1 = ni >> 1  # 2^n = 2^n1 * 2^n2, both factors normal for n in [-150, 128]
    n2 = ni - n1
    y = p * _f32_from_bits((n1 + 127) << 23) * _f32_from_bits((n2 + 127) << 23)
    if x > np.float32(88.72283):  # above log(FLT_MAX)
        y = np.float32(np.inf)
    if x < np.float32(-104.0):  # below half the smallest subnormal
        y = np.float32(0.0)
    if x != x:
        y = x
    return y


def _exp_rows(x, out):
    # x, out [N, C]; the kernels' exp on its own, for the tests
    for r in range(x.shape[0]):
        xr = x[r]
        dst = out[r]
        for i in range(x.shape[1]):
            dst[i] = _exp(xr[i])


def _swiglu_rows(g, u, out):
    # g, u, out [N, H]
    one = g.dtype.type(1.0)
    for r in range(g.shape[0]):
        gr = g[r]
        ur = u[r]
        dst = out[r]
        for i in range(g.shape[1]):
            a = gr[i]
            dst[i] = a / (one + _exp(-a)) * ur[i]


def _swiglu_backward_rows(g, u, dh, du):
    # g, u [N, H]; dh [N, H] the upstream gradient, overwritten by dgate; du [N, H]
    # s = 1 / (1 + e), e = exp(-g); 1 - s = e s, or 1 where e overflows (s = 0 there)
    one = g.dtype.type(1.0)
    for r in range(g.shape[0]):
        gr = g[r]
        ur = u[r]
        dr = dh[r]
        dur = du[r]
        for i in range(g.shape[1]):
            a = gr[i]
            e = _exp(-a)
            s = one / (one + e)
            oms = e * s
            if e == np.inf:
                oms = one
            silu = a * s
            d = dr[i]
            dur[i] = d * silu
            dr[i] = d * ur[i] * (s + silu * oms)


def _row_max(x):
    m = x[0]
    for i in range(1, x.size):
        m = max(m, x[i])
    return m


def _row_sum(x):
    total = x.dtype.type(0.0)
    for i in range(x.size):
        total += x[i]
    return total


def _causal_softmax_rows(s, q_offset, causal):
    # s [R, Tq, Tk] scores -> probabilities; query t sees keys 0 .. q_offset + t if causal
    n_tq, n_tk = s.shape[1], s.shape[2]
    one = s.dtype.type(1.0)
    for r in range(s.shape[0]):
        for t in range(n_tq):
            row = s[r, t]
            n = min(q_offset + t + 1, n_tk) if causal else n_tk
            live = row[:n]
            top = _k_row_max(live)
            for i in range(n):
                live[i] = _exp(live[i] - top)
            inv = one / _k_row_sum(live)
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


def _exp_shifted(x, shift):
    # x = exp(x - shift), in place; a function of its own so that its caller may reassociate
    for i in range(x.size):
        x[i] = _exp(x[i] - shift)


def _decode_attention(q, k, v, n, n_heads, n_kv_heads, scale, out, probs):
    # one sequence: q [Hq*d]; k, v [Tk, Hk*d]; the first n keys are visible; out [Hq*d];
    # probs [Hq, Tk] (0 past the visible keys)
    d = q.size // n_heads
    groups = n_heads // n_kv_heads
    zero = q.dtype.type(0.0)
    one = q.dtype.type(1.0)
    for h in range(n_heads):
        lo = (h // groups) * d
        qv = q[h * d : (h + 1) * d]
        p = probs[h]
        for t in range(n):
            kr = k[t, lo : lo + d]
            acc = zero
            for i in range(d):
                acc += qv[i] * kr[i]
            p[t] = acc * scale
        live = p[:n]
        top = live[0]
        for t in range(1, n):
            if live[t] > top:
                top = live[t]
        _k_exp_shifted(live, top)
        total = zero
        for t in range(n):
            total += live[t]
        inv = one / total
        o = out[h * d : (h + 1) * d]
        for i in range(d):
            o[i] = zero
        for t in range(n):
            w = live[t] * inv
            live[t] = w
            vr = v[t, lo : lo + d]
            for i in range(d):
                o[i] += w * vr[i]
        for t in range(n, p.size):
            p[t] = zero


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

    @intrinsic
    def _f32_from_bits(typingctx, bits):
        """The float32 whose bit pattern is the low 32 bits of the integer ``bits``."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            value = args[0]
            if bits.bitwidth > 32:
                value = builder.trunc(value, ir.IntType(32))
            elif bits.bitwidth < 32:
                value = builder.sext(value, ir.IntType(32))
            return builder.bitcast(value, ir.FloatType())

        return types.float32(bits), codegen

    _k_exp32 = numba.njit(inline="always", cache=True)(_exp32)

    @overload(_exp, inline="always")
    def _exp_overload(x):
        if x == types.float32:
            return lambda x: _k_exp32(x)
        return lambda x: np.exp(x)

    # reassociation lets the sum of squares vectorize; no "fast" flags: inf and NaN stay exact
    _jit = numba.njit(cache=True, fastmath={"reassoc", "contract"})
    rms_norm_rows: Any = _jit(_rms_norm_rows)
    # no reassociation where exp is inlined: it would fold the two-part ln2 reduction; NumPy
    # error model: x / 0 is inf, not a raised ZeroDivisionError (which stops vectorization)
    _jit_exp = numba.njit(cache=True, fastmath={"contract"}, error_model="numpy")
    exp_rows: Any = _jit_exp(_exp_rows)
    swiglu_rows: Any = _jit_exp(_swiglu_rows)
    swiglu_backward_rows: Any = _jit_exp(_swiglu_backward_rows)
    # row reductions: reassociation (and no NaN ordering) lets them vectorize; called, not
    # inlined, so the flags stay off the exp of their caller
    _jit_reduce = numba.njit(cache=True, fastmath={"reassoc", "nnan"})
    _k_row_max = _jit_reduce(_row_max)
    _k_row_sum = _jit_reduce(_row_sum)
    _causal_softmax_kernel: Any = _jit_exp(_causal_softmax_rows)
    softmax_backward_rows: Any = _jit_exp(_softmax_backward_rows)
    _k_exp_shifted = _jit_exp(_exp_shifted)
    # reassociation vectorizes its dot products and sums; its exp runs in _exp_shifted
    _decode_attention_kernel: Any = numba.njit(
        cache=True, fastmath={"reassoc", "contract"}, error_model="numpy"
    )(_decode_attention)
else:
    rms_norm_rows = exp_rows = swiglu_rows = swiglu_backward_rows = None
    _causal_softmax_kernel = softmax_backward_rows = _decode_attention_kernel = None
