"""ResidualOp on the CPU, and the array code it shares with the CUDA op: ``y = x + scale * f``.

With ``scale == 1`` (the transformer residual) the forward is one ``add`` and the backward
hands ``dy`` on unchanged to both inputs: no arithmetic and no buffer. The code is written once
for the context's array module (``ctx.xp``): the CUDA op runs it with CuPy (its 16-bit storage
through kernels of its own). FP16 and BF16 sums are computed in float32 and rounded once
(NumPy's 16-bit ``add`` does that already; a scaled branch is widened first).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices import DeviceType
from mila_py.ops.cpu._wide import CPU_PRECISIONS, is_reduced, wide
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op

__all__ = ["CpuResidualOp", "ResidualOpBase"]


class ResidualOpBase(Operation):
    """``y = x + scale * f`` and its gradient, on the context's array module."""

    def forward(self, x: Any, f: Any, out: Any) -> None:
        """``out = x + scale * f`` (all ``[..., dim]``; ``out`` may be ``x`` or ``f``)."""
        xp = self.context.xp
        scale = self.config.scale
        if scale == 1:
            xp.add(x, f, out=out)
        elif xp is np and is_reduced(out.dtype):  # x + scale * f in float32, one rounding
            out[...] = wide(x) + wide(f) * np.float32(scale)
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
        if self.context.xp is np and is_reduced(df.dtype):  # the exact scale, one rounding
            df[...] = wide(dy) * np.float32(scale)
            return df
        self.context.xp.multiply(dy, dy.dtype.type(scale), out=df)
        return df


@register_op("ResidualOp", DeviceType.CPU, precisions=CPU_PRECISIONS)
class CpuResidualOp(ResidualOpBase):
    """NumPy residual (see :class:`ResidualOpBase`)."""
