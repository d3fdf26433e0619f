// The CUDA TokenEmbeddingOp's kernels, launched by token_embedding.py (compiled after
// common.cuh).

// dweight[ids[row]] += dy[row] for every row (grid-stride over rows, threads over the width).
// dy is stored as T (float, mila_half, mila_bf16; see common.cuh); the gradient is float32.
template <typename T>
__global__ void token_embedding_backward(
    const long long* __restrict__ ids, const T* __restrict__ dy, float* __restrict__ dweight,
    long long n_rows, int dim)
{
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        float* target = dweight + ids[row] * dim;
        const T* source = dy + row * dim;
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            atomicAdd(target + j, to_f32(source[j]));
        }
    }
}
