"""The decode step's matrix products on 16-bit weights (Numba, the ``jit`` extra).

``y [N, out] = x [N, in] W^T + b`` for a few rows ``N`` (one per sequence of a decode step) with
``x``, ``W [out, in]`` (C-contiguous), ``b`` and ``y`` in FP16 or BF16: a CPU decode step reads
every weight once per token, so its time is the weights' bytes, and 16-bit weights read as they
are halve it. :func:`_rows_product` reads the weight's bits (``uint16``), widens each element in
registers (see :func:`~._fused_math.widen`), accumulates one dot product per output along its
weight row in float32 and rounds each output once. 16-bit CPU builds store every weight
``[out, in]`` for it (:class:`~mila_py.components.Linear`): rows streamed ~25-28 GB/s on 2 EPYC
cores where a kernel over ``[in, out]`` storage (each input element scaling a weight row into a
block of sums) reached ~20.

The outputs are split into blocks over Numba's threads (``prange``, ``NUMBA_NUM_THREADS``): one
thread streams at ~half the bandwidth two do, which would leave a 16-bit decode no faster than
float32's two-thread BLAS. (RoPE's kernels avoid ``parallel=True`` because its OpenMP threads
keep spinning into the BLAS work that follows them; a 16-bit decode step has no BLAS work, and
prefill does not use this kernel. BLAS's own threads, though, spin for ~0.1 s after a prefill's
products, and the first decode steps after it share the cores with them.) The op binds the
kernel to a decode plan's buffers once (:func:`bind`: the compiled function, without Numba's
per-call dispatch); wider calls (prefill, training) use the float32 BLAS path of
:mod:`.linear`. Importing this module never fails.
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


def applies(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> bool:
    """Whether :func:`bind` takes these arrays: Numba installed, one 16-bit dtype, C-contiguous
    ``x``, ``out`` (at most :data:`MAX_ROWS` rows) and weight ``[out, in]``, a dense bias."""
    if not AVAILABLE or x.dtype not in REDUCED_DTYPES:
        return False
    if any(a.dtype != x.dtype for a in (weight, out)) or (
        bias is not None and (bias.dtype != x.dtype or not bias.flags.c_contiguous)
    ):
        return False
    if not (x.flags.c_contiguous and out.flags.c_contiguous) or x.ndim < 1:
        return False
    rows = x.size // max(1, x.shape[-1])
    return 0 < rows <= MAX_ROWS and weight.flags.c_contiguous


def bind(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out: np.ndarray
) -> Callable[[], None]:
    """``out = x W^T + b`` of these arrays (their values at each call) as a callable of no
    arguments; :func:`applies` must hold.

    Args:
        x: ``[..., in]``; weight: ``[out, in]``; bias: ``[out]`` or None;
        out: ``[..., out]``, written.
    """
    x2 = bits(x.reshape(-1, x.shape[-1]))
    y2 = bits(out.reshape(-1, out.shape[-1]))
    b = None if bias is None else bits(bias)
    args = (x2, bits(weight), b, y2, storage(x.dtype), _ROW_BLOCK)
    return functools.partial(compiled(_rows_kernel, args), *args)


if AVAILABLE:
    # reassociation vectorizes the dot products; no other fast-math flag: inf and NaN stay
    _jit = numba.njit(
        cache=True, parallel=True, fastmath={"reassoc", "contract"}, error_model="numpy"
    )
    _rows_kernel: Any = _jit(_rows_product)
else:
    _rows_kernel = None
