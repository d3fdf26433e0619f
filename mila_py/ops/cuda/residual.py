"""CUDA ResidualOp: ``y = x + scale * f`` with CuPy's elementwise kernels on the context's stream.

The array code is :class:`mila_py.ops.cpu.residual.ResidualOpBase`'s, run with ``xp = cupy``
inside the context's activation (its device and stream current); CuPy's FP16 and BF16 ``add``
computes in float32 and rounds once.
"""

from __future__ import annotations

from typing import Any

from mila_py.devices import DeviceType
from mila_py.ops.cpu.residual import ResidualOpBase
from mila_py.ops.cuda import _kernels
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["CudaResidualOp"]


@register_op("ResidualOp", DeviceType.CUDA, precisions=_kernels.CUDA_PRECISIONS)
class CudaResidualOp(ResidualOpBase):
    """CuPy residual (see :class:`ResidualOpBase`).

    Raises:
        OpNotFoundError: BF16 on a CuPy without bfloat16 arrays (made with the op).
    """

    def __init__(self, context: Any, config: Any, precision: Precision) -> None:
        _kernels.refuse_carried_bfloat16(context, precision, type(self).__name__)
        super().__init__(context, config, precision)

    def forward(self, x: Any, f: Any, out: Any) -> None:
        with self.context.activate():
            super().forward(x, f, out)

    def backward(self, dy: Any, df: Any) -> Any:
        with self.context.activate():
            return super().backward(dy, df)
