"""The CPU ops' 16-bit storage: FP16 and BF16 arrays computed in float32, rounded once on store.

A CPU op given FP16 or BF16 arrays widens each operand it reads to a float32 copy
(:func:`wide`), runs its float32 code into float32 results and stores each result into its
16-bit output in one rounding (:func:`store`). The copies cost one pass over the operands per
call: fine for prefill and training, whose arithmetic dwarfs it. Decode steps, which would copy
every weight matrix and the whole KV cache per token, read the 16-bit arrays in Numba kernels
instead (:mod:`._fused_linear`, :mod:`._fused_attention`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.ops.cpu._fused_math import REDUCED_DTYPES
from mila_py.precision import Precision

__all__ = ["CPU_PRECISIONS", "is_reduced", "store", "wide", "wide_like"]

#: every precision the CPU layer ops take
CPU_PRECISIONS = (Precision.FP32, Precision.FP64, Precision.FP16, Precision.BF16)


def is_reduced(dtype: Any) -> bool:
    """Whether ``dtype`` is FP16 or BF16 storage."""
    return dtype in REDUCED_DTYPES


def wide(x: Any) -> Any:
    """``x`` as float32 (a new array) when it is 16-bit storage, else ``x`` itself; None stays
    None."""
    if x is None or x.dtype not in REDUCED_DTYPES:
        return x
    return x.astype(np.float32)


def wide_like(out: np.ndarray) -> np.ndarray:
    """Where a result bound for ``out`` is computed: a float32 array of its shape when ``out``
    is 16-bit storage (to :func:`store` afterwards), else ``out`` itself."""
    if out.dtype not in REDUCED_DTYPES:
        return out
    return np.empty(out.shape, np.float32)


def store(out: np.ndarray, value: np.ndarray) -> None:
    """``out[...] = value`` rounded once to ``out``'s dtype; nothing when ``value`` is ``out``
    (a float32 or float64 result computed in place)."""
    if value is not out:
        out[...] = value
