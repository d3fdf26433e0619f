"""CUDA RmsNormOp: root-mean-square normalization over the last axis, as fused raw kernels.

Same math and order of operations as :mod:`mila_py.ops.cpu.rms_norm`, per row ``x [D]``::

    forward   r = 1 / sqrt(sum(x^2) / D + eps)         one block per row: a block sum (double), then
              y = (x * r) * w                          the scaled row (x read twice, y once)
    backward  n = x * r,  g = dy * w
              dx = r * (g - n * (sum(g * n) / D))       one block per row
              dw += sum_N dy * n                        column partial sums over row chunks,
                                                        then one CuPy sum over the chunks

The weight gradient is deterministic: no atomics, a fixed split of the rows into chunks. The
kernels are templates over the storage type (FP32, FP16, BF16): 16-bit ``x``, ``w``, ``y``,
``dy`` and ``dx``, float32 ``r`` and weight gradient (a float32 ``dy`` is rounded to the
storage type first).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu._rows import out_flat, out_rows
from mila_py.ops.cuda import _kernels
from mila_py.ops.registry import register_op

__all__ = ["CudaRmsNormOp"]

#: rows each column thread of the weight-gradient kernel sums at least (then chunks <= 512)
_MIN_ROWS_PER_CHUNK = 8
_MAX_CHUNKS = 512


def dweight_chunks(n_rows: int) -> tuple[int, int]:
    """``(rows_per_chunk, chunks)`` of the weight-gradient kernel for ``n_rows`` rows."""
    per = max(_MIN_ROWS_PER_CHUNK, math.ceil(n_rows / _MAX_CHUNKS))
    return per, max(1, math.ceil(n_rows / per))


@register_op("RmsNormOp", DeviceType.CUDA, precisions=_kernels.CUDA_PRECISIONS)
class CudaRmsNormOp(_kernels.KernelOp):
    """Fused RMS normalization kernels (same contract as the CPU op)."""

    FILE = "rms_norm.cu"
    TEMPLATES = ("rms_norm_forward", "rms_norm_backward_dx", "rms_norm_backward_dw")

    def forward(self, x: Any, weight: Any, out: Any, rstd: Any) -> None:
        """``out = x / sqrt(mean(x^2, -1) + eps) * weight``; ``rstd [...]`` gets ``r`` per row."""
        ctx: Any = self.context
        with ctx.activate():
            x2 = _kernels.contiguous_rows(ctx.xp, x)  # [N, D]
            y2, r = out_rows(out), out_flat(rstd)
            n_rows, dim = x2.shape
            if n_rows == 0:
                return
            w = ctx.xp.ascontiguousarray(weight)
            args = (x2, w, y2, r, np.int32(dim), np.float32(self.config.eps))
            self._launch("rms_norm_forward", (n_rows,), _kernels.ROW_THREADS, args)

    def bind_forward(self, x: Any, weight: Any, out: Any, rstd: Any) -> Callable[[], Any]:
        """:meth:`forward` of fixed buffers as one kernel launch with its arguments made here
        (C-contiguous ``weight`` and ``out``). A strided ``x`` (the heads of Q, a view of the
        QKV buffer, under ``qk_norm``) is copied into ``out`` first (``xp.copyto``, no new
        memory) and normalized there in place: the kernel reads each element of a row, sums the
        row, then each thread writes only the elements it read. Else the general call."""
        if not (weight.flags.c_contiguous and out.flags.c_contiguous) or x.size == 0:
            return super().bind_forward(x, weight, out, rstd)
        if x.flags.c_contiguous:
            return self._bound(x.reshape(-1, x.shape[-1]), weight, out, rstd, None)
        if x.shape != out.shape:
            return super().bind_forward(x, weight, out, rstd)
        return self._bound(out_rows(out), weight, out, rstd, x)

    def _bound(self, x2: Any, weight: Any, out: Any, rstd: Any, staged: Any) -> Callable[[], Any]:
        """The launch over the rows ``x2 [N, D]``, after a copy of ``staged`` into ``out``
        (which ``x2`` then views) unless None."""
        ctx: Any = self.context
        n_rows, dim = x2.shape
        eps = np.float32(self.config.eps)
        args = (x2, weight, out_rows(out), out_flat(rstd), np.int32(dim), eps)
        copyto = ctx.xp.copyto

        def run() -> None:
            if staged is not None:
                copyto(out, staged)
            self._launch("rms_norm_forward", (n_rows,), _kernels.ROW_THREADS, args)

        return run

    def backward(self, x: Any, weight: Any, rstd: Any, dy: Any, dweight: Any, dx: Any) -> None:
        """Accumulate ``dweight [D]``; overwrite ``dx [..., D]`` (C-contiguous)."""
        ctx: Any = self.context
        xp = ctx.xp
        with ctx.activate():
            x2 = _kernels.contiguous_rows(xp, x)  # [N, D]
            dy2 = _kernels.contiguous_rows(xp, self._storage(dy))
            dx2 = out_rows(dx)
            r = xp.ascontiguousarray(rstd.reshape(-1))  # [N]
            n_rows, dim = x2.shape
            if n_rows == 0:
                return
            w = xp.ascontiguousarray(weight)
            self._launch(
                "rms_norm_backward_dx",
                (n_rows,),
                _kernels.ROW_THREADS,
                (x2, w, r, dy2, dx2, np.int32(dim)),
            )
            per, chunks = dweight_chunks(n_rows)
            partial = xp.empty((chunks, dim), dtype=np.float32)
            self._launch(
                "rms_norm_backward_dw",
                (math.ceil(dim / _kernels.THREADS), chunks),
                _kernels.THREADS,
                (x2, r, dy2, partial, np.int32(n_rows), np.int32(dim), np.int32(per)),
            )
            dweight += partial.sum(axis=0)
