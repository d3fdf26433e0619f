"""The decode step's matrix products on 16-bit weights (Numba, the ``jit`` extra).

``y [N, out] = x [N, in] W^T + b`` for a few rows ``N`` (one per sequence of a decode step) with
``x``, ``W``, ``b`` and ``y`` in FP16 or BF16: a CPU decode step reads every weight once per
token, so its time is the weights' bytes, and 16-bit weights read as they are halve it. The
kernels read the weight's bits (``uint16``), widen each element in registers (see
:func:`~._fused_math.widen`), accumulate in float32 and round each output once. Two
layouts, as :class:`~mila_py.components.Linear` stores its weight:

- :func:`_rows_product`: ``W [out, in]`` C-contiguous: one dot product per output, along a
  weight row (a sequential stream per block of rows);
- :func:`_columns_product`: ``W^T [in, out]`` C-contiguous (``W`` a transposed view): each
  input element scales a weight row into a block of float32 sums, four rows at a time.

Both split the outputs into blocks over Numba's threads (``prange``, ``NUMBA_NUM_THREADS``):
one thread streams a row block at ~half the bandwidth two do, which would leave a 16-bit decode
no faster than float32's two-thread BLAS. (RoPE's kernels avoid ``parallel=True`` because its
OpenMP threads keep spinning into the BLAS work that follows them; a 16-bit decode step has no
BLAS work, and prefill does not use these kernels; BLAS's own threads, though, spin for ~0.1 s
after a prefill's products, and the first decode steps after it share the cores with them.)
The ops bind them to a decode plan's
buffers once (:func:`bind`: the compiled function, without Numba's per-call dispatch); wider
calls (prefill, training) use the float32 BLAS path of :mod:`.linear`. Of the two layouts,
rows stream faster (~25-28 GB/s against ~20 on 2 EPYC cores), so 16-bit CPU builds store every
weight ``[out, in]`` (:class:`~mila_py.components.Linear`). Importing this module never fails.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.ops.cpu._fused_math import (
    AVAILABLE,
    REDUCED_DTYPES,
    bits,
    compiled,
    narrow,
    numba,
    storage,
    widen,
)

__all__ = ["MAX_ROWS", "applies", "bind"]

#: rows of ``x`` (sequences of a decode step) up to which a bound product runs the kernels
MAX_ROWS = 8
#: weight rows per block of :func:`_rows_product`
_ROW_BLOCK = 16
#: output columns per block of :func:`_columns_product`, at most (fewer for narrow products,
#: so that every thread gets several blocks)
_COLUMN_BLOCK = 512

prange = numba.prange if AVAILABLE else range


def _rows_product(x, w, bias, out, fmt, block):
    # x [N, K], w [M, K] C-contiguous, bias [M] or None, out [N, M]: 16-bit bits of storage fmt
    n_rows, k = x.shape
    xs = np.empty((n_rows, k), np.float32)
    for r in range(n_rows):
        for i in range(k):
            xs[r, i] = widen(x[r, i], fmt)
    m = w.shape[0]
    n_blocks = (m + block - 1) // block
    for blk in prange(n_blocks):
        for o in range(blk * block, min(m, blk * block + block)):
            row = w[o]
            for r in range(n_rows):
                xr = xs[r]
                acc = np.float32(0.0)
                for i in range(k):
                    acc += xr[i] * widen(row[i], fmt)
                if bias is not None:
                    acc += widen(bias[o], fmt)
                out[r, o] = narrow(acc, fmt)


def _columns_product(x, wt, bias, out, fmt, block):
    # x [N, K], wt [K, M] C-contiguous (W^T), bias [M] or None, out [N, M]: as _rows_product
    n_rows, k = x.shape
    xs = np.empty((n_rows, k), np.float32)
    for r in range(n_rows):
        for i in range(k):
            xs[r, i] = widen(x[r, i], fmt)
    m = wt.shape[1]
    n_blocks = (m + block - 1) // block
    for blk in prange(n_blocks):
        c0 = blk * block
        width = min(m, c0 + block) - c0
        acc = np.zeros((n_rows, width), np.float32)
        i = 0
        while i + 4 <= k:  # four weight rows per pass over the sums
            w0 = wt[i, c0 : c0 + width]
            w1 = wt[i + 1, c0 : c0 + width]
            w2 = wt[i + 2, c0 : c0 + width]
            w3 = wt[i + 3, c0 : c0 + width]
            for r in range(n_rows):
                a0, a1, a2, a3 = xs[r, i], xs[r, i + 1], xs[r, i + 2], xs[r, i + 3]
                ar = acc[r]
                for j in range(width):
                    ar[j] += (
                        a0 * widen(w0[j], fmt) + a1 * widen(w1[j], fmt)
                        + a2 * widen(w2[j], fmt) + a3 * widen(w3[j], fmt)
                    )  # fmt: skip
            i += 4
        for ii in range(i, k):
            wi = wt[ii, c0 : c0 + width]
            for r in range(n_rows):
                a = xs[r, ii]
                ar = acc[r]
                for j in range(width):
                    ar[j] += a * widen(wi[j], fmt)
        for r in range(n_rows):
            ar = acc[r]
            for j in range(width):
                v = ar[j]
                if bias is not None:
                    v += widen(bias[c0 + j], fmt)
                out[r, c0 + j] = narrow(v, fmt)


def applies(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> bool:
    """Whether :func:`bind` takes these arrays: Numba installed, one 16-bit dtype, C-contiguous
    ``x`` and ``out`` of at most :data:`MAX_ROWS` rows, a weight with C-contiguous rows
    (``[out, in]``) or columns (``[in, out]`` storage), a dense bias."""
    if not AVAILABLE or x.dtype not in REDUCED_DTYPES:
        return False
    if any(a.dtype != x.dtype for a in (weight, out)) or (
        bias is not None and (bias.dtype != x.dtype or not bias.flags.c_contiguous)
    ):
        return False
    if not (x.flags.c_contiguous and out.flags.c_contiguous) or x.ndim < 1:
        return False
    rows = x.size // max(1, x.shape[-1])
    return 0 < rows <= MAX_ROWS and (weight.flags.c_contiguous or weight.T.flags.c_contiguous)


def bind(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out: np.ndarray
) -> Callable[[], None]:
    """``out = x W^T + b`` of these arrays (their values at each call) as a callable of no
    arguments; :func:`applies` must hold.

    Args:
        x: ``[..., in]``; weight: ``[out, in]`` (C- or F-contiguous); bias: ``[out]`` or None;
        out: ``[..., out]``, written.
    """
    x2 = bits(x.reshape(-1, x.shape[-1]))
    y2 = bits(out.reshape(-1, out.shape[-1]))
    b = None if bias is None else bits(bias)
    n_threads = numba.get_num_threads()
    if weight.flags.c_contiguous:
        kernel, w, block = _rows_kernel, bits(weight), _ROW_BLOCK
    else:
        kernel, w = _columns_kernel, bits(weight.T)
        per_thread = -(-weight.shape[0] // (4 * n_threads))  # ~4 blocks a thread
        block = min(_COLUMN_BLOCK, max(16, -(-per_thread // 16) * 16))
    args = (x2, w, b, y2, storage(x.dtype), block)
    return functools.partial(compiled(kernel, args), *args)


if AVAILABLE:
    # reassociation vectorizes the dot products; no other fast-math flag: inf and NaN stay
    _jit = numba.njit(
        cache=True, parallel=True, fastmath={"reassoc", "contract"}, error_model="numpy"
    )
    _rows_kernel: Any = _jit(_rows_product)
    _columns_kernel: Any = _jit(_columns_product)
else:
    _rows_kernel = _columns_kernel = None
