"""Fused single-pass RoPE kernels for the CPU, compiled by Numba (the ``jit`` extra).

One pass over Q and K together: each token's cos/sin row is read once and reused across all
heads of both tensors. ``*_parallel`` splits tokens across cores (prefill); ``*_serial`` avoids
the thread-pool hand-off for decode-sized calls. Arithmetic is float32 on float32 data.

Two details keep the inner loop a straight vectorized body: the pair halves are passed as 1-D
views indexed by ``range`` variables (known non-negative, so Numba emits no wraparound checks),
and in place one view per half is both read and written, so the vectorizer's runtime overlap
checks pass (an aliased input/output pair would send it to the scalar fallback).

Importing this module never fails: ``AVAILABLE`` says whether Numba is installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "AVAILABLE",
    "NO_POSITIONS",
    "rope_inplace_parallel",
    "rope_inplace_serial",
    "rope_out_parallel",
    "rope_out_serial",
]

try:
    import numba
except ImportError:  # the NumPy path serves
    numba = None

AVAILABLE = numba is not None
NO_POSITIONS = np.zeros((1, 1), dtype=np.int64)


def _rotate_inplace(x1, x2, c, s, n, sign):  # type: ignore[no-untyped-def]
    for i in range(n):
        a = x1[i]
        b = x2[i]
        si = s[i] * sign
        x1[i] = a * c[i] - b * si
        x2[i] = b * c[i] + a * si


def _rotate_out(x1, x2, y1, y2, c, s, n, sign):  # type: ignore[no-untyped-def]
    for i in range(n):
        a = x1[i]
        b = x2[i]
        si = s[i] * sign
        y1[i] = a * c[i] - b * si
        y2[i] = b * c[i] + a * si


def _rotate_pairs_inplace(x, c, s, n, sign):  # type: ignore[no-untyped-def]
    # Interleaved pairs (2i, 2i + 1) of one contiguous head; unsigned indices skip wraparound.
    for i in range(n):
        j = np.uint64(2 * i)
        a = x[j]
        b = x[j + np.uint64(1)]
        si = s[i] * sign
        x[j] = a * c[i] - b * si
        x[j + np.uint64(1)] = b * c[i] + a * si


def _rotate_pairs_out(x, y, c, s, n, sign):  # type: ignore[no-untyped-def]
    for i in range(n):
        j = np.uint64(2 * i)
        a = x[j]
        b = x[j + np.uint64(1)]
        si = s[i] * sign
        y[j] = a * c[i] - b * si
        y[j + np.uint64(1)] = b * c[i] + a * si


def _row_inplace(x, c, s, n_heads, head_dim, n, interleaved, sign):  # type: ignore[no-untyped-def]
    for h in range(n_heads):
        lo = h * head_dim
        hi = lo + 2 * n
        if interleaved:
            _k_pairs_inplace(x[lo:hi], c, s, n, sign)
        else:
            _k_rotate_inplace(x[lo : lo + n], x[lo + n : hi], c, s, n, sign)


def _row_out(x, y, c, s, n_heads, head_dim, n, interleaved, sign):  # type: ignore[no-untyped-def]
    for h in range(n_heads):
        lo = h * head_dim
        hi = lo + 2 * n
        if interleaved:
            _k_pairs_out(x[lo:hi], y[lo:hi], c, s, n, sign)
        else:
            _k_rotate_out(
                x[lo : lo + n], x[lo + n : hi], y[lo : lo + n], y[lo + n : hi], c, s, n, sign
            )
        for j in range(hi, lo + head_dim):  # channels past the rotated part pass through
            y[j] = x[j]


def _qk_inplace(
    q, k, cos, sin, offset, pos, use_pos, n_heads, n_kv_heads, head_dim, n, interleaved, inverse
):  # type: ignore[no-untyped-def]
    n_t = q.shape[1]
    sign = np.float32(-1.0) if inverse else np.float32(1.0)
    for r in numba.prange(q.shape[0] * n_t):
        b = r // n_t
        t = r - b * n_t
        p = pos[b, t] if use_pos else offset + t
        _k_row_inplace(q[b, t], cos[p], sin[p], n_heads, head_dim, n, interleaved, sign)
        _k_row_inplace(k[b, t], cos[p], sin[p], n_kv_heads, head_dim, n, interleaved, sign)


def _qk_out(
    q,
    k,
    q_out,
    k_out,
    cos,
    sin,
    offset,
    pos,
    use_pos,
    n_heads,
    n_kv_heads,
    head_dim,
    n,
    interleaved,
    inverse,
):  # type: ignore[no-untyped-def]
    n_t = q.shape[1]
    sign = np.float32(-1.0) if inverse else np.float32(1.0)
    for r in numba.prange(q.shape[0] * n_t):
        b = r // n_t
        t = r - b * n_t
        p = pos[b, t] if use_pos else offset + t
        _k_row_out(q[b, t], q_out[b, t], cos[p], sin[p], n_heads, head_dim, n, interleaved, sign)
        _k_row_out(k[b, t], k_out[b, t], cos[p], sin[p], n_kv_heads, head_dim, n, interleaved, sign)


if AVAILABLE:
    _inline = numba.njit(inline="always", cache=True)
    _k_rotate_inplace = _inline(_rotate_inplace)
    _k_rotate_out = _inline(_rotate_out)
    _k_pairs_inplace = _inline(_rotate_pairs_inplace)
    _k_pairs_out = _inline(_rotate_pairs_out)
    _k_row_inplace = _inline(_row_inplace)
    _k_row_out = _inline(_row_out)
    rope_inplace_parallel: Any = numba.njit(parallel=True, cache=True)(_qk_inplace)
    rope_inplace_serial: Any = numba.njit(cache=True)(_qk_inplace)
    rope_out_parallel: Any = numba.njit(parallel=True, cache=True)(_qk_out)
    rope_out_serial: Any = numba.njit(cache=True)(_qk_out)
else:
    rope_inplace_parallel = rope_inplace_serial = rope_out_parallel = rope_out_serial = None
