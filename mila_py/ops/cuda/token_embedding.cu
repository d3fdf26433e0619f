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

// out [n_rows, dim] = weight [vocab, dim] [ids[row]] for int32 ids [n_rows] in device memory (a
// decode step's token buffer, written before the step: nothing here comes from the host). An
// id outside [0, vocab), which the callers' checks rule out, gives a row of NaN, never a read
// outside the table. One block per row (grid-stride over rows, threads over the width). T is
// the storage type (float, mila_half, mila_bf16).
template <typename T>
__global__ void token_embedding_lookup(
    const int* __restrict__ ids, const T* __restrict__ weight, T* __restrict__ out,
    long long n_rows, int dim, int vocab)
{
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const int id = ids[row];
        T* target = out + row * dim;
        if (id < 0 || id >= vocab) {
            for (int j = threadIdx.x; j < dim; j += blockDim.x) {
                target[j] = from_f32<T>(__uint_as_float(0x7fc00000u));
            }
            continue;
        }
        const T* source = weight + (long long)id * dim;
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            target[j] = source[j];
        }
    }
}
