"""CUDA LinearOp: ``y = x W^T + b`` with cuBLAS (through CuPy), the weight in ``[out, in]`` layout.

With ``N`` the product of the leading dimensions of ``x``::

    forward   y  [N, out]  = x [N, in] @ W^T [in, out] + b     cupy.matmul into y (+ one add)
    backward  dW [out, in] += dy^T [out, N] @ x [N, in]         one GEMM with beta = 1
              db [out]     += sum_N dy [N, out]
              dx [N, in]   = dy [N, out] @ W [out, in]         cupy.matmul into dx

The weight may have any strides: cuBLAS reads a C- or F-contiguous ``W`` (or ``W^T``) in place,
so the INFERENCE layout (``W`` a transposed view of ``[in, out]`` storage) costs no copy. The
weight gradient accumulates inside the GEMM (``beta = 1``), with no temporary the size of the
weight.

FP16 and BF16: the forward and ``dx`` products take the 16-bit operands as they are (CuPy's
2-D matmul runs cuBLAS with float32 accumulation and rounds each output once, see
:func:`._kernels.matmul`); the float32 weight and bias gradients accumulate from float32 copies
of ``x`` and ``dy``. A float32 ``dy`` is used as it is (``dx`` then from a float32 copy of the
weight).

A decode plan's product (:meth:`CudaLinearOp.bind_forward`) of at most :data:`GEMV_MAX_ROWS`
rows is one launch of a kernel of ``linear.cu`` instead: CuPy refuses cuBLAS calls while a
stream captures a CUDA graph, and a product of so few rows is bound by reading ``W`` anyway,
which the kernel does once for all the rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu._rows import as_rows, out_rows
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["GEMV_MAX_ROWS", "CudaLinearOp", "kernel_names"]

#: the kernel file
_FILE = "linear.cu"
#: the most rows of ``x`` a bound product computes with the few-row kernels (a decode step's batch)
GEMV_MAX_ROWS = 16
#: the row counts the kernels are instantiated for (registers for this many rows per thread)
_ROW_TILES = (4, GEMV_MAX_ROWS)
#: threads per block of both kernels (8 warps; 4 slices of 64 outputs)
_THREADS = 256
#: outputs per block of ``linear_gemv_kn``
_KN_OUTPUTS = 64


def kernel_names() -> list[str]:
    """Every template instantiation of ``linear.cu`` the op launches (NVRTC name expressions)."""
    names = [f"linear_gemv_nk<{r}, {v}>" for r in _ROW_TILES for v in ("true", "false")]
    return names + [f"linear_gemv_kn<{r}>" for r in _ROW_TILES]


def _row_stride(a: Any) -> int | None:
    """The element stride between consecutive rows of ``a [..., C]`` read as ``[N, C]`` (its
    last dimension contiguous), or None where the rows are not evenly spaced in memory."""
    item = a.dtype.itemsize
    if a.ndim == 0 or (a.shape[-1] > 1 and a.strides[-1] != item):
        return None
    stride: int | None = None
    expected: int | None = None
    for size, step in reversed(list(zip(a.shape[:-1], a.strides[:-1], strict=True))):
        if size == 1:
            continue
        if stride is None:
            stride = step
        elif step != expected:
            return None
        expected = step * size
    if stride is None:
        return a.shape[-1]  # a single row: any stride reads it
    if stride % item:
        return None
    return stride // item


@register_op("LinearOp", DeviceType.CUDA, precisions=_kernels.CUDA_PRECISIONS)
class CudaLinearOp(Operation):
    """cuBLAS ``y = x W^T + b`` on the execution context's stream (same contract as the CPU op).

    Raises:
        OpNotFoundError: BF16 on a CuPy without bfloat16 arrays (made with the op).
    """

    def __init__(self, context: Any, config: Any, precision: Precision) -> None:
        _kernels.refuse_carried_bfloat16(context, precision, type(self).__name__)
        super().__init__(context, config, precision)

    def forward(self, x: Any, weight: Any, bias: Any, out: Any) -> None:
        """``out [..., out] = x [..., in] W^T + b`` (``out`` C-contiguous, written)."""
        ctx: Any = self.context
        with ctx.activate():
            y = out_rows(out)  # [N, out]
            _kernels.matmul(ctx.xp, as_rows(x), weight.T, y)
            if bias is not None:
                y += bias

    def bind_forward(self, x: Any, weight: Any, bias: Any, out: Any) -> Callable[[], Any]:
        """:meth:`forward` of fixed buffers, as a callable of no arguments (a decode plan).

        At most :data:`GEMV_MAX_ROWS` rows of float32 ``x [..., in]`` (rows evenly spaced, the
        last dimension contiguous; likewise ``out``), ``weight`` with either dimension
        contiguous and a contiguous ``bias`` (or None): one launch of a ``linear.cu`` kernel
        with its arguments made here, which a CUDA graph can capture (CuPy refuses cuBLAS
        calls during a capture). Otherwise one ``cupy.matmul`` on 2-D views of ``x`` and
        ``out`` when both are C-contiguous and there is no bias (run with the context active,
        as a decode plan is); else :meth:`forward` itself.
        """
        gemv = self._bind_gemv(x, weight, bias, out)
        if gemv is not None:
            return gemv
        if bias is None and x.flags.c_contiguous and out.flags.c_contiguous:
            xp = self.context.xp
            return functools.partial(_kernels.matmul, xp, as_rows(x), weight.T, out_rows(out))
        return super().bind_forward(x, weight, bias, out)

    def _bind_gemv(self, x: Any, weight: Any, bias: Any, out: Any) -> Callable[[], None] | None:
        """The few-row kernel launch of :meth:`bind_forward`, or None where it does not apply."""
        f32 = np.dtype(np.float32)
        if any(a.dtype != f32 for a in (x, weight, out)) or weight.ndim != 2:
            return None
        n_out, k_in = weight.shape
        m_rows = math.prod(x.shape[:-1])
        if not 0 < m_rows <= GEMV_MAX_ROWS or n_out == 0 or k_in == 0:
            return None
        if x.shape[-1] != k_in or out.shape[:-1] != x.shape[:-1] or out.shape[-1] != n_out:
            return None
        ldx, ldo = _row_stride(x), _row_stride(out)
        if ldx is None or ldo is None:
            return None
        if bias is not None and (
            bias.dtype != f32 or bias.shape != (n_out,) or not bias.flags.c_contiguous
        ):
            return None
        item = f32.itemsize
        s_n, s_k = weight.strides
        tile = next(r for r in _ROW_TILES if m_rows <= r)
        ctx: Any = self.context
        scalars = (np.int32(m_rows), np.int32(n_out), np.int32(k_in), np.int64(ldx))
        b = _kernels.NULL if bias is None else bias
        if s_k == item and s_n % item == 0 and s_n >= 0:
            ldw = s_n // item
            vec = (
                k_in % 4 == 0
                and ldw % 4 == 0
                and ldx % 4 == 0
                and _kernels.address(x) % 16 == 0
                and _kernels.address(weight) % 16 == 0
            )
            name = f"linear_gemv_nk<{tile}, {'true' if vec else 'false'}>"
            grid = (math.ceil(n_out / (_THREADS // 32)),)
        elif s_n == item and s_k % item == 0 and s_k >= 0:
            ldw = s_k // item
            name = f"linear_gemv_kn<{tile}>"
            grid = (math.ceil(n_out / _KN_OUTPUTS),)
        else:
            return None
        args = (x, weight, b, out, *scalars, np.int64(ldw), np.int64(ldo))
        names = tuple(kernel_names())

        def run() -> None:
            _kernels.launch(ctx, _FILE, name, grid, _THREADS, args, name_expressions=names)

        return run

    def backward(self, x: Any, weight: Any, dy: Any, dweight: Any, dbias: Any, dx: Any) -> None:
        """Accumulate ``dweight``, ``dbias`` (float32 for 16-bit storage); overwrite
        ``dx [..., in]`` (C-contiguous)."""
        ctx: Any = self.context
        xp = ctx.xp
        wide = dweight.dtype
        with ctx.activate():
            x2 = _kernels.contiguous_rows(xp, x)  # [N, in]
            dy2 = _kernels.contiguous_rows(xp, dy)  # [N, out]
            dy_wide = _kernels.as_dtype(xp, dy2, wide)
            # dW += dy^T x
            _kernels.gemm_accumulate(xp, dy_wide, _kernels.as_dtype(xp, x2, wide), dweight)
            if dbias is not None:
                dbias += dy_wide.sum(axis=0)
            # dx = dy W: a float32 dy takes the weight as float32 too (one rounding, into dx)
            _kernels.matmul(xp, dy2, _kernels.as_dtype(xp, weight, dy2.dtype), out_rows(dx))
