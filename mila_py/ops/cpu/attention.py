"""CPU AttentionOp: causal grouped-query scaled-dot-product attention, forward and backward.

Shapes (g = n_heads / n_kv_heads query heads share one key/value head):

- q ``[B, T, Hq*d]``, k and v ``[B, T, Hk*d]`` (views of a fused QKV buffer are fine);
- probabilities ``P [B, Hk, g, T, T]`` are kept for backward;
- output ``[B, T, Hq*d]``.

Queries may start at a position offset into the keys (``q_offset``): query ``t`` sees keys
``0 .. q_offset + t``, which is what chunked prefill against a KV cache needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.devices import DeviceType
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["CpuAttentionOp", "attention_backward", "attention_forward"]


def _split(x: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """``[B, T, H*d]`` -> ``[B, H, T, d]`` (a view)."""
    n_b, n_t = x.shape[0], x.shape[1]
    return x.reshape(n_b, n_t, heads, head_dim).transpose(0, 2, 1, 3)


def _causal_bias(n_tq: int, n_tk: int, q_offset: int, dtype: np.dtype) -> np.ndarray:
    """``[Tq, Tk]``: 0 where query ``t`` may see key ``s`` (``s <= q_offset + t``), else -inf."""
    future = np.arange(n_tk)[None, :] > (q_offset + np.arange(n_tq))[:, None]
    return np.where(future, -np.inf, 0.0).astype(dtype)


def attention_forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    n_heads: int,
    n_kv_heads: int,
    scale: float,
    out: np.ndarray,
    probs: np.ndarray | None = None,
    q_offset: int = 0,
    bias: np.ndarray | None = None,
    causal: bool = True,
) -> np.ndarray:
    """Causal attention; writes ``out [B, Tq, Hq*d]`` and returns ``P [B, Hk, g, Tq, Tk]``.

    Args:
        q: ``[B, Tq, Hq*d]``; k, v: ``[B, Tk, Hk*d]`` with ``Tk >= q_offset + Tq``.
        probs: optional buffer for P (else allocated).
        q_offset: position of the first query among the keys.
        bias: the causal bias of :func:`_causal_bias` for these sizes, if the caller caches it.
        causal: False when every query sees every key given (one decode token per sequence,
            all at the last position): no bias is added.
    """
    n_b, n_tq = q.shape[0], q.shape[1]
    n_tk = k.shape[1]
    head_dim = q.shape[2] // n_heads
    groups = n_heads // n_kv_heads
    # Scaling Q (T*d values) is cheaper than scaling the scores (T*T values).
    qh = (_split(q, n_heads, head_dim) * scale).reshape(n_b, n_kv_heads, groups, n_tq, head_dim)
    kh = _split(k, n_kv_heads, head_dim)[:, :, None]  # [B, Hk, 1, Tk, d]
    vh = _split(v, n_kv_heads, head_dim)[:, :, None]
    scores = np.matmul(qh, kh.swapaxes(-1, -2), out=probs)  # [B, Hk, g, Tq, Tk]
    if bias is not None:
        scores += bias
    elif causal:
        scores += _causal_bias(n_tq, n_tk, q_offset, scores.dtype)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    o = np.matmul(scores, vh)  # [B, Hk, g, Tq, d]
    out[...] = o.reshape(n_b, n_heads, n_tq, head_dim).transpose(0, 2, 1, 3).reshape(out.shape)
    return scores


def attention_backward(
    dout: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    probs: np.ndarray,
    n_heads: int,
    n_kv_heads: int,
    scale: float,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    out: np.ndarray | None = None,
) -> None:
    """Gradients of :func:`attention_forward` into ``dq [B, T, Hq*d]``, ``dk``, ``dv [B, T, Hk*d]``.

    ``out`` (the forward output) lets the softmax backward use ``rowsum(dP * P) = dO . O``,
    a ``[T, d]`` product instead of a pass over the ``[T, T]`` scores.
    """
    n_b, n_t = q.shape[0], q.shape[1]
    head_dim = q.shape[2] // n_heads
    groups = n_heads // n_kv_heads
    shape5 = (n_b, n_kv_heads, groups, n_t, head_dim)
    do = _split(dout, n_heads, head_dim).reshape(shape5)
    qh = _split(q, n_heads, head_dim).reshape(shape5)
    kh = _split(k, n_kv_heads, head_dim)[:, :, None]
    vh = _split(v, n_kv_heads, head_dim)[:, :, None]
    dv_h = np.matmul(probs.swapaxes(-1, -2), do).sum(axis=2)  # [B, Hk, T, d]
    dp = np.matmul(do, vh.swapaxes(-1, -2))  # [B, Hk, g, T, T]
    if out is not None:
        oh = _split(out, n_heads, head_dim).reshape(shape5)
        row = np.einsum("...td,...td->...t", do, oh)[..., None]
    else:
        row = np.einsum("...ts,...ts->...t", dp, probs)[..., None]
    dp -= row
    dp *= probs  # dS / scale; masked entries have P == 0
    dq_h = np.matmul(dp, kh)  # [B, Hk, g, T, d]
    dq_h *= scale
    dk_h = np.matmul(dp.swapaxes(-1, -2), qh).sum(axis=2)  # [B, Hk, T, d]
    dk_h *= scale
    dq[...] = dq_h.reshape(n_b, n_heads, n_t, head_dim).transpose(0, 2, 1, 3).reshape(dq.shape)
    dk[...] = dk_h.transpose(0, 2, 1, 3).reshape(dk.shape)
    dv[...] = dv_h.transpose(0, 2, 1, 3).reshape(dv.shape)


@register_op("AttentionOp", DeviceType.CPU, precisions=(Precision.FP32, Precision.FP64))
class CpuAttentionOp(Operation):
    """NumPy causal GQA attention (see :func:`attention_forward` / :func:`attention_backward`)."""

    def forward(self, *args: Any, **kwargs: Any) -> np.ndarray:
        return attention_forward(*args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> None:
        attention_backward(*args, **kwargs)
