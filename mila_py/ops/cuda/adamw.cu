// The CUDA AdamWOp's kernels, launched by adamw.py (compiled after common.cuh).

// One element's update of the weight w, in float32 with NumPy's roundings in NumPy's order;
// m and v are updated in place, the new weight is returned.
__device__ __forceinline__ float adamw_element(
    float w, float gi, float& m, float& v, int decays, float decay, float beta1,
    float one_minus_beta1, float beta2, float one_minus_beta2, float correction2_sqrt, float eps,
    float step_size)
{
    if (decays) {
        w = __fmul_rn(w, decay);
    }
    const float mi = __fadd_rn(__fmul_rn(m, beta1), __fmul_rn(one_minus_beta1, gi));
    const float vi = __fadd_rn(__fmul_rn(v, beta2), __fmul_rn(__fmul_rn(one_minus_beta2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), correction2_sqrt), eps);
    m = mi;
    v = vi;
    return __fsub_rn(w, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
}

extern "C" __global__ void adamw_step(
    float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
    float* __restrict__ v, long long n, int decays, float decay, float beta1,
    float one_minus_beta1, float beta2, float one_minus_beta2, float correction2_sqrt, float eps,
    float step_size)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float mi = m[i];
        float vi = v[i];
        p[i] = adamw_element(p[i], g[i], mi, vi, decays, decay, beta1, one_minus_beta1, beta2,
                             one_minus_beta2, correction2_sqrt, eps, step_size);
        m[i] = mi;
        v[i] = vi;
    }
}

// A 16-bit parameter with an FP32 master copy: the update runs on the master (as adamw_step on
// an FP32 parameter) and the parameter receives the new master rounded to T (to nearest even).
template <typename T>
__global__ void adamw_master_step(
    T* __restrict__ p, float* __restrict__ master, const float* __restrict__ g,
    float* __restrict__ m, float* __restrict__ v, long long n, int decays, float decay,
    float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
    float correction2_sqrt, float eps, float step_size)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float mi = m[i];
        float vi = v[i];
        const float w = adamw_element(master[i], g[i], mi, vi, decays, decay, beta1,
                                      one_minus_beta1, beta2, one_minus_beta2, correction2_sqrt,
                                      eps, step_size);
        master[i] = w;
        p[i] = from_f32<T>(w);
        m[i] = mi;
        v[i] = vi;
    }
}
