"""CUDA LinearOp: ``y = x W^T + b`` with cuBLAS (through CuPy), the weight in ``[out, in]`` layout.

With ``N`` the product of the leading dimensions of ``x``::

    forward   y  [N, out]  = x [N, in] @ W^T [in, out] + b     one GEMM (+ one broadcast add)
    backward  dW [out, in] += dy^T [out, N] @ x [N, in]         one GEMM with beta = 1
              db [out]     += sum_N dy [N, out]
              dx [N, in]   = dy [N, out] @ W [out, in]         one GEMM

The forward is :func:`mila_py.ops.cpu.linear.linear_forward` itself, run with ``xp=cupy``. The
weight may have any strides: cuBLAS reads a C- or F-contiguous ``W`` (or ``W^T``) in place, so
the INFERENCE layout (``W`` a transposed view of ``[in, out]`` storage) costs no copy. The weight
gradient accumulates inside the GEMM (``beta = 1``), with no temporary the size of the weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu._rows import as_rows, out_rows
from mila_py.ops.cpu.linear import bind_linear_forward, linear_forward
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["DIRECT_GEMM", "CudaLinearOp"]

#: :meth:`CudaLinearOp.bind_forward` (a decode plan's products) calls cuBLAS ``sgemm`` with its
#: arguments made once (:func:`_kernels.bind_gemm`) instead of :func:`cupy.matmul` at each call.
#: On since an H100 run (2026-11-26): the GPU tests pass with each, and a small Llama's decode
#: plan step fell from 685 to 509 us per token (``benchmarks/decode_plan.py``, whose third row
#: is the plan with ``cupy.matmul``); ``pytest --no-direct-gemm`` runs the tests without it.
DIRECT_GEMM = True


@register_op("LinearOp", DeviceType.CUDA, precisions=(Precision.FP32,))
class CudaLinearOp(Operation):
    """cuBLAS ``y = x W^T + b`` on the execution context's stream (same contract as the CPU op)."""

    def forward(self, x: Any, weight: Any, bias: Any, out: Any) -> None:
        """``out [..., out] = x [..., in] W^T + b`` (``out`` C-contiguous, written)."""
        ctx: Any = self.context
        with ctx.activate():
            linear_forward(x, weight, bias, out, xp=ctx.xp)

    def bind_forward(self, x: Any, weight: Any, bias: Any, out: Any) -> Callable[[], Any]:
        """One cuBLAS call on 2-D views of ``x`` and ``out``: with :data:`DIRECT_GEMM`, a
        ``sgemm`` whose arguments are made here (:func:`_kernels.bind_gemm`), else
        :func:`cupy.matmul` (see :func:`bind_linear_forward`). Run it with the context active
        (a decode plan is)."""
        if DIRECT_GEMM and bias is None and x.flags.c_contiguous and out.flags.c_contiguous:
            call = _kernels.bind_gemm(self.context, as_rows(x), weight.T, out_rows(out))
            if call is not None:
                return call
        return bind_linear_forward(self, x, weight, bias, out)

    def backward(self, x: Any, weight: Any, dy: Any, dweight: Any, dbias: Any, dx: Any) -> None:
        """Accumulate ``dweight``, ``dbias``; overwrite ``dx [..., in]`` (C-contiguous)."""
        ctx: Any = self.context
        xp = ctx.xp
        with ctx.activate():
            x2 = _kernels.contiguous_rows(xp, x)  # [N, in]
            dy2 = _kernels.contiguous_rows(xp, dy)  # [N, out]
            _kernels.gemm_accumulate(xp, dy2, x2, dweight)  # dW += dy^T x
            if dbias is not None:
                dbias += dy2.sum(axis=0)
            xp.matmul(dy2, weight, out=out_rows(dx))  # dx = dy W
