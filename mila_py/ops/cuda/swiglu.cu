// The CUDA SwiGLUOp's kernels, launched by swiglu.py (compiled after common.cuh).

__device__ __forceinline__ float mila_sigmoid(float g) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
}

// h = silu(g) * u over n contiguous elements (grid-stride).
extern "C" __global__ void swiglu_forward(
    const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ h,
    long long n)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        h[i] = __fmul_rn(__fmul_rn(mila_sigmoid(g), g), up[i]);
    }
}

// du = dh * silu(g), dg = dh * silu'(g) * u. dgate may alias dh (read before written), so
// neither is __restrict__.
extern "C" __global__ void swiglu_backward(
    const float* __restrict__ gate, const float* __restrict__ up, const float* dh,
    float* dgate, float* __restrict__ dup, long long n)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        const float u = up[i];
        const float d = dh[i];
        const float s = mila_sigmoid(g);
        const float silu = __fmul_rn(g, s);
        const float one_minus_s = mila_sigmoid(-g);
        const float dsilu = __fmul_rn(__fadd_rn(__fmul_rn(one_minus_s, silu), s), u);
        dup[i] = __fmul_rn(d, silu);
        dgate[i] = __fmul_rn(d, dsilu);
    }
}
