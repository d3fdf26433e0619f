// The CUDA SwiGLUOp's kernels, launched by swiglu.py (compiled after common.cuh): templates over
// the storage type T (float, mila_half, mila_bf16; see common.cuh), float32 arithmetic, each
// stored element rounded once.

__device__ __forceinline__ float mila_sigmoid(float g) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
}

// h = silu(g) * u over n contiguous elements (grid-stride).
template <typename T>
__global__ void swiglu_forward(
    const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ h, long long n)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = to_f32(gate[i]);
        h[i] = from_f32<T>(__fmul_rn(__fmul_rn(mila_sigmoid(g), g), to_f32(up[i])));
    }
}

// du = dh * silu(g), dg = dh * silu'(g) * u. dgate may alias dh (read before written), so
// neither is __restrict__.
template <typename T>
__global__ void swiglu_backward(
    const T* __restrict__ gate, const T* __restrict__ up, const T* dh, T* dgate,
    T* __restrict__ dup, long long n)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = to_f32(gate[i]);
        const float u = to_f32(up[i]);
        const float d = to_f32(dh[i]);
        const float s = mila_sigmoid(g);
        const float silu = __fmul_rn(g, s);
        const float one_minus_s = mila_sigmoid(-g);
        const float dsilu = __fmul_rn(__fadd_rn(__fmul_rn(one_minus_s, silu), s), u);
        dup[i] = from_f32<T>(__fmul_rn(d, silu));
        dgate[i] = from_f32<T>(__fmul_rn(d, dsilu));
    }
}
