"""CUDA LinearOp: ``y = x W^T + b`` with cuBLAS (through CuPy), the weight in ``[out, in]`` layout.

With ``N`` the product of the leading dimensions of ``x``::

    forward   y  [N, out]  = x [N, in] @ W^T [in, out] + b     cupy.matmul into y (+ one add)
    backward  dW [out, in] += dy^T [out, N] @ x [N, in]         one GEMM with beta = 1
              db [out]     += sum_N dy [N, out]
              dx [N, in]   = dy [N, out] @ W [out, in]         cupy.matmul into dx

The weight may have any strides: cuBLAS reads a C- or F-contiguous ``W`` (or ``W^T``) in place.
CUDA builds keep every weight as ``[out, in]`` rows (the decode kernel below reads those), and
the tied head is the embedding's ``[vocab, dim]`` rows. The weight gradient accumulates inside
the GEMM (``beta = 1``), with no temporary the size of the weight.

FP16 and BF16: the forward and ``dx`` products take the 16-bit operands as they are (CuPy's
2-D matmul runs cuBLAS with float32 accumulation and rounds each output once, see
:func:`._kernels.matmul`); the float32 weight and bias gradients accumulate from float32 copies
of ``x`` and ``dy``. A float32 ``dy`` is used as it is (``dx`` then from a float32 copy of the
weight).

A decode plan's product (:meth:`CudaLinearOp.bind_forward`: at most :data:`DECODE_MAX_ROWS`
rows, one per sequence, over an ``[out, in]`` weight with its rows contiguous, the layout of
every CUDA build) is one launch of ``linear.cu``'s ``linear_rows`` kernel instead of cuBLAS.
CuPy refuses cuBLAS calls while a stream captures a CUDA graph, so a step with them could not
be captured; and a product of so few rows is bound by reading ``W`` once, which the kernel
is written to do at close to the memory's bandwidth for all the rows together (its comment
gives the reasoning; ``benchmarks/decode_products.py`` measures it against ``cupy.matmul`` and
a copy of the same bytes). Prefill and training (more rows) stay on cuBLAS.
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

__all__ = ["DECODE_MAX_ROWS", "CudaLinearOp", "kernel_names"]

#: the kernel file of the decode products
_FILE = "linear.cu"
#: the most rows of ``x`` a bound product computes with ``linear_rows`` (a decode step's batch)
DECODE_MAX_ROWS = 16
#: the row counts ``linear_rows`` is instantiated for (its sums for this many rows per thread):
#: a product takes the smallest that holds its rows
_ROW_TILES = (1, 2, 4, 8, DECODE_MAX_ROWS)
#: threads per block of ``linear_rows`` (4 warps, its ``__launch_bounds__``)
_THREADS = 128
#: bytes per vector load of ``linear_rows`` (an ``int4``)
_CHUNK = 16


def kernel_names(precision: Precision) -> tuple[str, ...]:
    """Every instantiation of ``linear.cu``'s ``linear_rows`` for ``precision``'s storage type
    (NVRTC name expressions): each row tile, vector and scalar."""
    t = _kernels.CTYPES[precision]
    return tuple(f"linear_rows<{t}, {r}, {v}>" for r in _ROW_TILES for v in ("true", "false"))


def _weight_rows_per_warp(tile: int) -> int:
    """Rows of ``W`` one warp of ``linear_rows<T, tile, ...>`` computes (its ``NW``)."""
    return 2 if tile in (4, 8) else 1


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
        return int(a.shape[-1])  # a single row: any stride reads it
    if stride <= 0 or stride % item:
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
        """:meth:`forward` of fixed buffers, as a callable of no arguments (a decode plan's).

        At most :data:`DECODE_MAX_ROWS` rows of ``x [..., in]`` (rows evenly spaced, the last
        dimension contiguous; likewise ``out [..., out]``) in the op's storage type, a
        ``weight [out, in]`` whose rows are contiguous and a contiguous ``bias [out]`` or None:
        one launch of ``linear.cu``'s ``linear_rows``, its arguments made here, which a CUDA
        graph captures (CuPy refuses cuBLAS calls during a capture). Otherwise one
        ``cupy.matmul`` on 2-D views of ``x`` and ``out`` when both are C-contiguous and there
        is no bias (run with the context active, as a decode plan is); else :meth:`forward`
        itself.
        """
        rows = self._bind_rows(x, weight, bias, out)
        if rows is not None:
            return rows
        if bias is None and x.flags.c_contiguous and out.flags.c_contiguous:
            xp = self.context.xp
            return functools.partial(_kernels.matmul, xp, as_rows(x), weight.T, out_rows(out))
        return super().bind_forward(x, weight, bias, out)

    def _bind_rows(self, x: Any, weight: Any, bias: Any, out: Any) -> Callable[[], None] | None:
        """The ``linear_rows`` launch of :meth:`bind_forward`, or None where it does not apply."""
        dtype = np.dtype(self.precision.numpy_dtype)
        if any(a.dtype != dtype for a in (x, weight, out)) or weight.ndim != 2:
            return None
        n_out, k_in = (int(d) for d in weight.shape)
        m_rows = math.prod(x.shape[:-1])
        if not 0 < m_rows <= DECODE_MAX_ROWS or n_out == 0 or k_in == 0:
            return None
        if x.shape[-1] != k_in or out.shape != (*x.shape[:-1], n_out):
            return None
        if bias is not None and (
            bias.dtype != dtype or bias.shape != (n_out,) or not bias.flags.c_contiguous
        ):
            return None
        item = dtype.itemsize
        s_n, s_k = weight.strides
        if k_in > 1 and s_k != item:
            return None  # not [out, in] rows (cuBLAS takes the other layouts)
        if n_out == 1:
            s_n = k_in * item  # a single row: any stride reads it
        ldx, ldo = _row_stride(x), _row_stride(out)
        if ldx is None or ldo is None or s_n <= 0 or s_n % item:
            return None
        ldw = s_n // item
        per_chunk = _CHUNK // item
        vec = (
            k_in % per_chunk == 0
            and ldw % per_chunk == 0
            and ldx % per_chunk == 0
            and _kernels.address(x) % _CHUNK == 0
            and _kernels.address(weight) % _CHUNK == 0
        )
        tile = next(r for r in _ROW_TILES if m_rows <= r)
        name = (
            f"linear_rows<{_kernels.CTYPES[self.precision]}, {tile}, {'true' if vec else 'false'}>"
        )
        outputs_per_block = (_THREADS // 32) * _weight_rows_per_warp(tile)
        grid = (math.ceil(n_out / outputs_per_block),)
        args = (
            x,
            weight,
            _kernels.NULL if bias is None else bias,
            out,
            np.int32(m_rows),
            np.int32(n_out),
            np.int32(k_in),
            np.int64(ldx),
            np.int64(ldw),
            np.int64(ldo),
        )
        names = kernel_names(self.precision)
        ctx = self.context

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
