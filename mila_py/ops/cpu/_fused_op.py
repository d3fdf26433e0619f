"""Base of the CPU ops that run fused Numba kernels where they can."""

from __future__ import annotations

from typing import Any

from mila_py.ops.cpu._fused_math import FUSED_DTYPES, backend_allows
from mila_py.ops.operation import Operation

__all__ = ["FusedCpuOp"]


class FusedCpuOp(Operation):
    """An op with a fused kernel path and a NumPy reference path.

    Whether it may fuse is settled once, when the op is created (with its component): Numba is
    installed and ``MILA_PY_CPU_BACKEND`` is not ``numpy`` at that moment (as for ``RopeOp``). A
    per-call environment lookup cost ~1 us, and decode makes a few hundred calls per token.

    Attributes:
        fused: the fused kernels are allowed; :meth:`fuses` adds the dtype condition.
    """

    def __init__(self, context: Any, config: Any, precision: Any) -> None:
        super().__init__(context, config, precision)
        self.fused = backend_allows()

    def fuses(self, dtype: Any) -> bool:
        """Whether a call on arrays of ``dtype`` runs the fused kernels (float32 / float64)."""
        return self.fused and dtype in FUSED_DTYPES
