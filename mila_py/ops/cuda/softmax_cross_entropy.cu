// The CUDA SoftmaxCrossEntropyOp's kernels, launched by softmax_cross_entropy.py (compiled after
// common.cuh): templates over the logits' storage type T (float, mila_half, mila_bf16; see
// common.cuh); the softmax, lse and loss are float32 (float64 for the loss), dlogits rounded once.

// logits [n_rows, vocab] C-contiguous; one block per row. stats[row] = (loss, counted).
template <typename T>
__global__ void softmax_cross_entropy_forward(
    const T* __restrict__ logits, const long long* __restrict__ targets,
    float* __restrict__ lse, double* __restrict__ stats, int vocab, long long ignore_index)
{
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const T* z = logits + row * vocab;
    float m = MILA_NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        m = fmaxf(m, to_f32(z[i]));
    }
    m = mila_block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        s = __fadd_rn(s, expf(__fsub_rn(to_f32(z[i]), m)));
    }
    s = mila_block_sum(s, scratch);
    if (threadIdx.x == 0) {
        const double log_sum = log((double)s);
        lse[row] = (float)((double)m + log_sum);
        const long long t = targets[row];
        const bool counted = t != ignore_index;
        stats[2 * row] = counted ? ((double)m - (double)to_f32(z[t])) + log_sum : 0.0;
        stats[2 * row + 1] = counted ? 1.0 : 0.0;
    }
}

// dlogits = (softmax(logits) - onehot(target)) * scale, zero rows for ignored targets; one
// block per row, the softmax divided by its own sum.
template <typename T>
__global__ void softmax_cross_entropy_backward(
    const T* __restrict__ logits, const long long* __restrict__ targets,
    const float* __restrict__ lse, T* __restrict__ dlogits, int vocab,
    long long ignore_index, float scale)
{
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const T* z = logits + row * vocab;
    T* d = dlogits + row * vocab;
    const long long t = targets[row];
    if (t == ignore_index) {  // the whole block takes this branch
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            d[i] = from_f32<T>(0.0f);
        }
        return;
    }
    const float l = lse[row];
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        s = __fadd_rn(s, expf(__fsub_rn(to_f32(z[i]), l)));
    }
    s = mila_block_sum(s, scratch);
    const float k = __fdiv_rn(scale, s);
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = __fmul_rn(expf(__fsub_rn(to_f32(z[i]), l)), k);
        if (i == t) {
            v = __fsub_rn(v, scale);
        }
        d[i] = from_f32<T>(v);
    }
}
