"""CPU AdamWOp: the AdamW update of one parameter in one Numba pass (the ``jit`` extra).

:class:`mila_py.optim.AdamW`'s array code makes about ten NumPy passes over ``p``, ``g``, ``m``
and ``v`` per parameter; this kernel reads each once and writes ``p``, ``m``, ``v`` once. It does
the same float operations in the same order, each rounded to the parameter's dtype (no fused
multiply-add), so it is bit-identical to the array code, which stays the reference and the path
without Numba (``accepts`` is False there, and under ``MILA_PY_CPU_BACKEND=numpy`` set
before the optimizer is created).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu import _fused_layers
from mila_py.ops.cpu._fused_op import FusedCpuOp
from mila_py.ops.operation import FusedAdamW
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["CpuAdamWOp"]


def _adamw(
    p,
    g,
    m,
    v,
    decays,
    decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    correction2_sqrt,
    eps,
    step_size,
):
    # p, g, m, v: 1-D views of one dtype; the scalars arrive in that dtype
    for i in range(p.size):
        gi = g[i]
        pi = p[i]
        if decays:
            pi = pi * decay
        mi = m[i] * beta1 + one_minus_beta1 * gi
        vi = v[i] * beta2 + one_minus_beta2 * gi * gi
        denom = np.sqrt(vi) / correction2_sqrt + eps
        p[i] = pi - step_size * (mi / denom)
        m[i] = mi
        v[i] = vi


if _fused_layers.AVAILABLE:
    import numba

    # NumPy's error model: x / 0 is inf, not a raised ZeroDivisionError (which would also stop
    # the loop from vectorizing); no fastmath: each operation rounds as NumPy's does
    _adamw_kernel: Any = numba.njit(cache=True, error_model="numpy")(_adamw)
else:
    _adamw_kernel = None


@register_op("AdamWOp", DeviceType.CPU, precisions=(Precision.FP32, Precision.FP64))
class CpuAdamWOp(FusedCpuOp, FusedAdamW):
    """The fused AdamW update of one parameter: one Numba pass (see :class:`FusedAdamW`)."""

    requirement = "dense float32/float64 arrays of one shape and one layout, with Numba enabled"

    def accepts(self, p: Any, g: Any, m: Any, v: Any, master: Any = None) -> bool:
        """True if Numba is on, the arrays are float32/64 of one dtype, dense, one layout
        (and no master copy: 16-bit parameters take the array code on the CPU)."""
        if master is not None:
            return False
        if not self.fuses(p.dtype) or any(a.dtype != p.dtype for a in (g, m, v)):
            return False
        return super().accepts(p, g, m, v)

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
        flat = [a.ravel(order="K") for a in (p, g, m, v)]  # views: dense, one layout
        _adamw_kernel(*flat, decays, *scalars)
