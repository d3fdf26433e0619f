// The CUDA AttentionOp's kernels, launched by attention.py (compiled after common.cuh).

// scores [n_rows, n_tk] C-contiguous, replaced by their softmax. Row r is query t = r % n_tq;
// with causal != 0 it sees keys s <= q_offset + t (the others get probability 0), else all keys
// (an additive bias with -inf entries was applied before). One block per row (grid-stride).
extern "C" __global__ void attention_softmax(
    float* __restrict__ scores, long long n_rows, int n_tq, int n_tk, long long q_offset,
    int causal)
{
    __shared__ float scratch[32];
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        float* s = scores + row * n_tk;
        const long long t = row % n_tq;
        long long visible = n_tk;
        if (causal && q_offset + t + 1 < visible) {
            visible = q_offset + t + 1;
        }
        const float sum = mila_block_exp_sum(s, visible, scratch);
        for (long long i = threadIdx.x; i < n_tk; i += blockDim.x) {
            s[i] = i < visible ? __fdiv_rn(s[i], sum) : 0.0f;
        }
    }
}

// Decode: one new query per sequence over its cached keys and values. q [B, 1, Hq*d] (rows at
// stride q_sb: a view of the QKV buffer), k_cache and v_cache [B, t_max, Hk*d] and out
// [B, 1, Hq*d] C-contiguous. Sequence b sees keys 0 .. positions[b] (positions: int32 [B] in
// device memory, the decode step's). One block of 256 threads per (query head, sequence):
// - scores: a warp per key, lanes over the channels, kept in dynamic shared memory (as many
//   floats as the longest sequence's keys); the loop runs the same trip count in every warp
//   (shuffles need whole warps);
// - the block's softmax over them;
// - the weighted sum of the values: the threads as groups of `cols` channels, each group
//   summing p_j v_j over every groups-th key, the groups' sums added through shared memory.
// T is the storage type of q, the caches and out (float, mila_half, mila_bf16; see common.cuh):
// scores, softmax and sums are float32, each output rounded once.
template <typename T>
__global__ void __launch_bounds__(256) attention_decode(
    const T* __restrict__ q MILA_STRIDED, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, T* __restrict__ out,
    const int* __restrict__ positions, long long q_sb, int t_max, int n_heads, int n_kv_heads,
    int head_dim, float scale)
{
    extern __shared__ float scores[];
    __shared__ float scratch[32];
    __shared__ float partial[256];
    const int h = blockIdx.x;
    const long long b = blockIdx.y;
    const int kv_head = h / (n_heads / n_kv_heads);
    const int len = positions[b] + 1;
    const long long kv_width = (long long)n_kv_heads * head_dim;
    const T* qh = q + b * q_sb + (long long)h * head_dim;
    const T* kb = k_cache + b * t_max * kv_width + (long long)kv_head * head_dim;
    const T* vb = v_cache + b * t_max * kv_width + (long long)kv_head * head_dim;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    for (int first = 0; first < len; first += n_warps) {
        const int j = first + warp;
        float dot = 0.0f;
        if (j < len) {
            const T* kj = kb + (long long)j * kv_width;
            for (int c = lane; c < head_dim; c += 32) {
                dot = fmaf(__fmul_rn(to_f32(qh[c]), scale), to_f32(kj[c]), dot);
            }
        }
        dot = mila_warp_sum(dot);
        if (j < len && lane == 0) {
            scores[j] = dot;
        }
    }
    __syncthreads();
    const float sum = mila_block_exp_sum(scores, len, scratch);  // p_j = scores[j] / sum
    const int cols = head_dim < (int)blockDim.x ? head_dim : (int)blockDim.x;
    const int groups = blockDim.x / cols;
    const int group = threadIdx.x / cols;
    const int col = threadIdx.x - group * cols;
    T* oh = out + b * (long long)n_heads * head_dim + (long long)h * head_dim;
    for (int base = 0; base < head_dim; base += cols) {  // the same trip count in every thread
        const int c = base + col;
        const bool active = group < groups && c < head_dim;
        float acc = 0.0f;
        if (active) {
            for (int j = group; j < len; j += groups) {
                acc = fmaf(scores[j], to_f32(vb[(long long)j * kv_width + c]), acc);
            }
        }
        __syncthreads();  // the previous pass has read partial
        if (active) {
            partial[threadIdx.x] = acc;
        }
        __syncthreads();
        if (active && group == 0) {
            float total = acc;
            for (int other = 1; other < groups; ++other) {
                total = __fadd_rn(total, partial[other * cols + col]);
            }
            oh[c] = from_f32<T>(__fdiv_rn(total, sum));
        }
    }
}

// The new token's keys and values into the caches: k_new, v_new [B, 1, Hk*d] (rows at strides
// k_sb, v_sb: views of the QKV buffer) to row positions[b] (int32 [B] in device memory, the
// decode step's) of sequence b of k_cache, v_cache [B, t_max, Hk*d] C-contiguous (grid-stride
// over B * width); T is their storage type (the values are copied).
template <typename T>
__global__ void kv_cache_write(
    const T* __restrict__ k_new MILA_STRIDED, const T* __restrict__ v_new MILA_STRIDED,
    T* __restrict__ k_cache, T* __restrict__ v_cache,
    const int* __restrict__ positions, long long k_sb, long long v_sb, int t_max, int width,
    int n_b)
{
    const long long total = (long long)n_b * width;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long b = i / width;
        const long long c = i - b * width;
        const long long at = (b * t_max + positions[b]) * width + c;
        k_cache[at] = k_new[b * k_sb + c];
        v_cache[at] = v_new[b * v_sb + c];
    }
}

// dp = (dp - row[r]) * p for the n elements of [n / n_cols, n_cols] (grid-stride).
extern "C" __global__ void attention_softmax_backward(
    float* __restrict__ dp, const float* __restrict__ p, const float* __restrict__ row,
    long long n, int n_cols)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dp[i] = __fmul_rn(__fsub_rn(dp[i], row[i / n_cols]), p[i]);
    }
}
