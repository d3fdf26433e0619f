"""CUDA AttentionOp: causal grouped-query attention with cuBLAS batched GEMMs and fused softmaxes.

Same contract and results as :mod:`mila_py.ops.cpu.attention` (``P [B, Hk, g, Tq, Tk]`` kept
for backward, queries at ``q_offset`` into the keys, or an explicit additive ``bias``). The
``g = Hq / Hk`` query heads that share a key/value head are stacked along the rows, so every
product is a strided-batched GEMM over ``B * Hk`` matrices with no broadcast operand::

    forward   S [B, Hk, g*Tq, Tk] = (Q * scale) [B, Hk, g*Tq, d] @ K^T [B, Hk, d, Tk]
              P = causal softmax(S), in place               one block per row (kernel)
              O [B, Hk, g*Tq, d]  = P @ V [B, Hk, Tk, d]
    backward  dV = P^T @ dO                                 (the sum over g is inside the GEMM)
              dP = dO @ V^T;  dS = (dP - rowsum(dO * O)) * P  elementwise kernel, in place
              dQ = dS @ K * scale;  dK = dS^T @ Q * scale

``[B, Hk, g, Tq, Tk]`` and ``[B, Hk, g*Tq, Tk]`` are the same memory, so ``P`` lives in the
component's buffer (float32 for every storage precision). FP16 and BF16 storage runs these
products and softmaxes on float32 copies of Q, K and V (CuPy's batched matmul has no 16-bit
path with float32 accumulation) and rounds each output once; decode's own kernels
(``attention_decode``, ``kv_cache_write``) are templates over the storage type that read the
16-bit KV cache as it is. The host-side functions take the array module and the two kernels as
arguments (:func:`attention_forward`, :func:`attention_backward`), so the CPU test suite runs
this exact orchestration with NumPy and reference kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices import DeviceType
from mila_py.ops.cpu.attention import values_product
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import (
    DecodePositions,
    bind_attention_decode,
    bind_cache_write,
)
from mila_py.ops.registry import register_op

__all__ = ["CudaAttentionOp", "attention_backward", "attention_forward"]

#: ``softmax(scores [R, Tk], n_tq, q_offset, causal)``: the in-place masked row softmax
SoftmaxKernel = Callable[[Any, int, int, bool], None]
#: ``softmax_backward(dp [R, Tk], probs [R, Tk], row [R])``: ``dp = (dp - row) * probs`` in place
SoftmaxBackwardKernel = Callable[[Any, Any, Any], None]


def _visible_bias(visible: Any, n_tk: int, dtype: Any, xp: Any) -> Any:
    """``[B, 1, 1, 1, Tk]``: 0 for the first ``visible[b]`` keys of sequence ``b``, else -inf."""
    seen = xp.arange(n_tk)[None, :] < xp.asarray(visible)[:, None]
    return xp.where(seen, 0.0, -np.inf).astype(dtype)[:, None, None, None, :]


def _heads(x: Any, heads: int, head_dim: int) -> Any:
    """``[B, T, H*d]`` -> ``[B, H, T, d]`` (a view, also of a non-contiguous ``x``)."""
    n_b, n_t = x.shape[0], x.shape[1]
    return x.reshape(n_b, n_t, heads, head_dim).transpose(0, 2, 1, 3)


def _grouped(xp: Any, x: Any, n_kv_heads: int, groups: int, head_dim: int) -> Any:
    """``[B, T, Hq*d]`` -> C-contiguous ``[B, Hk, g*T, d]`` (query heads of a group stacked)."""
    n_b, n_t = x.shape[0], x.shape[1]
    heads = xp.ascontiguousarray(_heads(x, n_kv_heads * groups, head_dim))  # [B, Hq, T, d]
    return heads.reshape(n_b, n_kv_heads, groups * n_t, head_dim)


def _write_heads(out: Any, o: Any, n_heads: int, head_dim: int) -> None:
    """``out [B, T, H*d] = o [B, H, T, d]`` through a view of ``out`` (any row strides)."""
    view = _heads(out, n_heads, head_dim)
    view[...] = o


def attention_forward(
    q: Any,
    k: Any,
    v: Any,
    n_heads: int,
    n_kv_heads: int,
    scale: float,
    out: Any,
    probs: Any = None,
    q_offset: int = 0,
    bias: Any = None,
    causal: bool = True,
    *,
    xp: Any,
    softmax: SoftmaxKernel,
    visible: Any = None,
) -> Any:
    """Causal attention; writes ``out [B, Tq, Hq*d]`` and returns ``P [B, Hk, g, Tq, Tk]``.

    Args:
        q: ``[B, Tq, Hq*d]``; k, v: ``[B, Tk, Hk*d]`` with ``Tk >= q_offset + Tq``.
        probs: optional C-contiguous buffer for P (else allocated).
        q_offset: position of the first query among the keys (ignored with ``bias``).
        bias: additive bias broadcastable to ``[B, Hk, g, Tq, Tk]`` that replaces the causal mask.
        causal: False when every query sees every key given (no mask, no bias).
        xp: the array module of the arrays.
        softmax: the masked row softmax (a kernel on CUDA).
        visible: host ints ``[B]`` of ragged decode (with its ``bias``): the values a sequence
            does not see are left out of its product (as the CPU op).
    """
    n_b, n_tq = q.shape[0], q.shape[1]
    n_tk = k.shape[1]
    head_dim = q.shape[2] // n_heads
    groups = n_heads // n_kv_heads
    rows = groups * n_tq
    shape5 = (n_b, n_kv_heads, groups, n_tq, n_tk)
    # Scaling Q (T*d values) is cheaper than scaling the scores (T*T values); a new array, so
    # q (a view of the caller's QKV buffer) is never modified.
    qs = xp.empty((n_b, n_heads, n_tq, head_dim), dtype=q.dtype)
    xp.multiply(_heads(q, n_heads, head_dim), q.dtype.type(scale), out=qs)
    qs = qs.reshape(n_b, n_kv_heads, rows, head_dim)  # [B, Hk, g*Tq, d]
    kt = _heads(k, n_kv_heads, head_dim).swapaxes(-1, -2)  # [B, Hk, d, Tk]
    if probs is None:
        probs = xp.empty(shape5, dtype=q.dtype)
    scores = probs.reshape(n_b, n_kv_heads, rows, n_tk)  # a view of a C-contiguous probs
    scores = xp.matmul(qs, kt, out=scores)
    if bias is not None:
        scores5 = scores.reshape(shape5)
        scores5 += bias
        # masked scores set, not only added to: NaN + -inf is NaN (as the CPU op does)
        xp.copyto(scores5, -np.inf, where=xp.isneginf(bias))
    softmax(scores.reshape(-1, n_tk), n_tq, q_offset, causal and bias is None)
    o = values_product(scores, v, visible, lambda a: _heads(a, n_kv_heads, head_dim), xp)
    _write_heads(out, o.reshape(n_b, n_heads, n_tq, head_dim), n_heads, head_dim)
    return scores.reshape(shape5)


def attention_backward(
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
    *,
    xp: Any,
    softmax_backward: SoftmaxBackwardKernel,
) -> None:
    """Gradients of :func:`attention_forward` into ``dq [B, T, Hq*d]``, ``dk``, ``dv [B, T, Hk*d]``.

    ``out`` (the forward output) gives ``rowsum(dP * P) = rowsum(dO * O)``, a ``[T, d]`` product
    instead of a pass over the ``[T, T]`` scores.
    """
    n_b, n_t = q.shape[0], q.shape[1]
    head_dim = q.shape[2] // n_heads
    groups = n_heads // n_kv_heads
    rows = groups * n_t
    do = _grouped(xp, dout, n_kv_heads, groups, head_dim)  # [B, Hk, g*T, d]
    p = xp.ascontiguousarray(probs).reshape(n_b, n_kv_heads, rows, n_t)  # [B, Hk, g*T, T]
    kh = _heads(k, n_kv_heads, head_dim)  # [B, Hk, T, d]
    vh = _heads(v, n_kv_heads, head_dim)
    dv_h = xp.matmul(p.swapaxes(-1, -2), do)  # [B, Hk, T, d], summed over the group
    dp = xp.matmul(do, vh.swapaxes(-1, -2))  # [B, Hk, g*T, T]
    if out is not None:
        o = _grouped(xp, out, n_kv_heads, groups, head_dim)
        row = (do * o).sum(axis=-1)  # [B, Hk, g*T]
    else:
        row = (dp * p).sum(axis=-1)
    softmax_backward(dp.reshape(-1, n_t), p.reshape(-1, n_t), xp.ascontiguousarray(row).reshape(-1))
    dq_h = xp.matmul(dp, kh)  # [B, Hk, g*T, d]
    dq_h *= q.dtype.type(scale)
    dk_h = xp.matmul(dp.swapaxes(-1, -2), _grouped(xp, q, n_kv_heads, groups, head_dim))
    dk_h *= q.dtype.type(scale)  # [B, Hk, T, d]
    _write_heads(dq, dq_h.reshape(n_b, n_heads, n_t, head_dim), n_heads, head_dim)
    _write_heads(dk, dk_h, n_kv_heads, head_dim)
    _write_heads(dv, dv_h, n_kv_heads, head_dim)


#: threads of an ``attention_decode`` block (its ``__launch_bounds__``)
_DECODE_THREADS = 256
#: keys whose fp32 scores fit the 48 KiB of shared memory a block gets by default, with room
#: for the kernel's static arrays (1,152 bytes) and some slack
_DECODE_MAX_KEYS = 11_000


@register_op("AttentionOp", DeviceType.CUDA, precisions=_kernels.CUDA_PRECISIONS)
class CudaAttentionOp(_kernels.KernelOp):
    """cuBLAS + fused-softmax causal GQA attention (same contract as the CPU op)."""

    FILE = "attention.cu"
    TEMPLATES = ("attention_decode", "kv_cache_write")

    def _wide(self, x: Any) -> Any:
        """``x`` as float32: itself, or a float32 copy of 16-bit storage."""
        return None if x is None else _kernels.as_dtype(self.context.xp, x, np.float32)

    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        n_heads: int,
        n_kv_heads: int,
        scale: float,
        out: Any,
        probs: Any = None,
        q_offset: int = 0,
        bias: Any = None,
        causal: bool = True,
        visible: Any = None,
    ) -> Any:
        """See :func:`mila_py.ops.cpu.attention.attention_forward`; returns ``P``."""
        ctx: Any = self.context
        with ctx.activate():
            if visible is not None:  # host ints [B]: the -inf bias of the keys not seen
                bias = _visible_bias(visible, k.shape[1], np.float32, ctx.xp)
            result = out if out.dtype == np.float32 else ctx.xp.empty(out.shape, np.float32)
            probs = attention_forward(
                self._wide(q), self._wide(k), self._wide(v), n_heads, n_kv_heads, scale, result,
                probs, q_offset, bias, causal, xp=ctx.xp, softmax=self._softmax,
                visible=visible,
            )  # fmt: skip
            if result is not out:  # rounded once to the storage type
                out[...] = result
            return probs

    def prefill(
        self, q: Any, k: Any, v: Any, heads: int, kv_heads: int, scale: float, out: Any, offset: int
    ) -> None:
        """Causal attention of a prefill chunk against the cached keys into ``out`` (the CPU
        op's contract; here one :meth:`forward`, whose probabilities are dropped)."""
        self.forward(q, k, v, heads, kv_heads, scale, out, q_offset=offset)

    def bind_cache_write(
        self, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any, positions: DecodePositions
    ) -> Callable[[], None]:
        """Write the new token's keys and values ``[B, Hk*d]`` (views of the QKV buffer) to row
        ``positions.each[b]`` of sequence ``b`` of the caches ``[B, T_max, Hk*d]``, as a
        callable of no arguments (a decode plan): one ``kv_cache_write`` launch, which reads
        the rows from the step's device buffer (:attr:`DecodePositions.device`)."""
        item = k_new.dtype.itemsize
        fits = k_cache.flags.c_contiguous and v_cache.flags.c_contiguous
        if (
            not fits
            or k_new.strides[1] != item
            or v_new.strides[1] != item
            or positions.device is None
        ):
            return bind_cache_write(self.context.xp, k_new, v_new, k_cache, v_cache, positions)
        n_b, t_max, width = k_cache.shape
        args = (
            k_new, v_new, k_cache, v_cache, positions.device,
            np.int64(k_new.strides[0] // item), np.int64(v_new.strides[0] // item),
            np.int32(t_max), np.int32(width), np.int32(n_b),
        )  # fmt: skip
        grid = _kernels.grid_1d(n_b * width)

        def write() -> None:
            self._launch("kv_cache_write", grid, _kernels.THREADS, args)

        return write

    def bind_decode(
        self,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        n_heads: int,
        n_kv_heads: int,
        scale: float,
        out: Any,
        positions: DecodePositions,
        scratch: Any = None,
    ) -> Callable[[], None]:
        """Decode attention of ``q [B, 1, Hq*d]`` over ``k_cache``, ``v_cache`` ``[B, T_max,
        Hk*d]`` up to ``positions`` (read at each call) into ``out``, as a callable of no
        arguments (a decode plan).

        One ``attention_decode`` launch per step (a block per query head and sequence, the
        scores in shared memory, each sequence's length read from the step's device buffer,
        :attr:`DecodePositions.device`) where the caches and ``out`` are C-contiguous and the
        scores of ``T_max`` keys fit the default 48 KiB of shared memory (11,000 keys): its
        arguments and shared memory are the same at every step, so a CUDA graph can replay it.
        Otherwise, and for other layouts, the GEMM path of :meth:`forward` (which slices the
        caches by the positions on the host). ``scratch`` is the CPU op's; this op takes none.
        """
        general = bind_attention_decode(
            self.forward, q, k_cache, v_cache, n_heads, n_kv_heads, scale, out, positions
        )
        item = q.dtype.itemsize
        dense = all(a.flags.c_contiguous for a in (k_cache, v_cache, out))
        if not dense or q.shape[1] != 1 or q.strides[2] != item or q.strides[0] % item:
            return general
        if k_cache.shape[0] > 65535 or positions.device is None:  # the grid's y limit (sequences)
            return general
        if k_cache.shape[0] == 0:  # an empty batch: a grid of no blocks is a launch error
            return lambda: None
        n_b, t_max = k_cache.shape[0], k_cache.shape[1]
        if t_max > _DECODE_MAX_KEYS:
            return general
        head_dim = q.shape[2] // n_heads
        args = (
            q, k_cache, v_cache, out, positions.device, np.int64(q.strides[0] // item),
            np.int32(t_max), np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim),
            np.float32(scale),
        )  # fmt: skip
        grid = (n_heads, n_b)

        def attend() -> None:
            self._launch("attention_decode", grid, _DECODE_THREADS, args, shared_mem=t_max * 4)

        return attend

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
    ) -> None:
        """See :func:`mila_py.ops.cpu.attention.attention_backward`."""
        ctx: Any = self.context
        xp = ctx.xp
        with ctx.activate():
            dq32, dk32, dv32 = (
                g if g.dtype == np.float32 else xp.empty(g.shape, np.float32) for g in (dq, dk, dv)
            )
            attention_backward(
                self._wide(dout), self._wide(q), self._wide(k), self._wide(v), probs, n_heads,
                n_kv_heads, scale, dq32, dk32, dv32, self._wide(out), xp=xp,
                softmax_backward=self._softmax_backward,
            )  # fmt: skip
            for target, grad in zip((dq, dk, dv), (dq32, dk32, dv32), strict=True):
                if grad is not target:  # rounded once to the storage type
                    target[...] = grad

    def _softmax(self, scores: Any, n_tq: int, q_offset: int, causal: bool) -> None:
        n_rows, n_tk = scores.shape
        if n_rows == 0 or n_tk == 0:
            return
        args = (
            scores, np.int64(n_rows), np.int32(n_tq), np.int32(n_tk), np.int64(q_offset),
            np.int32(causal),
        )  # fmt: skip
        self._launch(
            "attention_softmax",
            _kernels.grid_1d(n_rows, 1),
            _kernels.ROW_THREADS,
            args,
        )

    def _softmax_backward(self, dp: Any, p: Any, row: Any) -> None:
        n = int(dp.size)
        if n == 0:
            return
        self._launch(
            "attention_softmax_backward",
            _kernels.grid_1d(n),
            _kernels.THREADS,
            (dp, p, row, np.int64(n), np.int32(dp.shape[1])),
        )
