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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu._rows import as_rows, out_rows
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["CudaLinearOp"]


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
        """:meth:`forward` of fixed buffers: one ``cupy.matmul`` on 2-D views of ``x`` and
        ``out`` when both are C-contiguous and there is no bias (run with the context active,
        as a decode plan is); else :meth:`forward` itself."""
        if bias is None and x.flags.c_contiguous and out.flags.c_contiguous:
            xp = self.context.xp
            return functools.partial(_kernels.matmul, xp, as_rows(x), weight.T, out_rows(out))
        return super().bind_forward(x, weight, bias, out)

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
