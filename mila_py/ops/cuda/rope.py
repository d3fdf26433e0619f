"""CUDA RopeOp: one kernel launch rotates Q and K together, in place or into gradient buffers.

Kernel layout: one thread block per token; the block first stages the token's cos/sin row in
shared memory (read once, reused by every head of Q and K), then its threads walk the
``(heads of Q + heads of K) x (pair groups)`` items. A pair group is ``VEC`` consecutive pairs,
loaded with one 16-byte access per half where alignment allows (``VEC = 16 / sizeof(T)``), else
one element at a time. Rows may have any stride (Q/K views of a fused QKV buffer); the last axis
must be contiguous. Arithmetic is fp32; storage is float, __half or __nv_bfloat16.

Positions are validated on the host by the Rope component before launch, so a bad position
never reaches the kernel and Q, K stay untouched.

The source is a module-level string compiled lazily with CuPy and cached per device and dtype;
scalars are passed with explicit widths (CuPy's RawKernel turns a Python int into 64 bits).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.components.rope_config import RopeConfig, RopeLayout
from mila_py.components.rope_table import RopeTable, get_rope
from mila_py.devices import DeviceType
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["ROPE_CUDA_SOURCE", "CudaRopeOp"]

ROPE_CUDA_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// VEC elements of T moved as one aligned access when VEC * sizeof(T) == 16.
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };

template <typename T, int VEC, bool INTERLEAVED>
__device__ __forceinline__ void rotate_group(
    const T* __restrict__ x, T* __restrict__ y, int lo, int g, int n,
    const float* __restrict__ c, const float* __restrict__ s, float sign)
{
    if (INTERLEAVED) {
        // VEC consecutive elements = VEC / 2 pairs (2i, 2i + 1), starting at element g * VEC.
        const int e0 = lo + g * VEC;
        Pack<T, VEC> in = *reinterpret_cast<const Pack<T, VEC>*>(x + e0);
        Pack<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; j += 2) {
            const int i = (g * VEC + j) >> 1;
            const float a = to_f32(in.v[j]), b = to_f32(in.v[j + 1]);
            const float si = s[i] * sign;
            out.v[j] = from_f32<T>(a * c[i] - b * si);
            out.v[j + 1] = from_f32<T>(b * c[i] + a * si);
        }
        *reinterpret_cast<Pack<T, VEC>*>(y + e0) = out;
    } else {
        // VEC pairs (i, i + n) for i in [g * VEC, g * VEC + VEC).
        const int i0 = g * VEC;
        Pack<T, VEC> in1 = *reinterpret_cast<const Pack<T, VEC>*>(x + lo + i0);
        Pack<T, VEC> in2 = *reinterpret_cast<const Pack<T, VEC>*>(x + lo + n + i0);
        Pack<T, VEC> out1, out2;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const int i = i0 + j;
            const float a = to_f32(in1.v[j]), b = to_f32(in2.v[j]);
            const float si = s[i] * sign;
            out1.v[j] = from_f32<T>(a * c[i] - b * si);
            out2.v[j] = from_f32<T>(b * c[i] + a * si);
        }
        *reinterpret_cast<Pack<T, VEC>*>(y + lo + i0) = out1;
        *reinterpret_cast<Pack<T, VEC>*>(y + lo + n + i0) = out2;
    }
}

// One block per token (b, t). Strides are in elements; the last axis is contiguous.
template <typename T, int VEC, bool INTERLEAVED>
__global__ void rope_qk(
    const T* __restrict__ q_in, T* q_out, const T* __restrict__ k_in, T* k_out,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table,
    const long long* __restrict__ positions, int use_positions, long long offset,
    int n_t, int n_heads, int n_kv_heads, int head_dim, int n_freq,
    long long q_sb, long long q_st, long long k_sb, long long k_st,
    long long qo_sb, long long qo_st, long long ko_sb, long long ko_st,
    float sign, int copy_rest)
{
    extern __shared__ float row[];  // [2 * n_freq]: cos then sin of this token's position
    const long long token = blockIdx.x;
    const long long b = token / n_t;
    const long long t = token - b * n_t;
    const long long p = use_positions ? positions[token] : offset + t;
    for (int i = threadIdx.x; i < n_freq; i += blockDim.x) {
        row[i] = cos_table[p * n_freq + i];
        row[n_freq + i] = sin_table[p * n_freq + i];
    }
    __syncthreads();
    const float* c = row;
    const float* s = row + n_freq;
    const T* qi = q_in + b * q_sb + t * q_st;
    const T* ki = k_in + b * k_sb + t * k_st;
    T* qo = q_out + b * qo_sb + t * qo_st;
    T* ko = k_out + b * ko_sb + t * ko_st;
    const int groups = INTERLEAVED ? (2 * n_freq) / VEC : n_freq / VEC;
    const int items = (n_heads + n_kv_heads) * groups;
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
        const int h = item / groups;
        const int g = item - h * groups;
        if (h < n_heads) {
            rotate_group<T, VEC, INTERLEAVED>(qi, qo, h * head_dim, g, n_freq, c, s, sign);
        } else {
            rotate_group<T, VEC, INTERLEAVED>(ki, ko, (h - n_heads) * head_dim, g, n_freq, c, s, sign);
        }
    }
    if (copy_rest) {  // out of place: channels past the rotated part pass through
        const int rest = head_dim - 2 * n_freq;
        const int total = (n_heads + n_kv_heads) * rest;
        for (int e = threadIdx.x; e < total; e += blockDim.x) {
            const int h = e / rest;
            const int j = 2 * n_freq + (e - h * rest);
            if (h < n_heads) qo[h * head_dim + j] = qi[h * head_dim + j];
            else ko[(h - n_heads) * head_dim + j] = ki[(h - n_heads) * head_dim + j];
        }
    }
}
"""

_CTYPES = {Precision.FP32: "float", Precision.FP16: "__half", Precision.BF16: "__nv_bfloat16"}
_THREADS = 128
_MODULES: dict[tuple[int, Precision], Any] = {}


def _kernel_names(precision: Precision) -> list[str]:
    ctype = _CTYPES[precision]
    vec = 16 // precision.itemsize
    return [
        f"rope_qk<{ctype}, {v}, {'true' if inter else 'false'}>"
        for v in (vec, 1)
        for inter in (False, True)
    ]


def _module(device_index: int, precision: Precision) -> Any:
    """The compiled module for a device and storage precision (compiled once, lazily)."""
    key = (device_index, precision)
    module = _MODULES.get(key)
    if module is None:
        import cupy

        with cupy.cuda.Device(device_index):
            module = cupy.RawModule(
                code=ROPE_CUDA_SOURCE,
                options=("--std=c++17",),
                name_expressions=_kernel_names(precision),
            )
        _MODULES[key] = module
    return module


@register_op("RopeOp", DeviceType.CUDA, precisions=(Precision.FP32, Precision.FP16, Precision.BF16))
class CudaRopeOp(Operation):
    """CuPy RoPE: a fused Q+K kernel on the execution context's stream."""

    config: RopeConfig

    def __init__(self, context: Any, config: RopeConfig, precision: Precision) -> None:
        super().__init__(context, config, precision)
        self.table: RopeTable | None = None
        self._interleaved = config.layout is RopeLayout.INTERLEAVED
        self._ctype = _CTYPES[precision]
        self._vec = 16 // precision.itemsize

    def build(self, build_context: BuildContext) -> None:
        super().build(build_context)
        self.table = get_rope(self.config, self.context.device_id)

    def state_arrays(self) -> list[Any]:
        return self.table.arrays() if self.table is not None else []

    def prefill(self, q: Any, k: Any, position_offset: int) -> None:
        self.apply(q, k, offset=int(position_offset), seq_len=int(position_offset) + q.shape[1])

    def decode(self, q: Any, k: Any, position: Any) -> None:
        if np.ndim(position) == 0:
            self.prefill(q, k, int(position))
        else:
            positions = np.asarray(position, dtype=np.int64).reshape(-1, 1)
            self.apply(q, k, positions=positions, seq_len=int(positions.max()) + 1)

    def _vec_for(self, arrays: tuple[Any, ...], n_freq: int) -> int:
        """The widest vector width every array, stride and head offset allows."""
        vec = self._vec
        item = self.precision.itemsize
        span = 2 * n_freq if self._interleaved else n_freq
        ok = span % vec == 0 and self.config.head_dim % vec == 0
        for a in arrays:
            ok = ok and a.data.ptr % 16 == 0
            ok = ok and all((st // item) % vec == 0 for st in a.strides[:2])
        return vec if ok else 1

    def apply(
        self,
        q: Any,
        k: Any,
        *,
        offset: int = 0,
        positions: np.ndarray | None = None,
        seq_len: int,
        inverse: bool = False,
        q_out: Any = None,
        k_out: Any = None,
    ) -> None:
        """Same contract as :meth:`mila_py.ops.cpu.rope.CpuRopeOp.apply`, on CuPy arrays."""
        import cupy

        assert self.table is not None, "CudaRopeOp used before build"
        ctx = self.context
        q_out = q if q_out is None else q_out
        k_out = k if k_out is None else k_out
        for a in (q, k, q_out, k_out):
            if a.strides[2] != self.precision.itemsize:
                raise ValueError("CUDA RoPE needs the last axis of Q and K contiguous")
        n_b, n_t = q.shape[0], q.shape[1]
        tables = self.table.tables_for(seq_len)
        with ctx.activate():  # type: ignore[attr-defined]
            if tables is None:
                host_pos = (
                    np.arange(offset, offset + n_t)
                    if positions is None
                    else np.broadcast_to(positions, (n_b, n_t)).reshape(-1)
                )
                cos, sin = (ctx.to_device(a) for a in self.table.rows(host_pos, seq_len))
                if positions is None:
                    offset = 0
                else:
                    positions = np.arange(n_b * n_t, dtype=np.int64).reshape(n_b, n_t)
            else:
                cos, sin = tables
            use_pos = positions is not None
            if use_pos:
                pos = cupy.asarray(
                    np.ascontiguousarray(np.broadcast_to(positions, (n_b, n_t)), dtype=np.int64)
                )
            else:
                pos = cupy.zeros(1, dtype=cupy.int64)
            n_freq = self.table.n_freq
            vec = self._vec_for((q, k, q_out, k_out), n_freq)
            name = f"rope_qk<{self._ctype}, {vec}, {'true' if self._interleaved else 'false'}>"
            kernel = _module(ctx.device_id.index, self.precision).get_function(name)
            item = self.precision.itemsize
            cfg = self.config
            copy_rest = (q_out is not q or k_out is not k) and 2 * n_freq < cfg.head_dim
            args = (
                q, q_out, k, k_out, cos, sin, pos,
                np.int32(use_pos), np.int64(offset),
                np.int32(n_t), np.int32(cfg.n_heads), np.int32(cfg.n_kv_heads),
                np.int32(cfg.head_dim), np.int32(n_freq),
                *(np.int64(st // item) for st in q.strides[:2]),
                *(np.int64(st // item) for st in k.strides[:2]),
                *(np.int64(st // item) for st in q_out.strides[:2]),
                *(np.int64(st // item) for st in k_out.strides[:2]),
                np.float32(-1.0 if inverse else 1.0), np.int32(copy_rest),
            )  # fmt: skip
            if n_b * n_t:
                kernel(
                    (n_b * n_t,),
                    (_THREADS,),
                    args,
                    shared_mem=2 * n_freq * 4,
                    stream=ctx.stream,  # type: ignore[attr-defined]
                )
