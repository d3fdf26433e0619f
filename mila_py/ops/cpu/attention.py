"""CPU AttentionOp: causal grouped-query scaled-dot-product attention, forward and backward.

Shapes (g = n_heads / n_kv_heads query heads share one key/value head):

- q ``[B, T, Hq*d]``, k and v ``[B, T, Hk*d]`` (views of a fused QKV buffer are fine);
- probabilities ``P [B, Hk, g, T, T]`` are kept for backward;
- output ``[B, T, Hq*d]``.

Queries may start at a position offset into the keys (``q_offset``): query ``t`` sees keys
``0 .. q_offset + t``, which is what chunked prefill against a KV cache needs.

FP16 and BF16 storage (q, k, v, the output, the KV cache and the gradients): the scores,
softmax and products run in float32 on widened copies, the probabilities are float32 buffers
and each output is rounded once (:mod:`._wide`); decode reads the 16-bit cache in the fused
kernel of :mod:`._fused_attention` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices import DeviceType
from mila_py.ops.cpu import _fused_attention
from mila_py.ops.cpu._fused_math import bits, storage
from mila_py.ops.cpu._fused_op import FusedCpuOp
from mila_py.ops.cpu._wide import CPU_PRECISIONS, is_reduced, store, wide, wide_like
from mila_py.ops.operation import DecodePositions, bind_attention_decode, bind_cache_write
from mila_py.ops.registry import register_op

__all__ = ["CpuAttentionOp", "attention_backward", "attention_forward", "attention_prefill"]

#: query rows per block of :func:`attention_prefill`
PREFILL_BLOCK = 128


def _split(x: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """``[B, T, H*d]`` -> ``[B, H, T, d]`` (a view)."""
    n_b, n_t = x.shape[0], x.shape[1]
    return x.reshape(n_b, n_t, heads, head_dim).transpose(0, 2, 1, 3)


def _future(n_tq: int, n_tk: int, q_offset: int) -> np.ndarray:
    """``[Tq, Tk]``: True where query ``t`` may not see key ``s`` (``s > q_offset + t``)."""
    return np.arange(n_tk)[None, :] > (q_offset + np.arange(n_tq))[:, None]


def _visible_bias(visible: Any, n_tk: int, dtype: Any, xp: Any = np) -> Any:
    """``[B, 1, 1, 1, Tk]``: 0 for the first ``visible[b]`` keys of sequence ``b``, else -inf."""
    seen = xp.arange(n_tk)[None, :] < xp.asarray(visible)[:, None]
    return xp.where(seen, 0.0, -np.inf).astype(dtype)[:, None, None, None, :]


def values_product(p4: Any, v: Any, visible: Any, heads: Callable[[Any], Any], xp: Any) -> Any:
    """``P [B, Hk, g*Tq, Tk] @ V`` (``v [B, Tk, Hk*d]``, ``heads`` its ``[B, Hk, Tk, d]`` view)
    over the values each sequence sees: with ``visible`` (host ints ``[B]``, ragged decode)
    the rows a sequence does not see (cache rows past its position) are left out, not only
    weighted 0 (0 * a NaN or inf there would reach it). Only rows from the smallest
    ``visible`` on can be unseen: they alone go through a masked copy."""
    if visible is None:
        return xp.matmul(p4, heads(v))
    counts = np.asarray(visible, dtype=np.int64)
    lo = int(counts.min()) if counts.size else v.shape[1]
    o = xp.matmul(p4[..., :lo], heads(v[:, :lo]))
    if lo < v.shape[1]:
        tail = v[:, lo:]
        seen = xp.arange(tail.shape[1])[None, :, None] < xp.asarray(counts - lo)[:, None, None]
        o += xp.matmul(p4[..., lo:], heads(xp.where(seen, tail, tail.dtype.type(0))))
    return o


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
    softmax: Callable[[np.ndarray, int, bool], None] | None = None,
    visible: Any = None,
) -> np.ndarray:
    """Causal attention; writes ``out [B, Tq, Hq*d]`` and returns ``P [B, Hk, g, Tq, Tk]``.

    Args:
        q: ``[B, Tq, Hq*d]``; k, v: ``[B, Tk, Hk*d]`` with ``Tk >= q_offset + Tq``.
        probs: optional buffer for P (else allocated).
        q_offset: position of the first query among the keys.
        bias: an additive bias broadcastable to P, -inf where a key is masked (the causal
            mask is then the caller's).
        causal: False when every query sees every key given (one decode token per sequence,
            all at the last position): no bias is added.
        softmax: when given and ``bias`` is None, ``softmax(scores [R, Tq, Tk], q_offset,
            causal)`` turns the scores into probabilities in place (the fused kernel of
            :mod:`._fused_attention`) instead of the NumPy passes below.
        visible: host ints ``[B]``: sequence ``b`` sees keys ``0 .. visible[b] - 1`` (ragged
            decode, one query per sequence); replaces ``bias`` and ``causal``.
    """
    n_b, n_tq = q.shape[0], q.shape[1]
    n_tk = k.shape[1]
    if visible is not None:
        bias = _visible_bias(visible, n_tk, q.dtype)
    head_dim = q.shape[2] // n_heads
    groups = n_heads // n_kv_heads
    # The g query heads that share a key/value head are stacked into one [g * Tq, d] matrix,
    # so each (sequence, kv head) is one matmul. Scaling Q (T*d values) is cheaper than
    # scaling the scores (T*T values).
    qh = (_split(q, n_heads, head_dim) * scale).reshape(n_b, n_kv_heads, groups * n_tq, head_dim)
    kh = _split(k, n_kv_heads, head_dim)  # [B, Hk, Tk, d]
    shape5 = (n_b, n_kv_heads, groups, n_tq, n_tk)
    merged = None if probs is None else probs.reshape(n_b, n_kv_heads, groups * n_tq, n_tk)
    scores = np.matmul(qh, kh.swapaxes(-1, -2), out=merged).reshape(shape5)
    if softmax is not None and bias is None:
        softmax(scores.reshape(-1, n_tq, n_tk), q_offset, causal)
    else:
        # masked scores are set to -inf, not added to: a NaN or inf in a key no query may see
        # (a cache row not written yet) must not reach the rows that cannot see it
        if bias is not None:
            scores += bias
            np.copyto(scores, -np.inf, where=np.isneginf(bias))
        elif causal:
            np.copyto(scores, -np.inf, where=_future(n_tq, n_tk, q_offset))
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
    p4 = scores.reshape(n_b, n_kv_heads, groups * n_tq, n_tk)
    o = values_product(p4, v, visible, lambda a: _split(a, n_kv_heads, head_dim), np)
    out[...] = o.reshape(n_b, n_heads, n_tq, head_dim).transpose(0, 2, 1, 3).reshape(out.shape)
    return scores


def attention_prefill(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    n_heads: int,
    n_kv_heads: int,
    scale: float,
    out: np.ndarray,
    q_offset: int = 0,
    softmax: Callable[[np.ndarray, int, bool], None] | None = None,
    block: int = PREFILL_BLOCK,
) -> None:
    """Causal attention of a prefill chunk into ``out``, keeping no probabilities.

    The queries go in blocks of ``block`` rows, each against the keys up to its last query
    only (:func:`attention_forward` per block): the matrix products and the softmax skip the
    keys past each block, which a single call would score and mask. For a 900-token chunk that
    is ~20% of the attention (6 query / 2 key heads of 64).

    Args:
        q: ``[B, Tq, Hq*d]``; k, v: ``[B, Tk, Hk*d]`` with ``Tk >= q_offset + Tq`` (keys past
            ``q_offset + Tq`` are never read).
        out: ``[B, Tq, Hq*d]``, written.
        q_offset: position of the first query among the keys.
        softmax: as for :func:`attention_forward`.
    """
    n_tq = q.shape[1]
    for start in range(0, n_tq, block):
        stop = min(start + block, n_tq)
        end = q_offset + stop
        attention_forward(
            q[:, start:stop], k[:, :end], v[:, :end], n_heads, n_kv_heads, scale,
            out[:, start:stop], q_offset=q_offset + start, softmax=softmax,
        )  # fmt: skip


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
    softmax_backward: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
) -> None:
    """Gradients of :func:`attention_forward` into ``dq [B, T, Hq*d]``, ``dk``, ``dv [B, T, Hk*d]``.

    ``out`` (the forward output) lets the softmax backward use ``rowsum(dP * P) = dO . O``,
    a ``[T, d]`` product instead of a pass over the ``[T, T]`` scores. ``softmax_backward(dp,
    probs, row)``, when given, computes ``dp = (dp - row) * probs`` in place in one pass
    (arrays ``[R, T, T]`` and ``[R, T, 1]``).
    """
    n_b, n_t = q.shape[0], q.shape[1]
    head_dim = q.shape[2] // n_heads
    groups = n_heads // n_kv_heads
    stacked = (n_b, n_kv_heads, groups * n_t, head_dim)  # the g query heads of a kv head
    do = _split(dout, n_heads, head_dim).reshape(stacked)
    qh = _split(q, n_heads, head_dim).reshape(stacked)
    kh = _split(k, n_kv_heads, head_dim)  # [B, Hk, T, d]
    vh = _split(v, n_kv_heads, head_dim)
    p = probs.reshape(n_b, n_kv_heads, groups * n_t, n_t)
    dv_h = np.matmul(p.swapaxes(-1, -2), do)  # [B, Hk, T, d]: the sum over the g heads
    dp = np.matmul(do, vh.swapaxes(-1, -2))  # [B, Hk, g T, T]
    if out is not None:
        oh = _split(out, n_heads, head_dim).reshape(stacked)
        row = np.einsum("...td,...td->...t", do, oh)[..., None]
    else:
        row = np.einsum("...ts,...ts->...t", dp, p)[..., None]
    if softmax_backward is not None:
        softmax_backward(dp.reshape(-1, n_t, n_t), p.reshape(-1, n_t, n_t), row.reshape(-1, n_t, 1))
    else:
        dp -= row
        dp *= p  # dS / scale; masked entries have P == 0
    dq_h = np.matmul(dp, kh)  # [B, Hk, g T, d]
    dq_h *= scale
    dk_h = np.matmul(dp.swapaxes(-1, -2), qh)  # [B, Hk, T, d]: the sum over the g heads
    dk_h *= scale
    dq[...] = dq_h.reshape(n_b, n_heads, n_t, head_dim).transpose(0, 2, 1, 3).reshape(dq.shape)
    dk[...] = dk_h.transpose(0, 2, 1, 3).reshape(dk.shape)
    dv[...] = dv_h.transpose(0, 2, 1, 3).reshape(dv.shape)


@register_op("AttentionOp", DeviceType.CPU, precisions=CPU_PRECISIONS)
class CpuAttentionOp(FusedCpuOp):
    """NumPy causal GQA attention (see :func:`attention_forward` / :func:`attention_backward`);
    the softmax and its backward run as fused Numba kernels when they are available (for
    16-bit storage too, which computes in float32)."""

    def fuses(self, dtype: Any) -> bool:
        """Whether calls on arrays of ``dtype`` run the fused kernels (those of its compute
        dtype: float32 for FP16 and BF16)."""
        return super().fuses(_fused_attention.compute_dtype(dtype))

    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        n_heads: int,
        n_kv_heads: int,
        scale: float,
        out: Any,
        *args: Any,
        **kwargs: Any,
    ) -> np.ndarray:
        """See :func:`attention_forward` (16-bit storage: a float32 ``probs`` buffer)."""
        head = (n_heads, n_kv_heads, scale)
        if self.fuses(q.dtype):
            probs = _decode(q, k, v, *head, out, *args, **kwargs)
            if probs is not None:
                return probs
            kwargs.setdefault("softmax", _fused_attention.causal_softmax)
        if not is_reduced(q.dtype):
            return attention_forward(q, k, v, *head, out, *args, **kwargs)
        result = wide_like(out)
        probs = attention_forward(wide(q), wide(k), wide(v), *head, result, *args, **kwargs)
        store(out, result)
        return probs

    def prefill(
        self,
        q: Any,
        k: Any,
        v: Any,
        n_heads: int,
        n_kv_heads: int,
        scale: float,
        out: Any,
        q_offset: int = 0,
    ) -> None:
        """Causal attention of a prefill chunk against the cached keys into ``out``, keeping no
        probabilities (:func:`attention_prefill`; a chunk of one block is :meth:`forward`)."""
        if q.shape[1] <= PREFILL_BLOCK:
            self.forward(q, k, v, n_heads, n_kv_heads, scale, out=out, q_offset=q_offset)
            return
        softmax = _fused_attention.causal_softmax if self.fuses(q.dtype) else None
        result = wide_like(out)
        attention_prefill(
            wide(q), wide(k), wide(v), n_heads, n_kv_heads, scale, result, q_offset, softmax
        )
        store(out, result)

    def bind_cache_write(
        self, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any, positions: DecodePositions
    ) -> Callable[[], None]:
        """Write the new token's keys and values ``[B, Hk*d]`` to row ``positions.each[b]`` of
        sequence ``b`` of the caches ``[B, T_max, Hk*d]``, as a callable of no arguments (a
        decode plan; see :func:`~mila_py.ops.operation.bind_cache_write`)."""
        return bind_cache_write(np, k_new, v_new, k_cache, v_cache, positions)

    def bind_decode(
        self,
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        n_heads: int,
        n_kv_heads: int,
        scale: float,
        out: np.ndarray,
        positions: DecodePositions,
        scratch: np.ndarray | None = None,
    ) -> Callable[[], None]:
        """Decode attention of ``q [B, 1, Hq*d]``, sequence ``b`` over its cached keys
        ``0 .. positions.each[b]`` (read at each call), into ``out``, as a callable of no
        arguments (a decode plan).

        ``k_cache``, ``v_cache``: ``[B, T_max, Hk*d]``. The fused kernel runs once per
        sequence on bound rows, with the probabilities in ``scratch`` (1-D, ``>= Hq * T_max``
        elements of the compute dtype, float32 for 16-bit storage, which plans that run one
        after another may share; allocated here when None); otherwise :meth:`forward`.
        """
        n_b, n_tk = q.shape[0], k_cache.shape[1]
        each = positions.each
        dense = all(_dense_rows(a) for a in (k_cache, v_cache, out))
        if self.fuses(q.dtype) and dense:
            compute = _fused_attention.compute_dtype(q.dtype)
            s = compute.type(scale)
            if scratch is None:
                scratch = np.empty(n_heads * n_tk, dtype=compute)
            if scratch.dtype != compute or scratch.size < n_heads * n_tk:
                raise ValueError(
                    f"decode scratch must hold {n_heads * n_tk} {compute} values, got "
                    f"{scratch.size} {scratch.dtype}"
                )
            scores = scratch.reshape(-1)
            n_heads, n_kv_heads = int(n_heads), int(n_kv_heads)  # NumPy ints too
            d, g = q.shape[2] // n_heads, n_heads // n_kv_heads
            fmt = storage(q.dtype)
            qb, kb, vb, ob = bits(q), bits(k_cache), bits(v_cache), bits(out)
            rows = [(b, qb[b, 0], kb[b], vb[b], ob[b, 0]) for b in range(n_b)]
            if not rows:  # an empty batch: nothing to attend
                return lambda: None
            # every call's probabilities are a [Hq, n] view of the scratch: one array type
            kernel = _fused_attention.decode_kernel(
                *rows[0][1:4], n_heads, n_kv_heads, rows[0][4],
                scores[:n_heads].reshape(n_heads, 1), q.dtype,
            )  # fmt: skip

            def attend() -> None:
                for b, qr, kr, vr, orow in rows:
                    n = int(each[b]) + 1
                    probs = scores[: n_heads * n].reshape(n_heads, n)
                    kernel(qr, kr, vr, n, n_heads, n_kv_heads, s, orow, probs, d, g, fmt)

            return attend

        return bind_attention_decode(
            self.forward, q, k_cache, v_cache, n_heads, n_kv_heads, scale, out, positions
        )

    def backward(
        self,
        dout: Any,
        q: Any,
        k: Any,
        v: Any,
        probs: Any,
        n_heads: int,
        n_kv_heads: int,
        scale: float,
        dq: Any,
        dk: Any,
        dv: Any,
        out: Any = None,
        **kwargs: Any,
    ) -> None:
        """See :func:`attention_backward` (16-bit storage: float32 ``probs``; ``dq``, ``dk``,
        ``dv`` rounded once)."""
        if self.fuses(dout.dtype):
            kwargs.setdefault("softmax_backward", _fused_attention.softmax_backward_rows)
        head = (n_heads, n_kv_heads, scale)
        if not is_reduced(dout.dtype):
            attention_backward(dout, q, k, v, probs, *head, dq, dk, dv, out, **kwargs)
            return
        dq32, dk32, dv32 = (np.empty(a.shape, np.float32) for a in (dq, dk, dv))
        attention_backward(
            wide(dout), wide(q), wide(k), wide(v), probs, *head, dq32, dk32, dv32, wide(out),
            **kwargs,
        )  # fmt: skip
        for target, grad in zip((dq, dk, dv), (dq32, dk32, dv32), strict=True):
            store(target, grad)


def _decode(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    n_heads: int,
    n_kv_heads: int,
    scale: float,
    out: np.ndarray,
    *positional: Any,
    **options: Any,
) -> np.ndarray | None:
    """One query token per sequence through the fused decode kernel, or None where it does not
    apply (several queries, an explicit bias or softmax, a probabilities buffer, non-dense rows).

    Takes the arguments of :func:`attention_forward`."""
    if positional or q.shape[1] != 1:  # options given by position: the general path reads them
        return None
    if any(options.get(name) is not None for name in ("bias", "probs", "softmax")):
        return None
    if not (_dense_rows(k) and _dense_rows(v) and _dense_rows(out)):
        return None
    n_tk = k.shape[1]
    visible = options.get("visible")
    if visible is None:
        seen = min(options.get("q_offset", 0) + 1, n_tk) if options.get("causal", True) else n_tk
        visible = [seen] * q.shape[0]
    return _fused_attention.decode_attention(q, k, v, visible, n_heads, n_kv_heads, scale, out)


def _dense_rows(x: np.ndarray) -> bool:
    """Whether every ``x[b]`` of ``x [B, T, C]`` is C-contiguous (the batch stride is free)."""
    item = x.itemsize
    return x.strides[2] == item and (x.shape[1] <= 1 or x.strides[1] == x.shape[2] * item)
