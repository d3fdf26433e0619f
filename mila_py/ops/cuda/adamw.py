"""CUDA AdamWOp: one fused kernel per parameter for :class:`mila_py.optim.AdamW`'s update.

The generic array code of ``AdamW.step`` launches about a dozen CuPy kernels (and as many
temporaries) per parameter; this kernel reads ``p, g, m, v`` once and writes ``p, m, v`` once,
with NumPy's float32 roundings in the same order::

    p = p * decay                              (parameters that decay)
    m = m * beta1 + (1 - beta1) * g
    v = v * beta2 + (1 - beta2) * g * g        (scaled, then squared, as torch)
    p = p - step_size * (m / (sqrt(v) / sqrt(correction2) + eps))   (as torch orders them)

A 16-bit parameter has an FP32 master copy in the optimizer: ``adamw_master_step<T>`` runs the
same update on the master (FP32 ``g``, ``m``, ``v``) and stores the new master rounded to ``T``
into the parameter, in the same pass (``T``: the op's precision, FP16 or BF16).

Every scalar arrives as the float32 that NumPy would round the Python float to.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import FusedAdamW
from mila_py.ops.registry import register_op

__all__ = ["CudaAdamWOp"]

#: the kernel file
_FILE = "adamw.cu"


@register_op("AdamWOp", DeviceType.CUDA, precisions=_kernels.CUDA_PRECISIONS)
class CudaAdamWOp(_kernels.KernelOp, FusedAdamW):
    """The fused AdamW update of one parameter: one kernel launch (see :class:`FusedAdamW`).

    An FP32 op updates FP32 parameters in place; an FP16 or BF16 op updates parameters of its
    precision through their FP32 master copies (``master=`` of :meth:`step`).
    """

    FILE = _FILE
    TEMPLATES = ("adamw_master_step",)
    requirement = (
        "dense float32 arrays of one shape and one layout (a 16-bit p: of the op's precision, "
        "with a float32 master, all C-contiguous)"
    )

    def accepts(self, p: Any, g: Any, m: Any, v: Any, master: Any = None) -> bool:
        """True for float32 ``p`` (no master) or ``p`` of the op's 16-bit precision with a
        float32 ``master``, dense as :class:`FusedAdamW` asks."""
        if (master is None) != (self.dtype == np.float32) or p.dtype != self.dtype:
            return False
        return super().accepts(p, g, m, v, master)

    def _update(
        self,
        p: Any,
        g: Any,
        m: Any,
        v: Any,
        decays: bool,
        scalars: tuple[Any, ...],
        master: Any = None,
    ) -> None:
        n = int(p.size)
        grid = _kernels.grid_1d(n)
        if master is None:
            args = (p, g, m, v, np.int64(n), np.int32(decays), *scalars)
            self._launch("adamw_step", grid, _kernels.THREADS, args)
        else:
            args = (p, master, g, m, v, np.int64(n), np.int32(decays), *scalars)
            self._launch("adamw_master_step", grid, _kernels.THREADS, args)
