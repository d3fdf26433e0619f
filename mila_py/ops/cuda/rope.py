"""CUDA RopeOp: one kernel launch rotates Q and K together, in place or into gradient buffers.

Kernel layout: one thread block per token; the block first stages the token's cos/sin row in
shared memory (read once, reused by every head of Q and K), then its threads walk the
``(heads of Q + heads of K) x (pair groups)`` items, consecutive threads on consecutive groups of
one head (coalesced). A pair group is read with one access of ``VEC`` elements per half: 16 bytes
where alignment allows, else 8, 4, ... down to single elements (``VEC = 1``). Rows may have any
stride (Q/K views of a fused QKV buffer); the last axis must be contiguous.

Arithmetic is fp32 with the CPU kernels' order of operations (``x1 c - x2 s``, ``x2 c + x1 s``),
written with ``__fmul_rn``/``__fadd_rn`` so that the compiler never contracts it into FMAs: every
vector width gives bit-identical results. 16-bit storage is carried as raw bits and converted
with PTX ``cvt`` (FP16) or integer round-to-nearest-even (BF16), so the source includes no CUDA
header: NVRTC's header discovery differs between CuPy installs, and CuPy's bundled
``cuda_fp16.h`` does not always match a toolkit's ``cuda_bf16.h``.

Positions are validated on the host by the Rope component before launch; the op re-checks
``seq_len`` against the table in O(1), so a bad call never reads past the table and Q, K stay
untouched. Explicit positions (a decode step's, one per sequence) that fit
:data:`~._kernels.POSITION_CAPACITIES` travel in the launch itself, as a by-value int32 struct parameter of
``rope_qk_at`` (the same kernel body), so such a call uploads nothing; more go to device memory.

The source (:data:`ROPE_CUDA_SOURCE`: a template rendered by :func:`rope_source` with the
tuning knobs of :data:`ROPE_TUNING`, which change no result bit) is compiled and launched through
:mod:`._kernels` like the other CUDA ops' (lazily, with CuPy/NVRTC, one module per device and
storage precision holding that precision's instantiations, see :func:`kernel_names`); scalars
are passed with explicit widths (CuPy turns a Python int into 64 bits). The CPU test suite runs
this source in its kernel emulator (``tests/test_rope_cuda_emulated.py``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.components.rope_config import RopeConfig, RopeLayout
from mila_py.components.rope_table import RopeTable, get_rope, mrope_axes
from mila_py.devices import DeviceType
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import DecodePositions, Operation, bind_rope_decode, decode_again
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = [
    "ROPE_CUDA_SOURCE",
    "ROPE_TUNING",
    "TUNING_ENV",
    "CudaRopeOp",
    "RopeKernelTuning",
    "kernel_names",
    "positions_kernel_name",
    "positions_kernel_names",
    "rope_source",
    "tuning_from_env",
    "vector_widths",
]

_ROPE_TEMPLATE = r"""
// 16-bit floats as raw bits: no CUDA header needed.
struct __align__(2) mila_half { unsigned short bits; };
struct __align__(2) mila_bf16 { unsigned short bits; };

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(mila_half v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
__device__ __forceinline__ float to_f32(mila_bf16 v) {
    return __uint_as_float(((unsigned int)v.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ mila_half from_f32<mila_half>(float v) {
    mila_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
    return h;
}
template <> __device__ __forceinline__ mila_bf16 from_f32<mila_bf16>(float v) {
    // round to nearest even, as ml_dtypes and PyTorch do; NaN stays a (quiet) NaN
    unsigned int u = __float_as_uint(v);
    mila_bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x0040u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = (unsigned short)(u >> 16);
    }
    return r;
}

// The rotation of one pair, in the CPU kernels' order; _rn intrinsics are never fused into FMAs.
__device__ __forceinline__ void rotate_pair(
    float a, float b, float c, float s, float& x, float& y)
{
    x = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    y = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// VEC elements of T moved as one aligned access of VEC * sizeof(T) bytes.
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };

// A pack's load and store. With MILA_ROPE_STREAMING, 16-byte packs carry the streaming cache
// hints (evict first: each byte of Q and K is touched once); else plain accesses.
template <typename P> __device__ __forceinline__ P load_pack(const P* p) {
#if MILA_ROPE_STREAMING
    if constexpr (sizeof(P) == 16) {
        const int4 v = __ldcs(reinterpret_cast<const int4*>(p));
        return *reinterpret_cast<const P*>(&v);
    }
#endif
    return *p;
}
template <typename P> __device__ __forceinline__ void store_pack(P* p, const P& v) {
#if MILA_ROPE_STREAMING
    if constexpr (sizeof(P) == 16) {
        __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
        return;
    }
#endif
    *p = v;
}

// Group g of one head starting at element lo, held in registers between its load and its
// store. Layout "half": VEC pairs (i, i + n) for i in [g * VEC, g * VEC + VEC), a the lower
// and b the upper elements. Layout "interleaved": VEC / 2 pairs (2i, 2i + 1) in the VEC
// elements of a from g * VEC; with VEC == 1, one pair (2g, 2g + 1): a and b one element each.
template <typename T, int VEC, bool INTERLEAVED> struct Group {
    Pack<T, VEC> a, b;

    __device__ __forceinline__ void load(const T* x, int lo, int g, int n) {
        if constexpr (INTERLEAVED && VEC == 1) {
            a.v[0] = x[lo + 2 * g];
            b.v[0] = x[lo + 2 * g + 1];
        } else if constexpr (INTERLEAVED) {
            const int e0 = lo + g * VEC;
            a = load_pack(reinterpret_cast<const Pack<T, VEC>*>(x + e0));
        } else {
            a = load_pack(reinterpret_cast<const Pack<T, VEC>*>(x + lo + g * VEC));
            b = load_pack(reinterpret_cast<const Pack<T, VEC>*>(x + lo + n + g * VEC));
        }
    }

    // the rotated group written to y (c, s: this token's cos and sin by frequency)
    __device__ __forceinline__ void rotate_store(
        T* y, int lo, int g, int n, const float* c, const float* s, float sign) const
    {
        if constexpr (INTERLEAVED && VEC == 1) {
            float u, w;
            rotate_pair(to_f32(a.v[0]), to_f32(b.v[0]), c[g], __fmul_rn(s[g], sign), u, w);
            y[lo + 2 * g] = from_f32<T>(u);
            y[lo + 2 * g + 1] = from_f32<T>(w);
        } else if constexpr (INTERLEAVED) {
            Pack<T, VEC> out;
#pragma unroll
            for (int j = 0; j < VEC; j += 2) {
                const int i = (g * VEC + j) >> 1;
                float u, w;
                rotate_pair(to_f32(a.v[j]), to_f32(a.v[j + 1]), c[i], __fmul_rn(s[i], sign), u, w);
                out.v[j] = from_f32<T>(u);
                out.v[j + 1] = from_f32<T>(w);
            }
            const int e0 = lo + g * VEC;
            store_pack(reinterpret_cast<Pack<T, VEC>*>(y + e0), out);
        } else {
            Pack<T, VEC> out1, out2;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const int i = g * VEC + j;
                float u, w;
                rotate_pair(to_f32(a.v[j]), to_f32(b.v[j]), c[i], __fmul_rn(s[i], sign), u, w);
                out1.v[j] = from_f32<T>(u);
                out2.v[j] = from_f32<T>(w);
            }
            store_pack(reinterpret_cast<Pack<T, VEC>*>(y + lo + g * VEC), out1);
            store_pack(reinterpret_cast<Pack<T, VEC>*>(y + lo + n + g * VEC), out2);
        }
    }
};

// The position axis of frequency i under M-RoPE: contiguous sections (mode 1: [0, a) temporal,
// [a, b) height, the rest width) or interleaved (mode 2, Qwen3-VL: i % 3 == 1 below a height,
// i % 3 == 2 below b width, the rest temporal).
__device__ __forceinline__ int mrope_axis(int i, int mode, int a, int b) {
    if (mode == 1) return i < a ? 0 : (i < b ? 1 : 2);
    const int r = i % 3;
    return (r == 1 && i < a) ? 1 : ((r == 2 && i < b) ? 2 : 0);
}

// One block per token (b, t). Strides are in elements; the last axis is contiguous. In place,
// x_in and x_out are the same array (so neither is __restrict__). With use_positions, the
// token's position is positions[token] ([B * T]), else offset + t; with mrope != 0, positions
// are [3, B * T] (one row per axis) and each frequency's cos/sin come from its axis' position.
template <typename T, int VEC, bool INTERLEAVED, typename P>
__device__ __forceinline__ void rope_qk_body(
    const T* q_in, T* q_out, const T* k_in, T* k_out,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table,
    const P& positions, int use_positions, long long offset,
    int n_t, int n_heads, int n_kv_heads, int head_dim, int n_freq,
    long long q_sb, long long q_st, long long k_sb, long long k_st,
    long long qo_sb, long long qo_st, long long ko_sb, long long ko_st,
    float sign, int copy_rest, int mrope, int mrope_a, int mrope_b)
{
    extern __shared__ float row[];  // [2 * n_freq]: cos then sin of this token's position
    const long long token = blockIdx.x;
    const long long b = token / n_t;
    const long long t = token - b * n_t;
    const long long p = use_positions ? position_of(positions, token) : offset + t;
    for (int i = threadIdx.x; i < n_freq; i += blockDim.x) {
        const long long pi = mrope
            ? position_of(positions,
                          mrope_axis(i, mrope, mrope_a, mrope_b) * (long long)gridDim.x + token)
            : p;
        row[i] = cos_table[pi * n_freq + i];
        row[n_freq + i] = sin_table[pi * n_freq + i];
    }
    if constexpr (MILA_ROPE_BATCH == 1 && !MILA_ROPE_EARLY) {
        __syncthreads();  // the row is staged
    }
    const float* c = row;
    const float* s = row + n_freq;
    const T* qi = q_in + b * q_sb + t * q_st;
    const T* ki = k_in + b * k_sb + t * k_st;
    T* qo = q_out + b * qo_sb + t * qo_st;
    T* ko = k_out + b * ko_sb + t * ko_st;
    const int groups = INTERLEAVED ? (VEC == 1 ? n_freq : (2 * n_freq) / VEC) : n_freq / VEC;
    const int items = (n_heads + n_kv_heads) * groups;
    if constexpr (MILA_ROPE_BATCH == 1 && !MILA_ROPE_EARLY) {
        for (int item = threadIdx.x; item < items; item += blockDim.x) {
            const int h = item / groups;
            const int g = item - h * groups;
            Group<T, VEC, INTERLEAVED> held;
            if (h < n_heads) {
                held.load(qi, h * head_dim, g, n_freq);
                held.rotate_store(qo, h * head_dim, g, n_freq, c, s, sign);
            } else {
                const int lo = (h - n_heads) * head_dim;
                held.load(ki, lo, g, n_freq);
                held.rotate_store(ko, lo, g, n_freq, c, s, sign);
            }
        }
    } else {
        // A thread's items go MILA_ROPE_BATCH at a time: all their loads, then all their stores
        // (in place, a store could alias a later load as far as the compiler knows, so one item
        // at a time keeps one item's loads in flight). With MILA_ROPE_EARLY the first batch's
        // loads, which need no cos/sin, are issued before the barrier that publishes the row.
        Group<T, VEC, INTERLEAVED> held[MILA_ROPE_BATCH];
        // Each item of the batch starting at `first`: its group's loads, or (store) its rotation
        // and stores. No generic lambda: NVRTC before 13.5 takes one for a host function unless
        // CuPy's --device-as-default-execution-space is given, and `store` folds when inlined.
        const auto each_item = [&](int first, bool store) {
#pragma unroll
            for (int u = 0; u < MILA_ROPE_BATCH; ++u) {
                const int item = first + u * (int)blockDim.x;
                if (item < items) {
                    const int h = item / groups;
                    const bool is_q = h < n_heads;
                    const int lo = (is_q ? h : h - n_heads) * head_dim;
                    if (store) {
                        held[u].rotate_store(is_q ? qo : ko, lo, item - h * groups, n_freq, c, s,
                                             sign);
                    } else {
                        held[u].load(is_q ? qi : ki, lo, item - h * groups, n_freq);
                    }
                }
            }
        };
        const auto load_batch = [&](int first) { each_item(first, false); };
        const auto store_batch = [&](int first) { each_item(first, true); };
        const int step = MILA_ROPE_BATCH * (int)blockDim.x;
        int first = threadIdx.x;
        if constexpr (MILA_ROPE_EARLY) {  // the first batch peeled off the loop
            load_batch(first);
            __syncthreads();  // the row is staged
            store_batch(first);
            first += step;
        } else {
            __syncthreads();  // the row is staged
        }
        for (; first < items; first += step) {
            load_batch(first);
            store_batch(first);
        }
    }
    if (copy_rest) {  // out of place: channels past the rotated part pass through
        const int rest = head_dim - 2 * n_freq;
        const int total = (n_heads + n_kv_heads) * rest;
        for (int e = threadIdx.x; e < total; e += blockDim.x) {
            const int h = e / rest;
            const int j = 2 * n_freq + (e - h * rest);
            if (h < n_heads) {
                qo[h * head_dim + j] = qi[h * head_dim + j];
            } else {
                ko[(h - n_heads) * head_dim + j] = ki[(h - n_heads) * head_dim + j];
            }
        }
    }
}

"""


# The two kernels, which differ in their positions parameter alone (written once here: NVRTC's
# name expressions and the test emulator need each kernel's signature spelled out in the source).
_ROPE_KERNEL = r"""
// {what}
template <typename T, int VEC, bool INTERLEAVED{template}>
__global__ void __launch_bounds__(MILA_ROPE_THREADS) {name}(
    MILA_STRIDED const T* q_in, MILA_STRIDED T* q_out,
    MILA_STRIDED const T* k_in, MILA_STRIDED T* k_out,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table,
    {positions} positions, int use_positions, long long offset,
    int n_t, int n_heads, int n_kv_heads, int head_dim, int n_freq,
    long long q_sb, long long q_st, long long k_sb, long long k_st,
    long long qo_sb, long long qo_st, long long ko_sb, long long ko_st,
    float sign, int copy_rest, int mrope, int mrope_a, int mrope_b)
{{
    rope_qk_body<T, VEC, INTERLEAVED>(
        q_in, q_out, k_in, k_out, cos_table, sin_table, positions, use_positions, offset,
        n_t, n_heads, n_kv_heads, head_dim, n_freq, q_sb, q_st, k_sb, k_st,
        qo_sb, qo_st, ko_sb, ko_st, sign, copy_rest, mrope, mrope_a, mrope_b);
}}
"""
_ROPE_TEMPLATE += _ROPE_KERNEL.format(
    what="The kernel, explicit positions (if any) in device memory: int64 [B * T], or [3, B * T].",
    template="",
    name="rope_qk",
    positions="const long long* __restrict__",
) + _ROPE_KERNEL.format(
    what="The kernel with its explicit positions by value: int32, the first B * T (or 3 * B * T) of N.",
    template=", int N",
    name="rope_qk_at",
    positions="const mila_positions<N>",
)


@dataclass(frozen=True)
class RopeKernelTuning:
    """The RoPE kernel's tuning knobs: none changes a result bit (the tests check each).

    Attributes:
        threads: threads per block (the kernel's ``__launch_bounds__``; a multiple of 32).
        batch: pair groups each thread holds in registers at once: all their loads are issued
            before any store (``MILA_ROPE_BATCH``).
        streaming: 16-byte Q/K accesses carry streaming cache hints, ``__ldcs``/``__stcs``
            (``MILA_ROPE_STREAMING``).
        early: the loads of a thread's first batch are issued before the block's barrier
            (the cos/sin row staged meanwhile), not after it (``MILA_ROPE_EARLY``).
        min_blocks: blocks per multiprocessor the compiler must leave registers for (the
            second ``__launch_bounds__`` argument; 0: none asked, the compiler's choice).

    ``benchmarks/rope_cuda_variants.py`` times the settings against each other on a GPU.
    """

    threads: int = 128
    batch: int = 4
    streaming: bool = True
    early: bool = False
    min_blocks: int = 0

    def __post_init__(self) -> None:
        if (
            self.threads % 32
            or not 32 <= self.threads <= 1024
            or not 1 <= self.batch <= 16  # registers per group held: 8 was the most timed
            or not 0 <= self.min_blocks <= 32
            or self.threads * self.min_blocks > 2048  # a multiprocessor's most threads
        ):
            raise ValueError(f"RoPE kernel tuning out of range: {self}")

    @classmethod
    def parse(cls, spec: str) -> RopeKernelTuning:
        """The tuning a comma-separated ``knob=value`` list names, the rest left at their
        defaults: ``"min_blocks=16,early=1"`` (booleans as 0/1, true/false; ``""``: the defaults).

        Raises:
            ValueError: an unknown knob, a value that is not an integer or boolean, a knob given
                twice, or a setting out of range.
        """
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, int | bool] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            knob, eq, text = (t.strip() for t in part.partition("="))
            if not eq or knob not in kinds or knob in values:
                raise ValueError(
                    f"RoPE kernel tuning {spec!r}: {part!r} is not one new knob=value "
                    f"(knobs: {', '.join(kinds)})"
                )
            if kinds[knob] in (bool, "bool"):
                flag = {"1": True, "true": True, "0": False, "false": False}.get(text.lower())
                if flag is None:
                    raise ValueError(f"RoPE kernel tuning {spec!r}: {knob} takes 0/1 or true/false")
                values[knob] = flag
            else:
                try:
                    values[knob] = int(text)
                except ValueError:
                    raise ValueError(
                        f"RoPE kernel tuning {spec!r}: {knob} takes an integer"
                    ) from None
        return cls(**values)  # type: ignore[arg-type]

    @property
    def spec(self) -> str:
        """Every knob, as :meth:`parse` reads them (all of them: a spec keeps its meaning when
        the defaults change)."""
        return ",".join(f"{f.name}={int(getattr(self, f.name))}" for f in fields(self))


def rope_source(tuning: RopeKernelTuning) -> str:
    """The RoPE kernel source with ``tuning``'s settings compiled in."""
    defines = (
        f"#define MILA_ROPE_BATCH {tuning.batch}\n"
        f"#define MILA_ROPE_STREAMING {int(tuning.streaming)}\n"
        f"#define MILA_ROPE_EARLY {int(tuning.early)}\n"
    )
    bounds = f"{tuning.threads}, {tuning.min_blocks}" if tuning.min_blocks else str(tuning.threads)
    return defines + _ROPE_TEMPLATE.replace("MILA_ROPE_THREADS", bounds)


#: the environment variable that overrides :data:`ROPE_TUNING` (``knob=value,...``), read when
#: this module is imported; a bad value is raised when a :class:`CudaRopeOp` is made, so that it
#: cannot break the op registry's lookups (which import every backend's modules) for CPU users
TUNING_ENV = "MILA_ROPE_TUNING"


def tuning_from_env(environ: Mapping[str, str]) -> RopeKernelTuning:
    """The tuning :data:`TUNING_ENV` names in ``environ`` (the defaults where it is unset).

    Raises:
        ValueError: the variable does not parse (:meth:`RopeKernelTuning.parse`), naming it.
    """
    spec = environ.get(TUNING_ENV, "")
    try:
        return RopeKernelTuning.parse(spec)
    except ValueError as err:
        raise ValueError(f"{TUNING_ENV}={spec!r}: {err}") from None


#: the settings the op compiles and launches with: the defaults, or what ``MILA_ROPE_TUNING``
#: names when this module is imported (``benchmarks/rope_cuda_variants.py`` times settings)
try:
    ROPE_TUNING = tuning_from_env(os.environ)
    _TUNING_ERROR: ValueError | None = None
except ValueError as _err:  # raised when an op is made (see TUNING_ENV)
    ROPE_TUNING, _TUNING_ERROR = RopeKernelTuning(), _err
#: the kernel source the op compiles (:data:`ROPE_TUNING` rendered by :func:`rope_source`)
ROPE_CUDA_SOURCE = rope_source(ROPE_TUNING)

_CTYPES = {Precision.FP32: "float", Precision.FP16: "mila_half", Precision.BF16: "mila_bf16"}
_THREADS = ROPE_TUNING.threads
#: stride patterns (and chunk lengths) whose launch arguments an op keeps made
_ARG_CACHE = 64
#: where :meth:`CudaRopeOp.launch_values` puts the cos and sin tables, the positions, the
#: use_positions flag and the offset (the kernel's parameter order)
_COS, _SIN, _POSITIONS, _USE_POSITIONS, _OFFSET = 4, 5, 6, 7, 8
#: decode steps at one position, or at one per sequence (:meth:`CudaRopeOp.decode_fast_path`,
#: a decode plan's :meth:`CudaRopeOp.bind_decode`) launch by ``cuLaunchKernel`` with their
#: arguments packed once (:meth:`CudaRopeOp.packed_launcher`, :meth:`CudaRopeOp.launcher_each`
#: with ``packed``) rather than by CuPy with bound arguments (:meth:`CudaRopeOp.launcher`); both
#: give the same bits. On since an H100 run (2026-11-26): the GPU tests pass with each, and the
#: packed launch took a B=1 decode call from 6.7-6.9 to 4.5-4.7 us (``benchmarks/rope_cuda.py``,
#: ``benchmarks/cuda_launch_cost.py``); ``pytest --no-packed-decode`` runs the tests with CuPy's.
PACKED_DECODE = True


def vector_widths(precision: Precision) -> tuple[int, ...]:
    """Elements per access the kernels are instantiated for, widest first (16, 8, 4, 2 bytes)."""
    item = precision.itemsize
    return tuple(sorted({max(1, nbytes // item) for nbytes in (16, 8, 4, 2)}, reverse=True))


def kernel_name(precision: Precision, vec: int, interleaved: bool) -> str:
    return f"rope_qk<{_CTYPES[precision]}, {vec}, {'true' if interleaved else 'false'}>"


def kernel_names(precision: Precision) -> list[str]:
    """Every instantiation the launcher can request for ``precision``."""
    return [
        kernel_name(precision, vec, inter)
        for vec in vector_widths(precision)
        for inter in (False, True)
    ]


def positions_kernel_name(precision: Precision, vec: int, interleaved: bool, capacity: int) -> str:
    """The by-value positions kernel (``rope_qk_at``) of ``capacity`` int32 positions."""
    inter = "true" if interleaved else "false"
    return f"rope_qk_at<{_CTYPES[precision]}, {vec}, {inter}, {capacity}>"


def positions_kernel_names(precision: Precision, interleaved: bool) -> list[str]:
    """Every by-value positions instantiation an op of ``precision`` and layout can request:
    one module per precision and layout, compiled on the first call with explicit positions."""
    return [
        positions_kernel_name(precision, vec, interleaved, capacity)
        for vec in vector_widths(precision)
        for capacity in _kernels.POSITION_CAPACITIES
    ]


@register_op("RopeOp", DeviceType.CUDA, precisions=(Precision.FP32, Precision.FP16, Precision.BF16))
class CudaRopeOp(Operation):
    """CuPy RoPE: a fused Q+K kernel on the execution context's stream."""

    config: RopeConfig

    def __init__(self, context: Any, config: RopeConfig, precision: Precision) -> None:
        if _TUNING_ERROR is not None:
            raise ValueError(str(_TUNING_ERROR))
        super().__init__(context, config, precision)
        self.table: RopeTable | None = None
        self._interleaved = config.layout is RopeLayout.INTERLEAVED
        self._widths = vector_widths(precision)
        # every instantiation of this precision (one module), and the one to launch per width
        self._names = tuple(kernel_names(precision))
        self._name_of = {
            vec: kernel_name(precision, vec, self._interleaved) for vec in self._widths
        }
        # the by-value positions kernels (their own module, compiled on first use), per width
        # and capacity, and the argument of each capacity (written per call)
        self._at_names = tuple(positions_kernel_names(precision, self._interleaved))
        self._at_name_of = {
            (vec, cap): positions_kernel_name(precision, vec, self._interleaved, cap)
            for vec in self._widths
            for cap in _kernels.POSITION_CAPACITIES
        }
        self._position_slots: dict[int, _kernels.ArraySlot] = {}
        self._shape_args: tuple[np.int32, ...] = ()
        self._item = precision.itemsize
        # host work per launch, kept small (a B=1 decode is a few microseconds of it): the width
        # each address alignment allows, and the stride arguments of each stride pattern
        self._width_of: dict[int, int] = {}
        # launch arguments made once (bound_scalar: CuPy passes them without converting)
        self._stride_args: dict[tuple[tuple[int, ...], ...], tuple[Any, ...]] = {}
        self._n_t_args: dict[int, Any] = {}
        self._null: Any = _kernels.NULL
        self._flags: tuple[Any, Any] = (np.int32(0), np.int32(1))
        self._signs: tuple[Any, Any] = (np.float32(1.0), np.float32(-1.0))
        self._no_mrope: tuple[Any, ...] = (np.int32(0),) * 3
        self._mrope_args = self._no_mrope  # with an M-RoPE config: for positions [3, B, T]
        self._axes: np.ndarray | None = None

    def build(self, build_context: BuildContext) -> None:
        super().build(build_context)
        self.table = get_rope(self.config, self.context.device_id)
        cfg = self.config
        b = self._bound
        # the kernel's fixed arguments, made once: n_heads, n_kv_heads, head_dim, n_freq
        self._shape_args = tuple(
            b(np.int32(v)) for v in (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, self.table.n_freq)
        )
        self._null = b(_kernels.NULL)
        self._flags = (b(np.int32(0)), b(np.int32(1)))  # use_positions / copy_rest: no, yes
        self._signs = (b(np.float32(1.0)), b(np.float32(-1.0)))  # forward, inverse (backward)
        self._no_mrope = (self._flags[0],) * 3
        self._mrope_args = self._no_mrope
        self._n_t_args.clear()
        self._stride_args.clear()
        self._axes = mrope_axes(cfg, self.table)
        if cfg.mrope_section is not None:  # the kernel's (mode, a, b) of mrope_axis()
            t, h, w = cfg.mrope_section
            mode, lo, hi = (2, 3 * h, 3 * w) if cfg.mrope_interleaved else (1, t, t + h)
            self._mrope_args = (b(np.int32(mode)), b(np.int32(lo)), b(np.int32(hi)))

    def _bound(self, value: np.generic) -> Any:
        return _kernels.bound_scalar(self.context.xp, value)

    def _bound_values(self, values: Any) -> list[Any]:
        """:meth:`launch_values`' layout with its NumPy scalars made launch arguments once."""
        return [self._bound(v) if isinstance(v, np.generic) else v for v in values]

    def _kernel_of(self, vec: int, capacity: int) -> tuple[str, tuple[str, ...]]:
        """The kernel of access width ``vec`` and its module's name expressions: with a
        ``capacity``, the by-value positions kernel of that capacity (``rope_qk_at``)."""
        if capacity:
            return self._at_name_of[vec, capacity], self._at_names
        return self._name_of[vec], self._names

    def state_arrays(self) -> list[Any]:
        return self.table.arrays() if self.table is not None else []

    def prefill(self, q: Any, k: Any, position_offset: int) -> None:
        self.apply(q, k, offset=int(position_offset), seq_len=int(position_offset) + q.shape[1])

    def decode(self, q: Any, k: Any, position: Any) -> None:
        if np.ndim(position) == 0:
            self.prefill(q, k, int(position))
        else:
            positions = np.asarray(position, dtype=np.int64).reshape(-1, 1)
            self.apply(q, k, positions=positions, seq_len=int(positions.max(initial=0)) + 1)

    def bind_decode(self, q: Any, k: Any, positions: DecodePositions) -> Callable[[], None]:
        """:meth:`decode` of ``q``, ``k`` ``[B, 1, width]`` at ``positions`` (read at each call),
        as a callable of no arguments (a decode plan run with the context active; the caller
        checked the positions). Where the table covers the positions, one launch with the
        strides checked here: at the step's position, or (ragged steps) at the positions passed
        in the launch's parameters (at most the largest of :data:`~._kernels.POSITION_CAPACITIES`
        sequences; more: the positions' device copy of the step,
        :meth:`DecodePositions.on_device`, shared with the other layers); the rest goes through
        :meth:`apply`."""
        general = bind_rope_decode(self.apply, q, k, positions)
        table = self.table
        assert table is not None, "CudaRopeOp used before build"
        item = self._item
        if q.shape[1] != 1 or q.shape[0] == 0 or q.strides[2] != item or k.strides[2] != item:
            return general
        ctx = self.context
        # the plan keeps q and k (its own buffers) alive, as a packed launch needs
        at = (PACKED_DECODE and self.packed_launcher(q, k)) or self.launcher(q, k)
        at_each = self.launcher_each(q, k, packed=PACKED_DECODE)
        limit = table.static_len
        each = positions.each.reshape(-1, 1)  # a view: the step's positions, [B, 1]

        def rotate() -> None:
            top = positions.highest
            if top < limit:
                if positions.uniform and at is not None:
                    at(q, k, top)
                    return
                if not positions.uniform and at_each is not None:
                    at_each(q, k, positions.each)
                    return
            tables = table.tables_for(top + 1)
            if tables is None:
                general()
            elif positions.uniform:
                self._launch(q, k, q, k, *tables, None, top, False)
            else:  # in the launch's parameters where they fit, else the step's device copy
                by_value = self._positions_by_value(each, each.shape)
                if by_value is not None:
                    self._launch(q, k, q, k, *tables, by_value[1], 0, False, False, by_value[0])
                else:
                    self._launch(q, k, q, k, *tables, positions.on_device(ctx), 0, False)

        return rotate

    def vector_width(self, *arrays: Any) -> int:
        """The widest access (elements) that every array's base, row strides and the head allow.

        Strides of axes of length 1 are never stepped, so they do not count.

        Raises:
            ValueError: an array whose first element or row strides are not a whole number of
                elements from an aligned address (no access width would be aligned).
        """
        aligned = 16  # the largest power of two (bytes, at most 16) dividing every address
        for a in arrays:
            aligned = math.gcd(aligned, _kernels.address(a))
            if a.shape[0] != 1:
                aligned = math.gcd(aligned, a.strides[0])
            if a.shape[1] != 1:
                aligned = math.gcd(aligned, a.strides[1])
        vec = self._width_of.get(aligned)
        if vec is None:
            vec = self._width_of.setdefault(aligned, self._width_for(aligned, arrays))
        return vec

    def _width_for(self, aligned: int, arrays: tuple[Any, ...]) -> int:
        """The widest access of :data:`vector_widths` that ``aligned`` bytes, the rotated span
        and the head size allow."""
        assert self.table is not None, "CudaRopeOp used before build"
        item = self._item
        if aligned % item:
            raise ValueError(
                f"CUDA RoPE needs Q and K at whole elements of {item} bytes from an aligned "
                f"address, with row strides of whole elements; got strides "
                f"{[a.strides for a in arrays]}"
            )
        n_freq = self.table.n_freq
        span = 2 * n_freq if self._interleaved else n_freq
        for vec in self._widths:
            if vec == 1 or (
                aligned % (vec * item) == 0 and span % vec == 0 and self.config.head_dim % vec == 0
            ):
                return vec
        return 1

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
        """Same contract as :meth:`mila_py.ops.cpu.rope.CpuRopeOp.apply`, on CuPy arrays.

        Raises:
            ValueError: a last axis that is not contiguous, ``seq_len`` past the table, or
                arrays not at whole elements (see :meth:`vector_width`); all checked before
                anything is launched.
        """
        assert self.table is not None, "CudaRopeOp used before build"
        q_out = q if q_out is None else q_out
        k_out = k if k_out is None else k_out
        n_b, n_t = int(q.shape[0]), int(q.shape[1])
        if n_b == 0 or n_t == 0:  # nothing to rotate (empty arrays may carry any strides)
            return
        item = self._item
        for a in (q, k, q_out, k_out):
            if a.strides[2] != item:
                raise ValueError(
                    "CUDA RoPE needs the last axis of Q and K contiguous, got strides "
                    f"{a.strides} for shape {a.shape}"
                )
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"CUDA RoPE: position {seq_len - 1} is beyond the table: positions must be "
                f"< max_seq_len = {self.config.max_seq_len}"
            )
        ctx = self.context
        table = self.table
        tables = table.tables_for(seq_len)
        per_axis = positions is not None and positions.ndim == 3  # M-RoPE positions [3, B, T]
        if tables is not None:
            # a launch that uploads nothing (no explicit positions: forward, prefill, decode at
            # one position; or positions that fit in the launch's parameters) needs only the
            # right current device, not the stream context
            pos, cap = None, 0
            if positions is not None:
                by_value = self._positions_by_value(
                    positions, (3, n_b, n_t) if per_axis else (n_b, n_t)
                )
                if by_value is not None:
                    cap, pos = by_value
            if positions is None or cap:
                args = (q, k, q_out, k_out, *tables, pos, offset, inverse, per_axis, cap)
                if _kernels.device_is_current(ctx):
                    self._launch(*args)
                else:
                    with ctx.activate():
                        self._launch(*args)
                return
        with ctx.activate():
            if tables is None:  # a length-dependent type past its original context: rows per call
                cos_rows, sin_rows, offset, positions = table.call_rows(
                    (n_b, n_t), offset, positions, seq_len, self._axes if per_axis else None
                )
                per_axis = False
                tables = ctx.to_device(cos_rows), ctx.to_device(sin_rows)
            pos = None  # a null pointer: the kernel reads positions only when told to
            if positions is not None:
                shape = (3, n_b, n_t) if per_axis else (n_b, n_t)
                pos = ctx.to_device(
                    np.ascontiguousarray(np.broadcast_to(positions, shape), dtype=np.int64)
                )
            self._launch(q, k, q_out, k_out, *tables, pos, offset, inverse, per_axis)

    def _positions_by_value(self, positions: np.ndarray, shape: tuple[int, ...]) -> Any:
        """``(capacity, argument)``: ``positions`` broadcast to ``shape`` in the by-value
        argument of the smallest capacity of :data:`~._kernels.POSITION_CAPACITIES` that holds them
        (written now, for the next launch); None where none does. The caller checked that
        every position is below the table's length (so it fits in an int32)."""
        cap = _kernels.capacity_for(math.prod(shape))
        if cap is None:
            return None
        if positions.shape != shape:
            positions = np.broadcast_to(positions, shape)
        return cap, self._position_slot(cap)(positions)

    def _position_slot(self, capacity: int) -> _kernels.ArraySlot:
        """The op's by-value positions argument of ``capacity`` (made once, written per call)."""
        slot = self._position_slots.get(capacity)
        if slot is None:
            slot = _kernels.ArraySlot(self.context.xp, np.int32, capacity)
            self._position_slots[capacity] = slot
        return slot

    def _launch(
        self,
        q: Any,
        k: Any,
        q_out: Any,
        k_out: Any,
        cos: Any,
        sin: Any,
        pos: Any,
        offset: int,
        inverse: bool,
        per_axis: bool = False,
        capacity: int = 0,
    ) -> None:
        """One launch on the context's stream: a block per token (``pos``: int64 ``[B, T]``,
        ``[3, B, T]`` when ``per_axis`` (M-RoPE), or None; with a ``capacity``, the by-value
        argument of :meth:`_positions_by_value` holding them, for ``rope_qk_at``)."""
        ctx = self.context
        n_b, n_t = q.shape[0], q.shape[1]
        n_freq = self.table.n_freq  # type: ignore[union-attr]
        in_place = q_out is q and k_out is k
        arrays = (q, k) if in_place else (q, k, q_out, k_out)
        vec = self.vector_width(*arrays)
        copy_rest = not in_place and 2 * n_freq < self.config.head_dim
        flags = self._flags
        args = (
            q, q_out, k, k_out, cos, sin, self._null if pos is None else pos,
            flags[pos is not None], np.int64(offset), self._n_t_arg(n_t),
            *self._shape_args, *self._strides_of(q, k, q_out, k_out),
            self._signs[inverse], flags[copy_rest],
            *(self._mrope_args if per_axis else self._no_mrope),
        )  # fmt: skip
        name, names = self._kernel_of(vec, capacity)
        _kernels.launch(
            ctx,
            ROPE_CUDA_SOURCE,
            name,
            (n_b * n_t,),
            _THREADS,
            args,
            shared_mem=2 * n_freq * 4,
            name_expressions=names,
        )

    def _strides_of(self, q: Any, k: Any, q_out: Any, k_out: Any) -> tuple[Any, ...]:
        """The kernel's eight row-stride arguments (elements), made once per stride pattern."""
        key = (q.strides, k.strides, q_out.strides, k_out.strides)
        strides = self._stride_args.get(key)
        if strides is None:
            item = self._item
            strides = tuple(
                self._bound(np.int64(st // item))
                for a in (q, k, q_out, k_out)
                for st in a.strides[:2]
            )
            if len(self._stride_args) < _ARG_CACHE:  # a model has a handful; odd callers, any
                self._stride_args[key] = strides
        return strides

    def _n_t_arg(self, n_t: int) -> Any:
        arg = self._n_t_args.get(n_t)
        if arg is None:
            arg = self._bound(np.int32(n_t))
            if len(self._n_t_args) < _ARG_CACHE:
                self._n_t_args[n_t] = arg
        return arg

    def launcher(self, q: Any, k: Any) -> Callable[[Any, Any, int], None] | None:
        """``rotate_at(q, k, offset)``: rotate ``q`` ``[B, T, n_heads * head_dim]`` and ``k`` in
        place at positions ``offset .. offset + T - 1``, one launch whose other arguments are
        made here (the kernel, its access width, strides and table; a decode step pays for the
        position's argument alone). It takes the arrays per call, so it keeps none alive.

        The caller passes these very arrays, unchanged in shape and strides (the access width
        follows their addresses), with the context's device current and ``offset + T <=``
        :attr:`RopeTable.static_len`. None where one launch at an offset does not apply: no rows, or a
        last axis that is not contiguous.
        """
        if not self._one_launch_applies(q, k):
            return None
        call = self._bind_one_launch(_kernels.bind_launch, q, k)
        position = _kernels.ScalarSlot(self.context.xp, np.int64)
        # launch_values' layout, its scalars made into launch arguments once
        bound = self._bound_values(self.launch_values(q, k, position))
        # the tables, positions and use_positions as they are; the offset per call
        tables, tail = tuple(bound[_COS:_OFFSET]), tuple(bound[_OFFSET + 1 :])

        def rotate_at(q: Any, k: Any, offset: int) -> None:
            call((q, q, k, k, *tables, position(offset), *tail))

        return rotate_at

    def launcher_each(
        self, q: Any, k: Any, *, packed: bool = False
    ) -> Callable[[Any, Any, np.ndarray], None] | None:
        """``rotate_each(q, k, positions)``: rotate ``q`` ``[B, 1, n_heads * head_dim]`` and
        ``k`` in place at ``positions`` (integers ``[B]``, a position per sequence), one launch of
        the by-value positions kernel whose other arguments are made once (:meth:`launcher`'s,
        with the positions' struct, written per call, in place of the offset). Same contract as
        :meth:`launcher`: these very arrays, the device current, every position below
        :attr:`RopeTable.static_len`; with ``packed``, by ``cuLaunchKernel`` with every argument
        packed once, as :meth:`packed_launcher` (these arrays kept alive, in place). None where
        :meth:`launcher` does not apply, ``T != 1``, or ``B`` is past the largest of
        :data:`~._kernels.POSITION_CAPACITIES`.

        The launch is bound on the first call, so that the by-value kernels' module is compiled
        only once explicit positions come (a loop at int positions never needs it), and a
        failure to compile it raises before anything is launched."""
        if q.shape[1] != 1 or not self._one_launch_applies(q, k):
            return None
        cap = _kernels.capacity_for(int(q.shape[0]))
        if cap is None:
            return None
        # bound with the arrays of the first call (these very ones), none kept by this closure
        return _kernels.bind_on_first_call(lambda q, k, _: self._bind_each(q, k, cap, packed))

    def _bind_each(
        self, q: Any, k: Any, cap: int, packed: bool
    ) -> Callable[[Any, Any, np.ndarray], None]:
        """:meth:`launcher_each`'s launch on ``q``, ``k``, the struct of capacity ``cap``."""
        slot = self._position_slot(cap)
        values = list(self.launch_values(q, k, np.int64(0)))
        # the positions per call, read (use_positions 1) at offset 0
        values[_POSITIONS], values[_USE_POSITIONS] = slot, np.int32(1)
        if packed:
            call = self._bind_one_launch(_kernels.bind_packed_launch, q, k, values, capacity=cap)
            kept = values[_COS : _SIN + 1]  # the op's tables, kept alive with their addresses

            def rotate_packed(
                q: Any, k: Any, positions: np.ndarray, keep: Any = (kept, slot)
            ) -> None:
                slot(positions)  # the struct's cell, which the packed parameters point to
                call()

            return rotate_packed
        call = self._bind_one_launch(_kernels.bind_launch, q, k, capacity=cap)
        bound = self._bound_values(values)
        tables, tail = tuple(bound[_COS:_POSITIONS]), tuple(bound[_POSITIONS + 1 :])

        def rotate_each(q: Any, k: Any, positions: np.ndarray) -> None:
            call((q, q, k, k, *tables, slot(positions), *tail))

        return rotate_each

    def _one_launch_applies(self, q: Any, k: Any) -> bool:
        """:meth:`launcher` applies: rows to rotate, and last axes that are contiguous."""
        assert self.table is not None, "CudaRopeOp used before build"
        item = self._item
        return bool(q.shape[0] and q.shape[1]) and q.strides[2] == item and k.strides[2] == item

    def _bind_one_launch(
        self, bind: Callable[..., Any], q: Any, k: Any, *args: Any, capacity: int = 0
    ) -> Any:
        """``bind`` (:func:`_kernels.bind_launch` or :func:`_kernels.bind_packed_launch`, with
        its ``args``) for the one launch that rotates ``q``, ``k`` in place: a block per token,
        the access width their addresses allow, the cos/sin row in shared memory; with a
        ``capacity``, of the by-value positions kernel of that capacity."""
        assert self.table is not None, "CudaRopeOp used before build"
        vec = self.vector_width(q, k)
        name, names = self._kernel_of(vec, capacity)
        return bind(
            self.context,
            ROPE_CUDA_SOURCE,
            name,
            (int(q.shape[0]) * int(q.shape[1]),),
            _THREADS,
            *args,
            shared_mem=2 * self.table.n_freq * 4,
            name_expressions=names,
        )

    def launch_values(self, q: Any, k: Any, position: Any) -> tuple[Any, ...]:
        """The arguments of :meth:`launcher`'s launch on ``q``, ``k`` as plain values: the
        device arrays, NumPy scalars of the kernel's exact types, and ``position`` (an int64
        :class:`_kernels.ScalarSlot`) for the offset, for :func:`_kernels.pack_params`."""
        table = self.table
        assert table is not None, "CudaRopeOp used before build"
        cfg, item = self.config, self._item
        strides = (np.int64(st // item) for a in (q, k, q, k) for st in a.strides[:2])
        values = (
            q, q, k, k, table.cos, table.sin, _kernels.NULL, np.int32(0), position,
            np.int32(q.shape[1]), np.int32(cfg.n_heads), np.int32(cfg.n_kv_heads),
            np.int32(cfg.head_dim), np.int32(table.n_freq), *strides,
            np.float32(1.0), np.int32(0), np.int32(0), np.int32(0), np.int32(0),
        )  # fmt: skip
        assert values[_COS] is table.cos and values[_SIN] is table.sin  # the layout named above
        assert values[_POSITIONS] is _kernels.NULL and values[_OFFSET] is position
        assert values[_USE_POSITIONS] == 0
        return values

    def packed_launcher(self, q: Any, k: Any) -> Callable[[Any, Any, int], None] | None:
        """:meth:`launcher`'s launch bound to these very arrays: ``rotate_at(q, k, offset)``
        launches by ``cuLaunchKernel`` with every argument packed once
        (:func:`_kernels.bind_packed_launch`), writing ``offset`` alone per call. It takes the
        arrays for :meth:`launcher`'s signature and launches on the ones bound here, by their
        addresses: the caller passes those very arrays, kept alive, in place and unchanged, the
        device current and ``offset + T <=`` :attr:`RopeTable.static_len`. None where
        :meth:`launcher` does not apply. With NumPy (the kernel emulator) each call launches
        the same values through :func:`_kernels.launch`."""
        if not self._one_launch_applies(q, k):
            return None
        position = _kernels.ScalarSlot(self.context.xp, np.int64)
        values = self.launch_values(q, k, position)
        call = self._bind_one_launch(_kernels.bind_packed_launch, q, k, values)
        tables = values[_COS : _SIN + 1]  # the op's own, kept alive with their addresses
        cell = position.c_value()  # the position's parameter, written per call

        def rotate_at(
            q: Any, k: Any, offset: int, keep: tuple[Any, ...] = (*tables, position)
        ) -> None:
            cell.value = offset
            call()

        return rotate_at

    def decode_fast_path(
        self, q: Any, k: Any, *, packed: bool | None = None
    ) -> Callable[[Any, Any, Any], bool] | None:
        """For a component whose ``decode`` is called again and again on the buffers ``q``,
        ``k`` ``[B, 1, width]`` it has checked: ``again(q2, k2, position)`` rotates them at
        ``position`` with one launch and returns True when ``q2`` and ``k2`` are those arrays
        (the same objects, held weakly, with the same shape, strides and dtype), ``position``
        an int below :attr:`RopeTable.static_len` (or, where :meth:`launcher_each` applies, a
        NumPy integer array ``[B]`` of such positions, one per sequence) and the device current;
        else it does nothing and returns False (the caller takes its checked path). None where
        :meth:`launcher` does not apply.

        The launch is :meth:`packed_launcher`'s where ``packed`` (default
        :data:`PACKED_DECODE`), else :meth:`launcher`'s; the identity check above is what
        makes the packed one safe, since it launches on the arrays it was made for."""
        if q.shape[1] != 1:
            return None
        use_packed = PACKED_DECODE if packed is None else packed
        at = (use_packed and self.packed_launcher(q, k)) or self.launcher(q, k)
        if at is None:
            return None
        assert self.table is not None  # launcher() checked it
        xp = self.context.xp
        device = self.context.device_id.index
        get_device = (lambda: device) if xp is np else xp.cuda.runtime.getDevice
        return decode_again(
            q,
            k,
            self.table.static_len,
            at,
            lambda q, k: get_device() == device,
            self.launcher_each(q, k, packed=use_packed),
        )
