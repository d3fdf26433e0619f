"""CPU RmsNormOp: root-mean-square normalization over the last axis (Hugging Face LlamaRMSNorm).

Per row ``x [D]`` with weight ``w [D]``::

    forward   r = 1 / sqrt(mean(x^2) + eps)            # [N], kept for backward
              y = (x * r) * w                          # [N, D], HF's order of operations
    backward  n = x * r,  g = dy * w                   # [N, D]
              dw [D]    += sum_N dy * n
              dx [N, D]  = r * (g - n * mean(g * n))

``eps`` is taken in the compute dtype (float32 for float32 and 16-bit storage, float64 for
float64), as torch's RMSNorm adds it to a float32 mean square and as the CUDA op passes it: a
``1e-45`` is float32's ``2^-149`` on every device. The mean square itself sums in float64.

Rows are processed in cache-sized blocks, so temporaries stay small however large the batch.
The math is dtype-generic (the tests run it in float64); the op trusts its caller's shapes.
FP16 and BF16 storage computes in float32, ``y`` and ``dx`` rounded once (``r`` and ``dw`` are
float32 buffers): the fused forward reads and writes the 16-bit bits, the other paths run the
float32 code on widened copies (see :mod:`._wide`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.devices.overlap import same_view
from mila_py.ops.cpu import _fused_layers
from mila_py.ops.cpu._fused_math import bits, compiled, storage
from mila_py.ops.cpu._fused_op import FusedCpuOp
from mila_py.ops.cpu._rows import apart_from, as_rows, out_flat, out_rows, row_blocks
from mila_py.ops.cpu._wide import CPU_PRECISIONS, is_reduced, store, wide, wide_like
from mila_py.ops.registry import register_op

__all__ = ["CpuRmsNormOp", "rms_norm_backward", "rms_norm_forward"]


def rms_norm_forward(
    x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray, rstd: np.ndarray
) -> None:
    """``out = x / sqrt(mean(x^2, -1) + eps) * weight``.

    Args:
        x: ``[..., D]``.
        weight: ``[D]``.
        eps: added to the mean square, rounded to ``rstd``'s dtype (the compute dtype) first.
        out: ``[..., D]``, C-contiguous, written.
        rstd: ``[...]`` (x's leading shape), C-contiguous, written with ``r`` for backward.
    """
    x2, y2 = as_rows(x), out_rows(out)  # [N, D]
    r = out_flat(rstd)  # [N]
    dim = x2.shape[1]
    eps = float(rstd.dtype.type(eps))
    for s in row_blocks(x2.shape[0], dim):
        xb, yb, rb = x2[s], y2[s], r[s]
        # the mean square in float64, as the fused kernel: x^2 of float32 rows overflows past
        # |x| ~ 1e19 and underflows below ~1e-23 (y would be 0, or 16% off)
        mean = np.einsum("nd,nd->n", xb, xb, dtype=np.float64)  # [n], no [n, D] temporary
        mean /= dim  # (np.mean has a Python-level overhead decode's tiny rows feel)
        mean += eps
        np.sqrt(mean, out=mean)
        np.divide(1.0, mean, out=rb, casting="same_kind")
        np.multiply(xb, rb[:, None], out=yb)
        yb *= weight


def rms_norm_backward(
    x: np.ndarray,
    weight: np.ndarray,
    rstd: np.ndarray,
    dy: np.ndarray,
    dweight: np.ndarray,
    dx: np.ndarray,
) -> None:
    """Accumulate ``dweight`` and write ``dx``.

    Args:
        x: ``[..., D]`` the forward input.
        weight: ``[D]``.
        rstd: ``[...]`` the ``r`` written by :func:`rms_norm_forward`.
        dy: ``[..., D]`` upstream gradient (not modified).
        dweight: ``[D]``, accumulated.
        dx: ``[..., D]``, C-contiguous, overwritten.
    """
    x2, dy2, dx2 = as_rows(x), as_rows(dy), out_rows(dx)  # [N, D]
    r = rstd.reshape(-1)  # [N]
    dim = x2.shape[1]
    for s in row_blocks(x2.shape[0], dim):
        rb = r[s, None]  # [n, 1]
        n = x2[s] * rb  # [n, D] normalized input
        dweight += np.einsum("nd,nd->d", dy2[s], n)
        g = np.multiply(dy2[s], weight, out=dx2[s])  # [n, D]
        c = np.einsum("nd,nd->n", g, n)[:, None] / dim  # [n, 1] mean(g * n)
        n *= c
        g -= n
        g *= rb


@register_op("RmsNormOp", DeviceType.CPU, precisions=CPU_PRECISIONS)
class CpuRmsNormOp(FusedCpuOp):
    """RMS normalization (see :func:`rms_norm_forward`, :func:`rms_norm_backward`); forward and
    backward run the fused Numba kernels of :mod:`._fused_layers` when they are available."""

    def fuses(self, dtype: Any) -> bool:
        """Whether calls on ``dtype`` run the fused kernels (16-bit storage: as float32)."""
        return super().fuses(np.dtype(np.float32) if is_reduced(dtype) else dtype)

    def forward(self, x: Any, weight: Any, out: Any, rstd: Any) -> None:
        x, weight = apart_from((out, rstd), x, weight)
        if self.fuses(x.dtype):  # one pass (Numba), see _fused_layers
            self._fused_call(x, weight, out, rstd)()
        elif is_reduced(out.dtype):  # float32 copies, y rounded once
            y = wide_like(out)
            rms_norm_forward(wide(x), wide(weight), self.config.eps, y, rstd)
            store(out, y)
        else:
            rms_norm_forward(x, weight, self.config.eps, out, rstd)

    def _fused_call(self, x: Any, weight: Any, out: Any, rstd: Any) -> Callable[[], Any]:
        """The fused kernel on 2-D views (16-bit storage as its bits), as a call of its
        compiled function (no dispatch: decode plans bind it)."""
        args = (
            bits(as_rows(x)),
            bits(weight),
            float(self.config.eps),
            bits(out_rows(out)),
            out_flat(rstd),
            storage(x.dtype),
        )
        return functools.partial(compiled(_fused_layers.rms_norm_rows, args), *args)

    def bind_forward(self, x: Any, weight: Any, out: Any, rstd: Any) -> Callable[[], Any]:
        """The fused kernel on 2-D views (C-contiguous ``x``), else :meth:`forward`."""
        if self.fuses(x.dtype) and x.flags.c_contiguous:
            return self._fused_call(x, weight, out, rstd)
        return super().bind_forward(x, weight, out, rstd)

    def backward(self, x: Any, weight: Any, rstd: Any, dy: Any, dweight: Any, dx: Any) -> None:
        # Both paths read a row (a block of rows) of x and dy before writing that part of dx:
        # dx may be dy itself (the same elements in the same order); any other overlap with x
        # or dy is copied first, as rows written early would be read later.
        if is_reduced(dx.dtype):  # float32 copies, dx rounded once
            grad = wide_like(dx)
            self._backward(wide(x), wide(weight), rstd, wide(dy), dweight, grad)
            store(dx, grad)
            return
        x, weight, rstd = apart_from((dx, dweight), x, weight, rstd)
        (dy,) = apart_from((dweight,) if same_view(dx, dy) else (dx, dweight), dy)
        self._backward(x, weight, rstd, dy, dweight, dx)

    def _backward(self, x: Any, weight: Any, rstd: Any, dy: Any, dweight: Any, dx: Any) -> None:
        if self.fuses(x.dtype):  # two passes a row (Numba)
            _fused_layers.rms_norm_backward_rows(
                as_rows(x), weight, rstd.reshape(-1), as_rows(dy), dweight, out_rows(dx)
            )
        else:
            rms_norm_backward(x, weight, rstd, dy, dweight, dx)
