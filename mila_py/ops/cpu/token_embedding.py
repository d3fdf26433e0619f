"""CPU TokenEmbeddingOp: a table lookup and its scatter-add gradient.

::

    forward   y [N, D] = W [V, D] [tokens [N]]
    backward  dW [tokens[i]] += dy [i]        for every i (repeated ids add up)

The lookup has no input gradient (token ids are integers). The math is dtype-generic (the tests
run it in float64); the op trusts its caller to have checked that every id is in ``[0, V)``.
FP16 and BF16 tables are looked up as they are (a copy); their float32 gradient sums the
widened rows of ``dy``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu._rows import as_rows
from mila_py.ops.cpu._wide import CPU_PRECISIONS
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op

__all__ = ["CpuTokenEmbeddingOp", "token_embedding_backward", "token_embedding_forward"]


def token_embedding_forward(tokens: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = weight[tokens]``.

    Args:
        tokens: integers ``[...]``, every one in ``[0, V)``.
        weight: ``[V, D]``.
        out: ``[..., D]`` (``tokens.shape + (D,)``), written.
    """
    # mode="clip": the ids are already validated, and "raise" would buffer the whole output.
    np.take(weight, tokens, axis=0, out=out, mode="clip")


def token_embedding_backward(tokens: np.ndarray, dy: np.ndarray, dweight: np.ndarray) -> None:
    """``dweight[tokens[i]] += dy[i]`` for every position ``i`` (repeated ids accumulate).

    Rows of ``dy`` are grouped by id (a stable sort), each group summed with one ``reduceat``,
    and every used id's row updated once: several times faster than ``np.add.at``, for one
    temporary the size of ``dy``.

    Args:
        tokens: integers ``[...]`` of the forward call.
        dy: ``[..., D]`` upstream gradient (not modified).
        dweight: ``[V, D]``, accumulated (its dtype is the sums'; a 16-bit ``dy`` is widened).
    """
    ids = tokens.reshape(-1)  # [N]
    if ids.size == 0:
        return
    order = np.argsort(ids, kind="stable")  # [N] positions grouped by id
    grouped = ids[order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])  # [U] first of each id
    rows = as_rows(dy)[order].astype(dweight.dtype, copy=False)  # [N, D] grouped by id
    dweight[grouped[starts]] += np.add.reduceat(rows, starts, axis=0)  # [U, D]


@register_op("TokenEmbeddingOp", DeviceType.CPU, precisions=CPU_PRECISIONS)
class CpuTokenEmbeddingOp(Operation):
    """NumPy embedding lookup (see :func:`token_embedding_forward`)."""

    def forward(self, tokens: Any, weight: Any, out: Any) -> None:
        token_embedding_forward(tokens, weight, out)

    def backward(self, tokens: Any, dy: Any, dweight: Any) -> None:
        token_embedding_backward(tokens, dy, dweight)
