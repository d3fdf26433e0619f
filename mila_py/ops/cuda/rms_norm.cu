// The CUDA RmsNormOp's kernels, launched by rms_norm.py (compiled after common.cuh). Each is a
// template over the storage type T (float, mila_half, mila_bf16; see common.cuh): elements are
// read as float32, the statistics and the weight gradient stay float32 (double for the sum of
// squares), and each stored y or dx is rounded once.

// x, y [n_rows, dim] C-contiguous; one block per row.
template <typename T>
__global__ void rms_norm_forward(
    const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
    float* __restrict__ rstd, int dim, float eps)
{
    __shared__ double scratch[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * dim;
    T* yr = y + row * dim;
    // the squares summed in double, as the CPU ops: in float32 a row of |x| ~ 1e19 overflows
    // (y = 0) and one of 1e-23 underflows
    double ss = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const double v = to_f32(xr[i]);
        ss += v * v;
    }
    ss = mila_block_sum(ss, scratch);
    // the CPU op's order: mean, + eps, sqrt, reciprocal, in double; r rounded to float
    const float r = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
    if (threadIdx.x == 0) {
        rstd[row] = r;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        yr[i] = from_f32<T>(__fmul_rn(__fmul_rn(to_f32(xr[i]), r), to_f32(w[i])));
    }
}

// dx = r * (g - n * mean(g * n)) with n = x * r, g = dy * w; one block per row.
template <typename T>
__global__ void rms_norm_backward_dx(
    const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ rstd,
    const T* __restrict__ dy, T* __restrict__ dx, int dim)
{
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const long long base = row * dim;
    const float r = rstd[row];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float n = __fmul_rn(to_f32(x[base + i]), r);
        const float g = __fmul_rn(to_f32(dy[base + i]), to_f32(w[i]));
        acc = __fadd_rn(acc, __fmul_rn(g, n));
    }
    const float c = __fdiv_rn(mila_block_sum(acc, scratch), (float)dim);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float n = __fmul_rn(to_f32(x[base + i]), r);
        const float g = __fmul_rn(to_f32(dy[base + i]), to_f32(w[i]));
        dx[base + i] = from_f32<T>(__fmul_rn(__fsub_rn(g, __fmul_rn(n, c)), r));
    }
}

// partial[chunk, j] = sum over the chunk's rows i of dy[i, j] * (x[i, j] * r[i]), in float32.
// grid (ceil(dim / blockDim.x), chunks); chunk c holds rows [c * rows_per_chunk, ...).
template <typename T>
__global__ void rms_norm_backward_dw(
    const T* __restrict__ x, const float* __restrict__ rstd, const T* __restrict__ dy,
    float* __restrict__ partial, int n_rows, int dim, int rows_per_chunk)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= dim) {
        return;
    }
    const int start = blockIdx.y * rows_per_chunk;
    const int stop = n_rows < start + rows_per_chunk ? n_rows : start + rows_per_chunk;
    float acc = 0.0f;
    for (int i = start; i < stop; ++i) {
        const long long o = (long long)i * dim + j;
        acc = __fadd_rn(acc, __fmul_rn(to_f32(dy[o]), __fmul_rn(to_f32(x[o]), rstd[i])));
    }
    partial[(long long)blockIdx.y * dim + j] = acc;
}
