"""Fused single-pass CPU kernels for the row-wise layers (Numba, the ``jit`` extra).

The NumPy ops make several passes over their data, one ufunc call each; for the one-row calls of
decode the cost is the calls, not the arithmetic (RMSNorm of one 384-wide row: ~15 us in NumPy).
These kernels do the same math in one pass:

- :func:`rms_norm_rows`: ``out = x * r * w`` with ``r = 1 / sqrt(mean(x^2) + eps)`` (the sum of
  squares accumulates in float64);
- :func:`swiglu_rows`: ``out = g * sigmoid(g) * u``.

The ops use them when Numba is installed and ``MILA_PY_CPU_BACKEND`` is not ``numpy``; the
NumPy functions stay the readable references the tests compare them with. Importing this
module never fails: ``AVAILABLE`` says whether Numba is installed.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

__all__ = ["AVAILABLE", "enabled", "rms_norm_rows", "swiglu_rows"]

try:
    import numba
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


def _rms_norm_rows(x, w, eps, out, rstd):  # type: ignore[no-untyped-def]
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


def _swiglu_rows(g, u, out):  # type: ignore[no-untyped-def]
    # g, u, out [N, H]
    one = g.dtype.type(1.0)
    for r in range(g.shape[0]):
        gr = g[r]
        ur = u[r]
        dst = out[r]
        for i in range(g.shape[1]):
            a = gr[i]
            dst[i] = a / (one + np.exp(-a)) * ur[i]


if AVAILABLE:
    # reassociation lets the sum of squares vectorize; no "fast" flags: inf and NaN stay exact
    _jit = numba.njit(cache=True, fastmath={"reassoc", "contract"})
    rms_norm_rows: Any = _jit(_rms_norm_rows)
    swiglu_rows: Any = _jit(_swiglu_rows)
else:
    rms_norm_rows = swiglu_rows = None
