"""CPU AdamWOp: the AdamW update of one parameter in one Numba pass (the ``jit`` extra).

:class:`mila_py.optim.AdamW`'s array code makes about ten NumPy passes over ``p``, ``g``, ``m``
and ``v`` per parameter; this kernel reads each once and writes ``p``, ``m``, ``v`` once. It does
the same float operations in the same order, each rounded to the parameter's dtype (no fused
multiply-add), so it is bit-identical to the array code, which stays the reference and the path
without Numba (``accepts`` is False there, and under ``MILA_PY_CPU_BACKEND=numpy``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu import _fused_layers
from mila_py.ops.operation import Operation
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
    correction2,
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
        vi = v[i] * beta2 + one_minus_beta2 * (gi * gi)
        denom = np.sqrt(vi / correction2) + eps
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
class CpuAdamWOp(Operation):
    """The fused AdamW update of one parameter (``config`` is unused: hyper-parameters per call)."""

    @staticmethod
    def accepts(p: Any, g: Any, m: Any, v: Any) -> bool:
        """True if the kernel can update these arrays: Numba on, float32/64, dense, one layout."""
        if not _fused_layers.enabled(p.dtype):
            return False
        dense = bool(p.flags.c_contiguous or p.flags.f_contiguous)
        return dense and all(
            a.dtype == p.dtype and a.shape == p.shape and a.strides == p.strides for a in (g, m, v)
        )

    def step(
        self,
        p: Any,
        g: Any,
        m: Any,
        v: Any,
        *,
        decay: float | None,
        betas: tuple[float, float],
        correction2: float,
        eps: float,
        step_size: float,
    ) -> None:
        """Update ``p``, ``m``, ``v`` in place from ``g`` (all C- or all F-contiguous, one shape).

        Args:
            decay: the factor ``1 - lr * weight_decay`` for a decaying parameter, else None.
            betas: ``(beta1, beta2)``.
            correction2: ``1 - beta2 ** step``.
            eps: denominator guard.
            step_size: ``lr / (1 - beta1 ** step)``.

        Raises:
            ValueError: the arrays are not ones :meth:`accepts` (nothing is updated).
        """
        if not self.accepts(p, g, m, v):
            raise ValueError(
                "CPU AdamWOp: p, g, m and v must be dense float32/float64 arrays of one layout "
                f"with Numba enabled, got dtypes {p.dtype}, {g.dtype}, {m.dtype}, {v.dtype} and "
                f"strides {p.strides}, {g.strides}, {m.strides}, {v.strides}"
            )
        beta1, beta2 = betas
        t = p.dtype.type
        flat = [a.ravel(order="K") for a in (p, g, m, v)]  # views: dense, one layout
        _adamw_kernel(
            *flat, decay is not None, t(1.0 if decay is None else decay), t(beta1), t(1.0 - beta1),
            t(beta2), t(1.0 - beta2), t(correction2), t(eps), t(step_size),
        )  # fmt: skip
