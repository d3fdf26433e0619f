"""CPU LinearOp: ``y = x W^T + b`` on NumPy arrays, with the weight in PyTorch's ``[out, in]`` layout.

With ``N`` the product of the leading dimensions of ``x``::

    forward   y  [N, out]  = x [N, in] @ W^T [in, out] + b [out]
    backward  dW [out, in] += dy^T [out, N] @ x [N, in]
              db [out]     += sum_N dy [N, out]
              dx [N, in]   = dy [N, out] @ W [out, in]

Parameter gradients accumulate (``+=``) so micro-batches add up; ``dx`` is overwritten. The math
is dtype-generic (the tests run it in float64); the op trusts its caller to have validated shapes.

FP16 and BF16 (16-bit ``x``, ``W``, ``b``, ``y``, ``dx``; float32 ``dW``, ``db``): the products
run in float32 on widened copies and each output is rounded once (:mod:`._wide`), except a
decode plan's few-row product, which a Numba kernel computes from the 16-bit weight itself
(:mod:`._fused_linear`): a widened copy of every weight per token would cost more than the
product.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu import _fused_linear
from mila_py.ops.cpu._fused_op import FusedCpuOp
from mila_py.ops.cpu._rows import as_rows, out_rows
from mila_py.ops.cpu._wide import CPU_PRECISIONS, is_reduced, store, wide, wide_like
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op

__all__ = ["CpuLinearOp", "bind_linear_forward", "linear_backward", "linear_forward"]


def linear_forward(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out: np.ndarray, xp: Any = np
) -> None:
    """``out = x W^T + b``.

    Args:
        x: ``[..., in]``.
        weight: ``[out, in]``.
        bias: ``[out]`` or None.
        out: ``[..., out]``, C-contiguous, written.
        xp: the array module of the arrays (NumPy here; the CUDA op passes CuPy).
    """
    y = out_rows(out)  # [N, out]
    if xp is np and is_reduced(out.dtype):  # float32 products of widened copies, one rounding
        acc = np.matmul(wide(as_rows(x)), wide(weight).T)
        if bias is not None:
            acc += wide(bias)
        store(y, acc)
        return
    xp.matmul(as_rows(x), weight.T, out=y)  # BLAS reads W^T through strides: no copy
    if bias is not None:
        y += bias


def bind_linear_forward(
    op: Operation, x: Any, weight: Any, bias: Any, out: Any
) -> Callable[[], Any]:
    """``op``'s forward of fixed buffers as one matrix product of the op's array module on 2-D
    views of ``x`` and ``out`` (BLAS on the CPU, cuBLAS on CUDA) when both are C-contiguous and
    there is no bias; else the op's own forward (see :meth:`Operation.bind_forward`)."""
    if bias is None and x.flags.c_contiguous and out.flags.c_contiguous:
        matmul = op.context.xp.matmul
        return functools.partial(matmul, as_rows(x), weight.T, out=out_rows(out))
    return Operation.bind_forward(op, x, weight, bias, out)


def linear_backward(
    x: np.ndarray,
    weight: np.ndarray,
    dy: np.ndarray,
    dweight: np.ndarray,
    dbias: np.ndarray | None,
    dx: np.ndarray,
) -> None:
    """Accumulate ``dW``, ``db`` and write ``dx`` for the upstream gradient ``dy``.

    Args:
        x: ``[..., in]`` the forward input.
        weight: ``[out, in]``.
        dy: ``[..., out]`` upstream gradient (not modified).
        dweight: ``[out, in]``, ``+= dy^T x`` (float32 for 16-bit storage).
        dbias: ``[out]``, ``+= sum(dy)``, or None when the layer has no bias.
        dx: ``[..., in]``, C-contiguous, overwritten with ``dy W``.
    """
    x2 = wide(as_rows(x))  # [N, in]
    dy2 = wide(as_rows(dy))  # [N, out]
    # NumPy cannot accumulate into the output of a matmul (BLAS beta = 1): one temporary the
    # size of the weight per call.
    dweight += dy2.T @ x2  # [out, in]
    if dbias is not None:
        dbias += dy2.sum(axis=0)  # [out]
    dx2 = out_rows(dx)
    acc = wide_like(dx2)
    np.matmul(dy2, wide(weight), out=acc)  # [N, in]
    store(dx2, acc)


@register_op("LinearOp", DeviceType.CPU, precisions=CPU_PRECISIONS)
class CpuLinearOp(FusedCpuOp):
    """NumPy ``y = x W^T + b`` (see :func:`linear_forward`, :func:`linear_backward`)."""

    def forward(self, x: Any, weight: Any, bias: Any, out: Any) -> None:
        linear_forward(x, weight, bias, out)

    def bind_forward(self, x: Any, weight: Any, bias: Any, out: Any) -> Callable[[], Any]:
        """One BLAS call on 2-D views of ``x`` and ``out`` (see :func:`bind_linear_forward`);
        for 16-bit storage of at most :data:`~._fused_linear.MAX_ROWS` rows (a decode step),
        the Numba kernel that reads the 16-bit weight in place."""
        if is_reduced(x.dtype):
            if self.fused and _fused_linear.applies(x, weight, bias, out):
                return _fused_linear.bind(x, weight, bias, out)
            return Operation.bind_forward(self, x, weight, bias, out)
        return bind_linear_forward(self, x, weight, bias, out)

    def backward(self, x: Any, weight: Any, dy: Any, dweight: Any, dbias: Any, dx: Any) -> None:
        linear_backward(x, weight, dy, dweight, dbias, dx)
