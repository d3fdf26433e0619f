"""CUDA AdamWOp: one fused kernel per parameter for :class:`mila_py.optim.AdamW`'s update.

The generic array code of ``AdamW.step`` launches about a dozen CuPy kernels (and as many
temporaries) per parameter; this kernel reads ``p, g, m, v`` once and writes ``p, m, v`` once,
with NumPy's float32 roundings in the same order::

    p = p * decay                              (parameters that decay)
    m = m * beta1 + (1 - beta1) * g
    v = v * beta2 + (1 - beta2) * g * g        (scaled, then squared, as torch)
    p = p - step_size * (m / (sqrt(v) / sqrt(correction2) + eps))   (as torch orders them)

Every scalar arrives as the float32 that NumPy would round the Python float to.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import FusedAdamW
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["CudaAdamWOp"]

#: the kernel file
_FILE = "adamw.cu"


@register_op("AdamWOp", DeviceType.CUDA, precisions=(Precision.FP32,))
class CudaAdamWOp(FusedAdamW):
    """The fused AdamW update of one parameter: one kernel launch (see :class:`FusedAdamW`)."""

    def _update(
        self, p: Any, g: Any, m: Any, v: Any, decays: bool, scalars: tuple[Any, ...]
    ) -> None:
        n = int(p.size)
        args = (p, g, m, v, np.int64(n), np.int32(decays), *scalars)
        ctx: Any = self.context
        with ctx.activate():
            _kernels.launch(ctx, _FILE, "adamw_step", _kernels.grid_1d(n), _kernels.THREADS, args)
