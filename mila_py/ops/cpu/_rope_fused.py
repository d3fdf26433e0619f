"""Fused single-pass RoPE kernels for the CPU, compiled by Numba (the ``jit`` extra).

One pass over Q and K together: each token's cos/sin row is read once and reused across all
heads of both tensors. ``parallel`` splits tokens across cores (prefill); ``serial`` avoids the
thread-pool hand-off for decode-sized calls. Arithmetic is float32 on float32 data.

Importing this module never fails: ``AVAILABLE`` says whether Numba is installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["AVAILABLE", "rope_parallel", "rope_serial"]

try:
    import numba
except ImportError:  # the NumPy path serves
    numba = None

AVAILABLE = numba is not None


def _rope_pair(
    x_in, x_out, b, t, cos, sin, p, n_heads, head_dim, n_freq, interleaved, sign, copy_rest
):  # type: ignore[no-untyped-def]
    for h in range(n_heads):
        base = h * head_dim
        if interleaved:
            for i in range(n_freq):
                c = cos[p, i]
                s = sin[p, i] * sign
                x1 = x_in[b, t, base + 2 * i]
                x2 = x_in[b, t, base + 2 * i + 1]
                x_out[b, t, base + 2 * i] = x1 * c - x2 * s
                x_out[b, t, base + 2 * i + 1] = x2 * c + x1 * s
        else:
            for i in range(n_freq):
                c = cos[p, i]
                s = sin[p, i] * sign
                x1 = x_in[b, t, base + i]
                x2 = x_in[b, t, base + n_freq + i]
                x_out[b, t, base + i] = x1 * c - x2 * s
                x_out[b, t, base + n_freq + i] = x2 * c + x1 * s
        if copy_rest:
            for j in range(base + 2 * n_freq, base + head_dim):
                x_out[b, t, j] = x_in[b, t, j]


def _rope_qk(
    q_in,
    k_in,
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
    n_freq,
    interleaved,
    sign,
    copy_rest,
):  # type: ignore[no-untyped-def]
    n_b = q_in.shape[0]
    n_t = q_in.shape[1]
    for r in numba.prange(n_b * n_t):
        b = r // n_t
        t = r - b * n_t
        p = pos[b, t] if use_pos else offset + t
        _pair(
            q_in, q_out, b, t, cos, sin, p, n_heads, head_dim, n_freq, interleaved, sign, copy_rest
        )
        _pair(
            k_in,
            k_out,
            b,
            t,
            cos,
            sin,
            p,
            n_kv_heads,
            head_dim,
            n_freq,
            interleaved,
            sign,
            copy_rest,
        )


if AVAILABLE:
    _pair = numba.njit(inline="always", cache=True)(_rope_pair)
    rope_parallel: Any = numba.njit(parallel=True, cache=True)(_rope_qk)
    rope_serial: Any = numba.njit(parallel=False, cache=True)(_rope_qk)
else:
    rope_parallel = rope_serial = None

NO_POSITIONS = np.zeros((1, 1), dtype=np.int64)
