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
component's buffer. The host-side functions take the array module and the two kernels as
arguments (:func:`attention_forward`, :func:`attention_backward`), so the CPU test suite runs
this exact orchestration with NumPy and reference kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices import DeviceType
from mila_py.ops.cpu.attention import _visible_bias, values_product
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import (
    DecodePositions,
    Operation,
    bind_attention_decode,
    bind_cache_write,
)
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["ATTENTION_CUDA_SOURCE", "CudaAttentionOp", "attention_backward", "attention_forward"]

ATTENTION_CUDA_SOURCE = r"""
// scores [n_rows, n_tk] C-contiguous, replaced by their softmax. Row r is query t = r % n_tq;
// with causal != 0 it sees keys s <= q_offset + t (the others get probability 0), else all keys
// (an additive bias with -inf entries was applied before). One block per row (grid-stride).
extern "C" __global__ void attention_softmax(
    float* __restrict__ scores, long long n_rows, int n_tq, int n_tk, long long q_offset,
    int causal)
{
    __shared__ float scratch[32];
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        float* s = scores + row * n_tk;
        const long long t = row % n_tq;
        long long visible = n_tk;
        if (causal && q_offset + t + 1 < visible) {
            visible = q_offset + t + 1;
        }
        const float sum = mila_block_exp_sum(s, visible, scratch);
        for (long long i = threadIdx.x; i < n_tk; i += blockDim.x) {
            s[i] = i < visible ? __fdiv_rn(s[i], sum) : 0.0f;
        }
    }
}

// Decode: one new query per sequence over its cached keys and values. q [B, 1, Hq*d] (rows at
// stride q_sb: a view of the QKV buffer), k_cache and v_cache [B, t_max, Hk*d] and out
// [B, 1, Hq*d] C-contiguous. Sequence b sees keys 0 .. len_b - 1, len_b = positions[b] + 1
// when positions is not NULL, else n. One block of 256 threads per (query head, sequence):
// - scores: a warp per key, lanes over the channels, kept in dynamic shared memory ([n]
//   floats, n >= every len_b); the loop runs the same trip count in every warp (shuffles
//   need whole warps);
// - the block's softmax over them;
// - the weighted sum of the values: the threads as groups of `cols` channels, each group
//   summing p_j v_j over every groups-th key, the groups' sums added through shared memory.
// positions: int64 in device memory (null: every sequence sees n keys), or by value
// (mila_positions<N>, attention_decode_at); scratch [32] and partial [blockDim.x] are the
// kernel's static shared arrays.
template <typename P>
__device__ __forceinline__ void attention_decode_body(
    const float* __restrict__ q, const float* __restrict__ k_cache,
    const float* __restrict__ v_cache, float* __restrict__ out,
    const P& positions, int n, long long q_sb, int t_max, int n_heads,
    int n_kv_heads, int head_dim, float scale, float* scratch, float* partial)
{
    extern __shared__ float scores[];
    const int h = blockIdx.x;
    const long long b = blockIdx.y;
    const int kv_head = h / (n_heads / n_kv_heads);
    const int len = has_positions(positions) ? (int)position_of(positions, b) + 1 : n;
    const long long kv_width = (long long)n_kv_heads * head_dim;
    const float* qh = q + b * q_sb + (long long)h * head_dim;
    const float* kb = k_cache + b * t_max * kv_width + (long long)kv_head * head_dim;
    const float* vb = v_cache + b * t_max * kv_width + (long long)kv_head * head_dim;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    for (int first = 0; first < len; first += n_warps) {
        const int j = first + warp;
        float dot = 0.0f;
        if (j < len) {
            const float* kj = kb + (long long)j * kv_width;
            for (int c = lane; c < head_dim; c += 32) {
                dot = fmaf(__fmul_rn(qh[c], scale), kj[c], dot);
            }
        }
        dot = mila_warp_sum(dot);
        if (j < len && lane == 0) {
            scores[j] = dot;
        }
    }
    __syncthreads();
    const float sum = mila_block_exp_sum(scores, len, scratch);  // p_j = scores[j] / sum
    const int cols = head_dim < (int)blockDim.x ? head_dim : (int)blockDim.x;
    const int groups = blockDim.x / cols;
    const int group = threadIdx.x / cols;
    const int col = threadIdx.x - group * cols;
    float* oh = out + b * (long long)n_heads * head_dim + (long long)h * head_dim;
    for (int base = 0; base < head_dim; base += cols) {  // the same trip count in every thread
        const int c = base + col;
        const bool active = group < groups && c < head_dim;
        float acc = 0.0f;
        if (active) {
            for (int j = group; j < len; j += groups) {
                acc = fmaf(scores[j], vb[(long long)j * kv_width + c], acc);
            }
        }
        __syncthreads();  // the previous pass has read partial
        if (active) {
            partial[threadIdx.x] = acc;
        }
        __syncthreads();
        if (active && group == 0) {
            float total = acc;
            for (int other = 1; other < groups; ++other) {
                total = __fadd_rn(total, partial[other * cols + col]);
            }
            oh[c] = __fdiv_rn(total, sum);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) attention_decode(
    const float* __restrict__ q MILA_STRIDED, const float* __restrict__ k_cache,
    const float* __restrict__ v_cache, float* __restrict__ out,
    const long long* __restrict__ positions, int n, long long q_sb, int t_max, int n_heads,
    int n_kv_heads, int head_dim, float scale)
{
    __shared__ float scratch[32];
    __shared__ float partial[256];
    attention_decode_body(q, k_cache, v_cache, out, positions, n, q_sb, t_max, n_heads,
                          n_kv_heads, head_dim, scale, scratch, partial);
}

// attention_decode with the positions by value: int32, the first B of N.
template <int N>
__global__ void __launch_bounds__(256) attention_decode_at(
    const float* __restrict__ q MILA_STRIDED, const float* __restrict__ k_cache,
    const float* __restrict__ v_cache, float* __restrict__ out,
    const mila_positions<N> positions, int n, long long q_sb, int t_max, int n_heads,
    int n_kv_heads, int head_dim, float scale)
{
    __shared__ float scratch[32];
    __shared__ float partial[256];
    attention_decode_body(q, k_cache, v_cache, out, positions, n, q_sb, t_max, n_heads,
                          n_kv_heads, head_dim, scale, scratch, partial);
}

// The new token's keys and values into the caches: k_new, v_new [B, 1, Hk*d] (rows at strides
// k_sb, v_sb: views of the QKV buffer) to row positions[b] (or p when positions is NULL) of
// sequence b of k_cache, v_cache [B, t_max, Hk*d] C-contiguous (grid-stride over B * width).
template <typename P>
__device__ __forceinline__ void kv_cache_write_body(
    const float* __restrict__ k_new, const float* __restrict__ v_new,
    float* __restrict__ k_cache, float* __restrict__ v_cache,
    const P& positions, long long p, long long k_sb, long long v_sb,
    int t_max, int width, int n_b)
{
    const long long total = (long long)n_b * width;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long b = i / width;
        const long long c = i - b * width;
        const long long row = has_positions(positions) ? position_of(positions, b) : p;
        const long long at = (b * t_max + row) * width + c;
        k_cache[at] = k_new[b * k_sb + c];
        v_cache[at] = v_new[b * v_sb + c];
    }
}

extern "C" __global__ void kv_cache_write(
    const float* __restrict__ k_new MILA_STRIDED, const float* __restrict__ v_new MILA_STRIDED,
    float* __restrict__ k_cache, float* __restrict__ v_cache,
    const long long* __restrict__ positions, long long p, long long k_sb, long long v_sb,
    int t_max, int width, int n_b)
{
    kv_cache_write_body(k_new, v_new, k_cache, v_cache, positions, p, k_sb, v_sb, t_max, width,
                        n_b);
}

// kv_cache_write with the positions by value: int32, the first B of N.
template <int N>
__global__ void kv_cache_write_at(
    const float* __restrict__ k_new MILA_STRIDED, const float* __restrict__ v_new MILA_STRIDED,
    float* __restrict__ k_cache, float* __restrict__ v_cache,
    const mila_positions<N> positions, long long p, long long k_sb, long long v_sb,
    int t_max, int width, int n_b)
{
    kv_cache_write_body(k_new, v_new, k_cache, v_cache, positions, p, k_sb, v_sb, t_max, width,
                        n_b);
}

// dp = (dp - row[r]) * p for the n elements of [n / n_cols, n_cols] (grid-stride).
extern "C" __global__ void attention_softmax_backward(
    float* __restrict__ dp, const float* __restrict__ p, const float* __restrict__ row,
    long long n, int n_cols)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dp[i] = __fmul_rn(__fsub_rn(dp[i], row[i / n_cols]), p[i]);
    }
}
"""

#: ``softmax(scores [R, Tk], n_tq, q_offset, causal)``: the in-place masked row softmax
SoftmaxKernel = Callable[[Any, int, int, bool], None]
#: ``softmax_backward(dp [R, Tk], probs [R, Tk], row [R])``: ``dp = (dp - row) * probs`` in place
SoftmaxBackwardKernel = Callable[[Any, Any, Any], None]


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


def _by_value_names() -> tuple[str, ...]:
    """The template instantiations of the by-value positions kernels (one module, compiled on
    the first ragged decode step that takes them)."""
    return tuple(
        f"{kernel}<{cap}>"
        for kernel in ("attention_decode_at", "kv_cache_write_at")
        for cap in _kernels.POSITION_CAPACITIES
    )


def _by_value_launch(
    ctx: Any, kernel: str, n_b: int, grid: tuple[int, ...], block: int
) -> tuple[_kernels.ArraySlot, Callable[..., None]] | None:
    """``(slot, launch)`` for ``kernel`` (``attention_decode_at`` or ``kv_cache_write_at``) of the
    capacity that holds ``n_b`` positions: ``slot(each)`` writes a step's positions into the
    by-value struct and returns its argument; ``launch(args, shared=0)`` launches, bound at its
    first call (when the by-value kernels' module is compiled). None where ``n_b`` is past every
    :data:`~._kernels.POSITION_CAPACITIES`."""
    cap = _kernels.capacity_for(n_b)
    if cap is None:
        return None
    name = f"{kernel}<{cap}>"
    launch = _kernels.bind_on_first_call(
        lambda *_: _kernels.bind_launch(
            ctx, ATTENTION_CUDA_SOURCE, name, grid, block, name_expressions=_by_value_names()
        )
    )
    return _kernels.ArraySlot(ctx.xp, np.int32, cap), launch


@register_op("AttentionOp", DeviceType.CUDA, precisions=(Precision.FP32,))
class CudaAttentionOp(Operation):
    """cuBLAS + fused-softmax causal GQA attention (same contract as the CPU op)."""

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
                bias = _visible_bias(visible, k.shape[1], q.dtype, ctx.xp)
            return attention_forward(
                q, k, v, n_heads, n_kv_heads, scale, out, probs, q_offset, bias, causal,
                xp=ctx.xp, softmax=self._softmax, visible=visible,
            )  # fmt: skip

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
        callable of no arguments (a decode plan): one ``kv_cache_write`` launch (a ragged
        step's positions passed by value, ``kv_cache_write_at``, where they fit one of
        :data:`~._kernels.POSITION_CAPACITIES`; else the step's device copy of them)."""
        item = k_new.dtype.itemsize
        fits = k_cache.flags.c_contiguous and v_cache.flags.c_contiguous
        if not fits or k_new.strides[1] != item or v_new.strides[1] != item:
            return bind_cache_write(self.context.xp, k_new, v_new, k_cache, v_cache, positions)
        ctx: Any = self.context
        n_b, t_max, width = k_cache.shape
        b = functools.partial(_kernels.bound_scalar, ctx.xp)  # arguments made once
        fixed = (
            b(np.int64(k_new.strides[0] // item)), b(np.int64(v_new.strides[0] // item)),
            b(np.int32(t_max)), b(np.int32(width)), b(np.int32(n_b)),
        )  # fmt: skip
        null, highest = b(_kernels.NULL), _kernels.ScalarSlot(ctx.xp, np.int64)
        grid = _kernels.grid_1d(n_b * width)
        call = _kernels.bind_launch(
            ctx, ATTENTION_CUDA_SOURCE, "kv_cache_write", grid, _kernels.THREADS
        )
        by_value = _by_value_launch(ctx, "kv_cache_write_at", n_b, grid, _kernels.THREADS)

        def write() -> None:
            p = highest(positions.highest)
            if positions.uniform:
                call((k_new, v_new, k_cache, v_cache, null, p, *fixed))
            elif by_value is not None:  # the step's positions in the launch's parameters
                slot, launch = by_value
                launch((k_new, v_new, k_cache, v_cache, slot(positions.each), p, *fixed))
            else:
                pos = positions.on_device(ctx)
                call((k_new, v_new, k_cache, v_cache, pos, p, *fixed))

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
        arguments (a decode plan, run with the context active).

        One ``attention_decode`` launch per step (a block per query head and sequence, the
        scores in shared memory; a ragged step's positions by value, ``attention_decode_at``,
        where they fit) where the caches and ``out`` are C-contiguous and the scores
        of the longest sequence fit the default 48 KiB of shared memory (11,000 keys);
        otherwise, and for other layouts, the GEMM path of :meth:`forward`. ``scratch`` is the
        CPU op's; this op takes none.
        """
        general = bind_attention_decode(
            self.forward, q, k_cache, v_cache, n_heads, n_kv_heads, scale, out, positions
        )
        item = q.dtype.itemsize
        dense = all(a.flags.c_contiguous for a in (k_cache, v_cache, out))
        if not dense or q.shape[1] != 1 or q.strides[2] != item or q.strides[0] % item:
            return general
        if k_cache.shape[0] > 65535:  # the grid's y dimension (sequences) has this limit
            return general
        if k_cache.shape[0] == 0:  # an empty batch: a grid of no blocks is a launch error
            return lambda: None
        ctx: Any = self.context
        n_b, t_max = k_cache.shape[0], k_cache.shape[1]
        head_dim = q.shape[2] // n_heads
        b = functools.partial(_kernels.bound_scalar, ctx.xp)  # arguments made once
        fixed = tuple(b(np.int32(v)) for v in (t_max, n_heads, n_kv_heads, head_dim))
        stride, s, null = b(np.int64(q.strides[0] // item)), b(np.float32(scale)), b(_kernels.NULL)
        grid = (n_heads, n_b)
        call = _kernels.bind_launch(
            ctx, ATTENTION_CUDA_SOURCE, "attention_decode", grid, _DECODE_THREADS
        )
        by_value = _by_value_launch(ctx, "attention_decode_at", n_b, grid, _DECODE_THREADS)
        keys = _kernels.ScalarSlot(ctx.xp, np.int32)

        def attend() -> None:
            n = positions.highest + 1
            if n > _DECODE_MAX_KEYS:
                general()
                return
            if positions.uniform:
                call((q, k_cache, v_cache, out, null, keys(n), stride, *fixed, s), n * 4)
            elif by_value is not None:  # per-sequence lengths from the positions, by value
                slot, launch = by_value
                at = slot(positions.each)
                launch((q, k_cache, v_cache, out, at, keys(n), stride, *fixed, s), n * 4)
            else:  # from the step's positions on the device (one copy per step)
                pos = positions.on_device(ctx)
                call((q, k_cache, v_cache, out, pos, keys(n), stride, *fixed, s), n * 4)

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
        with ctx.activate():
            attention_backward(
                dout, q, k, v, probs, n_heads, n_kv_heads, scale, dq, dk, dv, out,
                xp=ctx.xp, softmax_backward=self._softmax_backward,
            )  # fmt: skip

    def _softmax(self, scores: Any, n_tq: int, q_offset: int, causal: bool) -> None:
        n_rows, n_tk = scores.shape
        if n_rows == 0 or n_tk == 0:
            return
        args = (
            scores, np.int64(n_rows), np.int32(n_tq), np.int32(n_tk), np.int64(q_offset),
            np.int32(causal),
        )  # fmt: skip
        _kernels.launch(
            self.context,
            ATTENTION_CUDA_SOURCE,
            "attention_softmax",
            _kernels.grid_1d(n_rows, 1),
            _kernels.ROW_THREADS,
            args,
        )

    def _softmax_backward(self, dp: Any, p: Any, row: Any) -> None:
        n = int(dp.size)
        if n == 0:
            return
        _kernels.launch(
            self.context,
            ATTENTION_CUDA_SOURCE,
            "attention_softmax_backward",
            _kernels.grid_1d(n),
            _kernels.THREADS,
            (dp, p, row, np.int64(n), np.int32(dp.shape[1])),
        )
