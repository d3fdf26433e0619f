"""ResidualOp on the CPU, and the array code it shares with the CUDA op: ``y = x + scale * f``.

With ``scale == 1`` (the transformer residual) the forward is one ``add`` and the backward
hands ``dy`` on unchanged to both inputs: no arithmetic and no buffer. The code is written once
for the context's array module (``ctx.xp``): the CUDA op runs it with CuPy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from mila_py.devices import DeviceType
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["CpuResidualOp", "ResidualOpBase"]


class ResidualOpBase(Operation):
    """``y = x + scale * f`` and its gradient, on the context's array module."""

    def forward(self, x: Any, f: Any, out: Any) -> None:
        """``out = x + scale * f`` (all ``[..., dim]``; ``out`` may be ``x`` or ``f``)."""
        xp = self.context.xp
        scale = self.config.scale
        if scale == 1:
            xp.add(x, f, out=out)
        else:  # one temporary: out may be x or f
            xp.add(x, f * out.dtype.type(scale), out=out)

    def bind_forward(self, x: Any, f: Any, out: Any) -> Callable[[], Any]:
        """One ``add`` for ``scale == 1``, else :meth:`forward` (run with the context active)."""
        if self.config.scale == 1:
            return functools.partial(self.context.xp.add, x, f, out=out)
        return super().bind_forward(x, f, out)

    def backward(self, dy: Any, df: Any) -> Any:
        """The gradient of ``f``: ``dy`` itself for ``scale == 1``, else ``scale * dy`` written
        into ``df`` and returned. (The gradient of ``x`` is ``dy``.)"""
        scale = self.config.scale
        if scale == 1:
            return dy
        self.context.xp.multiply(dy, dy.dtype.type(scale), out=df)
        return df


@register_op("ResidualOp", DeviceType.CPU, precisions=(Precision.FP32, Precision.FP64))
class CpuResidualOp(ResidualOpBase):
    """NumPy residual (see :class:`ResidualOpBase`)."""
