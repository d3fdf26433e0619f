// What every CUDA op's kernels share: compiled ahead of each op's .cu file (one NVRTC program
// per file, see mila_py/ops/cuda/_kernels.py).
#define MILA_FULL_MASK 0xffffffffu
#define MILA_NEG_INF __uint_as_float(0xff800000u)
// Marks a pointer parameter addressed with strides the kernel is given: its array may be a view
// that is not C-contiguous (the pointer is its first element). Expands to nothing; the kernel
// emulator of the tests accepts such views for these parameters only.
#define MILA_STRIDED

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
