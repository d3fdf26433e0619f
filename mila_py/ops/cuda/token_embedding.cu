// The CUDA TokenEmbeddingOp's kernels, launched by token_embedding.py (compiled after common.cuh).

// dweight[ids[row]] += dy[row] for every row (grid-stride over rows, threads over the width).
extern "C" __global__ void token_embedding_backward(
    const long long* __restrict__ ids, const float* __restrict__ dy, float* __restrict__ dweight,
    long long n_rows, int dim)
{
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        float* target = dweight + ids[row] * dim;
        const float* source = dy + row * dim;
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            atomicAdd(target + j, source[j]);
        }
    }
}
