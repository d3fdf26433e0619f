"""CPU SoftmaxCrossEntropyOp: mean cross-entropy of logits against integer targets.

Per row ``z [V]`` with target ``t`` (rows whose target is ``ignore_index`` are skipped)::

    forward   lse  = m + log(sum_v exp(z_v - m)),  m = max_v z_v     # [N], kept for backward
              loss = sum_{valid rows} ((m - z_t) + log(sum)) / count   # in float64
    backward  dz   = (p - onehot(t)) * scale, p = exp(z - lse) / sum_v exp(z_v - lse)
                                                                     # [N, V]; 0 on ignored rows

``scale`` is ``dloss / count`` for the mean. Subtracting the row maximum keeps ``exp`` finite;
rows are processed in cache-sized blocks, so temporaries stay small however large ``V`` is.
The math is dtype-generic (the tests run it in float64); the op trusts its caller to have checked
that every target is in ``[0, V)`` or equal to ``ignore_index``. FP16 and BF16 logits are
widened to float32 a block of rows at a time (the softmax, ``lse`` and the loss in float32 and
float64); ``dlogits`` is rounded once per element.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu._rows import as_rows, out_flat, out_rows, row_blocks
from mila_py.ops.cpu._wide import CPU_PRECISIONS, store, wide, wide_like
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op

__all__ = [
    "CpuSoftmaxCrossEntropyOp",
    "softmax_cross_entropy_backward",
    "softmax_cross_entropy_forward",
]


def softmax_cross_entropy_forward(
    logits: np.ndarray, targets: np.ndarray, ignore_index: int, lse: np.ndarray
) -> tuple[float, int]:
    """Mean loss over the rows whose target is not ``ignore_index``.

    Args:
        logits: ``[..., V]``.
        targets: integers ``[...]``.
        ignore_index: target value of rows that do not count.
        lse: ``[...]``, C-contiguous, written with each row's log-sum-exp.

    Returns:
        ``(loss, count)``: the mean over ``count`` counted rows (NaN when ``count == 0``, as
        PyTorch's ``cross_entropy`` returns).
    """
    z2 = as_rows(logits)  # [N, V]
    lse1 = out_flat(lse)  # [N]
    # the loss from max and log-sum apart, in float64: lse rounded to the logits' dtype loses
    # log(sum) next to a large max (logits of 1e4 lose ~1e-4 of the loss)
    row_max = np.empty(z2.shape[0], np.float64)
    log_sum = np.empty(z2.shape[0], np.float64)
    for s in row_blocks(z2.shape[0], z2.shape[1]):
        zb = wide(z2[s])
        m = zb.max(axis=1)  # [n]
        e = zb - m[:, None]  # [n, V]
        np.exp(e, out=e)
        log_sum[s] = np.log(e.sum(axis=1, dtype=np.float64))
        row_max[s] = m
        lse1[s] = row_max[s] + log_sum[s]
    rows, cols = _counted(targets, ignore_index)
    if rows.size == 0:
        return math.nan, 0
    picked = z2[rows, cols].astype(np.float64)  # [count] target logits
    total = float(np.sum((row_max[rows] - picked) + log_sum[rows]))
    return total / rows.size, int(rows.size)


def softmax_cross_entropy_backward(
    logits: np.ndarray,
    targets: np.ndarray,
    ignore_index: int,
    lse: np.ndarray,
    dlogits: np.ndarray,
    scale: float,
) -> None:
    """``dlogits = (softmax(logits) - onehot(targets)) * scale``, zero rows for ignored targets.

    Args:
        logits: ``[..., V]`` of the forward call.
        targets: integers ``[...]`` of the forward call.
        ignore_index: target value of rows that do not count.
        lse: ``[...]`` written by :func:`softmax_cross_entropy_forward`.
        dlogits: ``[..., V]``, C-contiguous, overwritten.
        scale: ``dloss / count`` for a mean loss.
    """
    z2, d2 = as_rows(logits), out_rows(dlogits)  # [N, V]
    lse1 = lse.reshape(-1)  # [N]
    t = targets.reshape(-1)  # [N]
    for s in row_blocks(z2.shape[0], z2.shape[1]):
        block = d2[s]
        db = wide_like(block)  # the block itself, or its float32 stand-in (16-bit storage)
        np.subtract(wide(z2[s]), lse1[s, None], out=db)
        np.exp(db, out=db)  # softmax: z - lse <= 0, so exp <= 1
        # divided by its sum: lse rounded next to a large max puts one factor on the whole
        # row (logits of 1e4: 1e-5 relative), which the sum takes out
        db *= scale / db.sum(axis=1, keepdims=True)
        rows, cols = _counted(t[s], ignore_index)
        db[rows, cols] -= scale
        db[t[s] == ignore_index] = 0
        store(block, db)


def _counted(targets: np.ndarray, ignore_index: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices ``[count]`` and their targets ``[count]`` of the rows that count."""
    t = targets.reshape(-1)  # [N]
    rows = np.flatnonzero(t != ignore_index)
    return rows, t[rows]


@register_op("SoftmaxCrossEntropyOp", DeviceType.CPU, precisions=CPU_PRECISIONS)
class CpuSoftmaxCrossEntropyOp(Operation):
    """NumPy softmax cross-entropy (see :func:`softmax_cross_entropy_forward`)."""

    def forward(self, logits: Any, targets: Any, lse: Any) -> tuple[float, int]:
        return softmax_cross_entropy_forward(logits, targets, self.config.ignore_index, lse)

    def backward(self, logits: Any, targets: Any, lse: Any, dlogits: Any, scale: float) -> None:
        softmax_cross_entropy_backward(
            logits, targets, self.config.ignore_index, lse, dlogits, scale
        )
