"""CUDA SwiGLUOp: ``h = silu(g) * u`` and its gradients, one fused elementwise kernel each.

Same formulas and order of operations as :mod:`mila_py.ops.cpu.swiglu`, with
``s = 1 / (1 + exp(-g))`` and ``1 - s = 1 / (1 + exp(g))`` each computed directly::

    forward   h  = (s * g) * u
    backward  du = dh * (g * s)
              dg = dh * (((1 - s) * (g * s) + s) * u)

Where ``exp`` overflows to inf, ``1 / (1 + inf) = 0`` is the right limit (the GPU raises
nothing). The backward reads ``dh`` before writing ``dgate`` at each element, so ``dgate`` may be
``dh`` itself (the SwiGLU component relies on it). The kernels are templates over the storage
type (FP32, FP16, BF16): float32 arithmetic, each output rounded once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu._rows import out_rows
from mila_py.ops.cuda import _kernels
from mila_py.ops.registry import register_op

__all__ = ["CudaSwiGLUOp"]


@register_op("SwiGLUOp", DeviceType.CUDA, precisions=_kernels.CUDA_PRECISIONS)
class CudaSwiGLUOp(_kernels.KernelOp):
    """Fused ``silu(g) * u`` kernels (same contract as the CPU op)."""

    FILE = "swiglu.cu"
    TEMPLATES = ("swiglu_forward", "swiglu_backward")

    def forward(self, gate: Any, up: Any, out: Any) -> None:
        """``out = silu(gate) * up`` (``out`` C-contiguous, not aliasing the inputs)."""
        ctx: Any = self.context
        xp = ctx.xp
        with ctx.activate():
            g2 = _kernels.contiguous_rows(xp, gate)
            u2 = _kernels.contiguous_rows(xp, up)
            h2 = out_rows(out)
            n = int(h2.size)
            if n == 0:
                return
            self._launch(
                "swiglu_forward",
                _kernels.grid_1d(n),
                _kernels.THREADS,
                (g2, u2, h2, np.int64(n)),
            )

    def bind_forward(self, gate: Any, up: Any, out: Any) -> Callable[[], Any]:
        """:meth:`forward` of fixed buffers as one kernel launch with its arguments made here
        (C-contiguous ``gate`` and ``up``; else the general call)."""
        n = int(out.size)
        if not (gate.flags.c_contiguous and up.flags.c_contiguous) or n == 0:
            return super().bind_forward(gate, up, out)
        args = (gate, up, out_rows(out), np.int64(n))
        grid = _kernels.grid_1d(n)

        def run() -> None:
            self._launch("swiglu_forward", grid, _kernels.THREADS, args)

        return run

    def backward(self, gate: Any, up: Any, dh: Any, dgate: Any, dup: Any) -> None:
        """Overwrite ``dgate`` and ``dup`` (C-contiguous); ``dgate`` may be ``dh`` itself."""
        ctx: Any = self.context
        xp = ctx.xp
        with ctx.activate():
            g2 = _kernels.contiguous_rows(xp, gate)
            u2 = _kernels.contiguous_rows(xp, up)
            dg2, du2 = out_rows(dgate), out_rows(dup)
            # dh is dgate itself (C-contiguous) or read as its own contiguous rows (a float32
            # dh as the storage type)
            dh2 = dg2 if dh is dgate else _kernels.contiguous_rows(xp, self._storage(dh))
            n = int(dg2.size)
            if n == 0:
                return
            self._launch(
                "swiglu_backward",
                _kernels.grid_1d(n),
                _kernels.THREADS,
                (g2, u2, dh2, dg2, du2, np.int64(n)),
            )
