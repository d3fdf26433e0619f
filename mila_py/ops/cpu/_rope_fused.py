"""Fused single-pass RoPE kernels for the CPU, compiled by Numba (the ``jit`` extra).

One pass over Q and K together: each token's cos/sin row is read once and reused across all
heads of both tensors. Arithmetic is float32 on float32 data (float64 on float64). FP16 and BF16
data are rotated as their ``uint16`` bits, given the storage marker ``fmt`` (see
:func:`~._fused_math.storage`): each element widened to float32 in registers and
rounded once on store.

``rope_rows_mrope_inplace`` is the same for M-RoPE positions ``[3, B, T]``: it gathers each
token's row from the table column by column (frequency ``i`` at its axis' position) into a
small buffer, then rotates as above.

``rope_rows_inplace`` rotates a range of tokens and releases the GIL, so the op splits large
calls into ranges over its own thread pool and runs decode-sized calls inline. Not Numba's
``parallel=True``: its default OpenMP layer leaves its threads spinning after each call, and the
NumPy or BLAS work that follows (attention's matmuls) then ran up to 1.6x slower on 2 cores;
pool threads wait on a lock instead.

Two details keep the inner loop a straight vectorized body: the pair halves are passed as 1-D
views indexed by ``range`` variables (known non-negative, so Numba emits no wraparound checks),
and in place one view per half is both read and written, so the vectorizer's runtime overlap
checks pass (an aliased input/output pair would send it to the scalar fallback).

Out-of-place calls (backward into gradient buffers) copy first and rotate the copy in place:
a kernel that reads one array and writes another was measured up to 25x slower for some
relative placements of the two buffers, while copy + in-place costs one extra streaming pass.

Importing this module never fails: ``AVAILABLE`` says whether Numba is installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "AVAILABLE",
    "NO_POSITIONS",
    "rope_rows_inplace",
    "rope_rows_mrope_inplace",
]

from mila_py.ops.cpu._fused_math import narrow, widen

numba: Any
try:
    import numba
except ImportError:  # the NumPy path serves
    numba = None

AVAILABLE = numba is not None
NO_POSITIONS = np.zeros((1, 1), dtype=np.int64)


def _rotate_inplace(x1, x2, c, s, n, sign, fmt):
    for i in range(n):
        a = widen(x1[i], fmt)
        b = widen(x2[i], fmt)
        si = s[i] * sign
        x1[i] = narrow(a * c[i] - b * si, fmt)
        x2[i] = narrow(b * c[i] + a * si, fmt)


def _rotate_pairs_inplace(x, c, s, n, sign, fmt):
    # Interleaved pairs (2i, 2i + 1) of one contiguous head; unsigned indices skip wraparound.
    for i in range(n):
        j = np.uint64(2 * i)
        a = widen(x[j], fmt)
        b = widen(x[j + np.uint64(1)], fmt)
        si = s[i] * sign
        x[j] = narrow(a * c[i] - b * si, fmt)
        x[j + np.uint64(1)] = narrow(b * c[i] + a * si, fmt)


def _row_inplace(x, c, s, n_heads, head_dim, n, interleaved, sign, fmt):
    for h in range(n_heads):
        lo = h * head_dim
        hi = lo + 2 * n
        if interleaved:
            _k_pairs_inplace(x[lo:hi], c, s, n, sign, fmt)
        else:
            _k_rotate_inplace(x[lo : lo + n], x[lo + n : hi], c, s, n, sign, fmt)


def _qk_rows_inplace(
    q,
    k,
    cos,
    sin,
    offset,
    pos,
    use_pos,
    r0,
    r1,
    n_heads,
    n_kv_heads,
    head_dim,
    n,
    interleaved,
    inverse,
    fmt,
):
    # rows r0 .. r1 - 1 of the flattened [B * T] token axis
    n_t = q.shape[1]
    sign = np.float32(-1.0) if inverse else np.float32(1.0)
    for r in range(r0, r1):
        b = r // n_t
        t = r - b * n_t
        p = pos[b, t] if use_pos else offset + t
        _k_row_inplace(q[b, t], cos[p], sin[p], n_heads, head_dim, n, interleaved, sign, fmt)
        _k_row_inplace(k[b, t], cos[p], sin[p], n_kv_heads, head_dim, n, interleaved, sign, fmt)


def _qk_rows_mrope_inplace(
    q,
    k,
    cos,
    sin,
    pos,
    axes,
    r0,
    r1,
    n_heads,
    n_kv_heads,
    head_dim,
    n,
    interleaved,
    inverse,
    fmt,
):
    # M-RoPE: pos [3, B, T]; frequency i of token (b, t) at row pos[axes[i], b, t] of its column
    n_t = q.shape[1]
    sign = np.float32(-1.0) if inverse else np.float32(1.0)
    c = np.empty(n, dtype=cos.dtype)
    s = np.empty(n, dtype=sin.dtype)
    for r in range(r0, r1):
        b = r // n_t
        t = r - b * n_t
        for i in range(n):
            p = pos[axes[i], b, t]
            c[i] = cos[p, i]
            s[i] = sin[p, i]
        _k_row_inplace(q[b, t], c, s, n_heads, head_dim, n, interleaved, sign, fmt)
        _k_row_inplace(k[b, t], c, s, n_kv_heads, head_dim, n, interleaved, sign, fmt)


if AVAILABLE:
    _inline = numba.njit(inline="always", cache=True)
    _k_rotate_inplace = _inline(_rotate_inplace)
    _k_pairs_inplace = _inline(_rotate_pairs_inplace)
    _k_row_inplace = _inline(_row_inplace)
    rope_rows_inplace: Any = numba.njit(nogil=True, cache=True)(_qk_rows_inplace)
    rope_rows_mrope_inplace: Any = numba.njit(nogil=True, cache=True)(_qk_rows_mrope_inplace)
else:
    rope_rows_inplace = rope_rows_mrope_inplace = None
