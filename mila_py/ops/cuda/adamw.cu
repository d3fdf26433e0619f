// The CUDA AdamWOp's kernels, launched by adamw.py (compiled after common.cuh).

extern "C" __global__ void adamw_step(
    float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
    float* __restrict__ v, long long n, int decays, float decay, float beta1,
    float one_minus_beta1, float beta2, float one_minus_beta2, float correction2_sqrt, float eps,
    float step_size)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float gi = g[i];
        float pi = p[i];
        if (decays) {
            pi = __fmul_rn(pi, decay);
        }
        const float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(one_minus_beta1, gi));
        const float vi = __fadd_rn(
            __fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(one_minus_beta2, gi), gi));
        const float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), correction2_sqrt), eps);
        p[i] = __fsub_rn(pi, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
        m[i] = mi;
        v[i] = vi;
    }
}
