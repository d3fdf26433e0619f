"""CUDA ResidualOp: ``y = x + scale * f`` with CuPy's elementwise kernels on the context's stream.

The array code is :class:`mila_py.ops.cpu.residual.ResidualOpBase`'s, run with ``xp = cupy``
inside the context's activation (its device and stream current).
"""

from __future__ import annotations

from typing import Any

from mila_py.devices import DeviceType
from mila_py.ops.cpu.residual import ResidualOpBase
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["CudaResidualOp"]


@register_op("ResidualOp", DeviceType.CUDA, precisions=(Precision.FP32,))
class CudaResidualOp(ResidualOpBase):
    """CuPy residual (see :class:`ResidualOpBase`)."""

    def forward(self, x: Any, f: Any, out: Any) -> None:
        with self.context.activate():
            super().forward(x, f, out)

    def backward(self, dy: Any, df: Any) -> Any:
        with self.context.activate():
            return super().backward(dy, df)
