"""CUDA SoftmaxCrossEntropyOp: mean cross-entropy of logits against integer targets, fused kernels.

Same math as :mod:`mila_py.ops.cpu.softmax_cross_entropy`, per row ``z [V]`` with target ``t``::

    forward   m = max z,  lse = log(sum exp(z - m)) + m     one block per row; also writes the
              row's loss (m - z_t) + log(sum) in float64 (max and log-sum apart, as the CPU op:
              lse rounded to fp32 next to a large max loses the log-sum) and whether it counts;
              one CuPy sum over the rows and one device-to-host copy of (total, count) per call
    backward  p = exp(z - lse) / sum_v exp(z_v - lse)       one block per row: the row
              dz = (p - [v == t]) * scale                   renormalized, as the CPU op (lse
                                                            rounded next to a large max puts
                                                            one factor on the whole row); 0 on
                                                            rows whose target is ignore_index

The kernels are templates over the logits' storage type (FP32, FP16, BF16); the softmax, ``lse``
and loss are float32 (float64 for the loss), ``dlogits`` is rounded once per element.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu._rows import out_flat, out_rows
from mila_py.ops.cuda import _kernels
from mila_py.ops.registry import register_op

__all__ = ["CudaSoftmaxCrossEntropyOp"]


@register_op("SoftmaxCrossEntropyOp", DeviceType.CUDA, precisions=_kernels.CUDA_PRECISIONS)
class CudaSoftmaxCrossEntropyOp(_kernels.KernelOp):
    """Fused softmax cross-entropy kernels (same contract as the CPU op)."""

    FILE = "softmax_cross_entropy.cu"
    TEMPLATES = ("softmax_cross_entropy_forward", "softmax_cross_entropy_backward")

    def forward(self, logits: Any, targets: Any, lse: Any) -> tuple[float, int]:
        """``(mean loss, count)`` over rows whose target is not ``ignore_index``; writes ``lse``.

        Synchronizes with the host once (the loss is returned as a Python float).
        """
        ctx: Any = self.context
        xp = ctx.xp
        with ctx.activate():
            z2 = _kernels.contiguous_rows(xp, logits)  # [N, V]
            lse1 = out_flat(lse)  # [N]
            n_rows, vocab = z2.shape
            if n_rows == 0:
                return math.nan, 0
            t = xp.ascontiguousarray(targets.reshape(-1), dtype=np.int64)  # [N]
            stats = xp.empty((n_rows, 2), dtype=np.float64)
            args = (z2, t, lse1, stats, np.int32(vocab), np.int64(self.config.ignore_index))
            self._launch(
                "softmax_cross_entropy_forward",
                (n_rows,),
                _kernels.ROW_THREADS,
                args,
            )
            totals = ctx.to_host(stats.sum(axis=0))  # [total loss, count]
        count = int(totals[1])
        if count == 0:
            return math.nan, 0
        return float(totals[0]) / count, count

    def backward(self, logits: Any, targets: Any, lse: Any, dlogits: Any, scale: float) -> None:
        """``dlogits = (softmax(logits) - onehot(targets)) * scale``; zero rows where ignored."""
        ctx: Any = self.context
        xp = ctx.xp
        with ctx.activate():
            z2 = _kernels.contiguous_rows(xp, logits)  # [N, V]
            d2 = out_rows(dlogits)
            if d2.size == 0:
                return
            t = xp.ascontiguousarray(targets.reshape(-1), dtype=np.int64)
            lse1 = xp.ascontiguousarray(lse.reshape(-1))
            args = (
                z2, t, lse1, d2, np.int32(z2.shape[1]), np.int64(self.config.ignore_index),
                np.float32(scale),
            )  # fmt: skip
            self._launch(
                "softmax_cross_entropy_backward",
                (z2.shape[0],),
                _kernels.ROW_THREADS,
                args,
            )
