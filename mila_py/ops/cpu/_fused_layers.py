"""Fused CPU kernels for the row-wise layers (Numba, the ``jit`` extra), one pass each.

The NumPy ops make several passes over their data, one ufunc call each; for the one-row calls of
decode the cost is the calls, not the arithmetic (RMSNorm of one 384-wide row: ~15 us in NumPy).
These kernels do the same math in one pass over the data (two over each row for RMSNorm's
backward):

- :func:`rms_norm_rows`: ``out = x * r * w`` with ``r = 1 / sqrt(mean(x^2) + eps)`` (the sum of
  squares accumulates in float64);
- :func:`rms_norm_backward_rows`: RMSNorm's backward in two passes over each row (``mean(g * n)``
  and the weight gradient accumulate in float64);
- :func:`swiglu_rows`: ``out = g * sigmoid(g) * u``;
- :func:`swiglu_packed_rows`: the same with ``g`` and ``u`` side by side in each row of one
  buffer (a packed SwiGLU's gate/up product, see :class:`mila_py.components.SwiGLU`);
- :func:`swiglu_backward_rows`: SwiGLU's backward in one pass, one ``exp`` per element (the
  vectorizable ``exp`` of :mod:`._fused_math`).

The ops use them when Numba is installed and ``MILA_PY_CPU_BACKEND`` is not ``numpy``
(:func:`enabled`); the NumPy functions stay the readable references the tests compare them with.
The forward kernels take 16-bit storage too: they read and write its ``uint16`` bits, given its
storage marker ``fmt`` (:func:`~._fused_math.storage`; float32 and float64 pass through),
computing in float32. Importing this module never fails: ``AVAILABLE`` says whether
Numba is installed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mila_py.ops.cpu._fused_math import (
    AVAILABLE,
    enabled,
    jit_exp,
    kernel_exp,
    narrow,
    numba,
    widen,
)

__all__ = [
    "AVAILABLE",
    "enabled",
    "rms_norm_backward_rows",
    "rms_norm_rows",
    "swiglu_backward_rows",
    "swiglu_packed_rows",
    "swiglu_rows",
]


def _rms_norm_rows(x, w, eps, out, rstd, fmt):
    # x, out [N, D]; w [D] (stored as the storage marker fmt says); rstd [N], of the compute dtype
    # (float32, or float64 for float64 storage)
    n_rows, dim = x.shape
    eps = np.float64(rstd.dtype.type(eps))  # in the compute dtype, as torch and the CUDA op
    for r in range(n_rows):
        row = x[r]
        acc = 0.0  # float64
        for i in range(dim):
            v = np.float64(widen(row[i], fmt))
            acc += v * v
        inv = 1.0 / math.sqrt(acc / dim + eps)
        rstd[r] = inv
        scale = rstd.dtype.type(inv)
        dst = out[r]
        for i in range(dim):
            dst[i] = narrow(widen(row[i], fmt) * scale * widen(w[i], fmt), fmt)


def _rms_norm_backward_rows(x, w, rstd, dy, dw, dx):
    # x, dy, dx [N, D]; w, dw [D]; rstd [N]. With n = x r and g = dy w:
    # dw += sum_N dy n;  dx = r (g - n mean(g n)). dx may be dy itself (read before written).
    n_rows, dim = x.shape
    acc = np.zeros(dim)  # float64: the weight gradient sums N rows
    for row in range(n_rows):
        xr = x[row]
        dr = dy[row]
        r = rstd[row]
        dot = 0.0  # float64
        for i in range(dim):
            ni = xr[i] * r
            gi = dr[i] * w[i]
            dot += np.float64(gi) * np.float64(ni)
            acc[i] += np.float64(dr[i]) * np.float64(ni)
        c = x.dtype.type(dot / dim)
        dst = dx[row]
        for i in range(dim):
            ni = xr[i] * r
            dst[i] = r * (dr[i] * w[i] - ni * c)
    for i in range(dim):
        dw[i] += acc[i]


def _swiglu_rows(g, u, out, one, fmt):
    # g, u, out [N, H] (stored as the storage marker fmt says); one: 1 in the compute dtype
    for r in range(g.shape[0]):
        gr = g[r]
        ur = u[r]
        dst = out[r]
        for i in range(g.shape[1]):
            a = widen(gr[i], fmt)
            dst[i] = narrow(a / (one + kernel_exp(-a)) * widen(ur[i], fmt), fmt)


def _swiglu_packed_rows(both, out, one, fmt):
    # both [N, 2H]: g then u in each row (the rows are dense, so the loop vectorizes where two
    # strided [N, H] halves would not); out [N, H]; stored and computed as _swiglu_rows
    h = out.shape[1]
    for r in range(both.shape[0]):
        row = both[r]
        dst = out[r]
        for i in range(h):
            a = widen(row[i], fmt)
            dst[i] = narrow(a / (one + kernel_exp(-a)) * widen(row[h + i], fmt), fmt)


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
            e = kernel_exp(-a)
            s = one / (one + e)
            oms = e * s
            if e == np.inf:
                oms = one
            silu = a * s
            d = dr[i]
            dur[i] = d * silu
            dr[i] = d * ur[i] * (s + silu * oms)


if AVAILABLE:
    # reassociation lets the sum of squares vectorize; no "fast" flags: inf and NaN stay exact
    _jit = numba.njit(cache=True, fastmath={"reassoc", "contract"})
    rms_norm_rows: Any = _jit(_rms_norm_rows)
    rms_norm_backward_rows: Any = _jit(_rms_norm_backward_rows)
    swiglu_rows: Any = jit_exp(_swiglu_rows)
    swiglu_packed_rows: Any = jit_exp(_swiglu_packed_rows)
    swiglu_backward_rows: Any = jit_exp(_swiglu_backward_rows)
else:
    rms_norm_rows = rms_norm_backward_rows = swiglu_rows = swiglu_packed_rows = (
        swiglu_backward_rows
    ) = None
