// What every CUDA op's kernels share: compiled ahead of each op's .cu file (one NVRTC program
// per file, see mila_py/ops/cuda/_kernels.py).
#define MILA_FULL_MASK 0xffffffffu
#define MILA_NEG_INF __uint_as_float(0xff800000u)
// Marks a pointer parameter addressed with strides the kernel is given: its array may be a view
// that is not C-contiguous (the pointer is its first element). Expands to nothing; the kernel
// emulator of the tests accepts such views for these parameters only.
#define MILA_STRIDED

// 16-bit floats as raw bits: no CUDA header needed (NVRTC's header discovery differs between
// CuPy installs). Kernels templated on a storage type T (float, mila_half, mila_bf16) read each
// element with to_f32 and store each float32 result with from_f32<T>: arithmetic in float32,
// one rounding per stored value.
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

template <typename T>  // float, or double where a sum must not overflow (RMSNorm's squares)
__device__ __forceinline__ T mila_warp_sum(T v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(MILA_FULL_MASK, v, offset);
    }
    return v;
}

__device__ __forceinline__ float mila_warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(MILA_FULL_MASK, v, offset));
    }
    return v;
}

// The sum of v over the block, returned to every thread. blockDim.x is a multiple of 32 (at
// most 1024) and every thread of the block calls it; scratch is __shared__ T[32].
template <typename T>
__device__ __forceinline__ T mila_block_sum(T v, T* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    v = mila_warp_sum(v);
    __syncthreads();  // an earlier reduction may still be reading scratch
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : T(0);
    return mila_warp_sum(v);
}

// The maximum of v over the block, returned to every thread (same contract as mila_block_sum).
__device__ __forceinline__ float mila_block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    v = mila_warp_max(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : MILA_NEG_INF;
    return mila_warp_max(v);
}

// Replaces s[0 .. n) by exp(s[i] - max(s)) and returns their sum to every thread of the block
// (same contract as mila_block_sum; s may be global or shared memory, its writes published by
// the barriers of the sum). The numerator and denominator of a softmax over s.
__device__ __forceinline__ float mila_block_exp_sum(float* s, long long n, float* scratch) {
    float m = MILA_NEG_INF;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        m = fmaxf(m, s[i]);
    }
    m = mila_block_max(m, scratch);
    float sum = 0.0f;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(__fsub_rn(s[i], m));
        s[i] = e;
        sum = __fadd_rn(sum, e);
    }
    return mila_block_sum(sum, scratch);
}
