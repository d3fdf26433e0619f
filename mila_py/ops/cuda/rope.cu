// The CUDA RopeOp's kernel, launched by rope.py (compiled after common.cuh).
//
// Its tuning, measured on GPUs (none of it changes a result bit): blocks of 128 threads (the
// kernel's __launch_bounds__, and rope.py's launch), each thread holding ROPE_BATCH pair groups
// in registers at once (all their loads issued before any store), 16-byte accesses with
// streaming cache hints (load_pack, store_pack).
#define ROPE_BATCH 4

// The rotation of one pair, in the CPU kernels' order; _rn intrinsics are never fused into FMAs.
__device__ __forceinline__ void rotate_pair(
    float a, float b, float c, float s, float& x, float& y)
{
    x = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    y = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// VEC elements of T moved as one aligned access of VEC * sizeof(T) bytes.
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };

// A pack's load and store: 16-byte packs carry the streaming cache hints (evict first: each
// byte of Q and K is touched once); narrower ones are plain accesses.
template <typename P> __device__ __forceinline__ P load_pack(const P* p) {
    if constexpr (sizeof(P) == 16) {
        const int4 v = __ldcs(reinterpret_cast<const int4*>(p));
        return *reinterpret_cast<const P*>(&v);
    }
    return *p;
}
template <typename P> __device__ __forceinline__ void store_pack(P* p, const P& v) {
    if constexpr (sizeof(P) == 16) {
        __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
        return;
    }
    *p = v;
}

// Group g of one head starting at element lo, held in registers between its load and its
// store. Layout "half": VEC pairs (i, i + n) for i in [g * VEC, g * VEC + VEC), a the lower
// and b the upper elements. Layout "interleaved": VEC / 2 pairs (2i, 2i + 1) in the VEC
// elements of a from g * VEC; with VEC == 1, one pair (2g, 2g + 1): a and b one element each.
template <typename T, int VEC, bool INTERLEAVED> struct Group {
    Pack<T, VEC> a, b;

    __device__ __forceinline__ void load(const T* x, int lo, int g, int n) {
        if constexpr (INTERLEAVED && VEC == 1) {
            a.v[0] = x[lo + 2 * g];
            b.v[0] = x[lo + 2 * g + 1];
        } else if constexpr (INTERLEAVED) {
            const int e0 = lo + g * VEC;
            a = load_pack(reinterpret_cast<const Pack<T, VEC>*>(x + e0));
        } else {
            a = load_pack(reinterpret_cast<const Pack<T, VEC>*>(x + lo + g * VEC));
            b = load_pack(reinterpret_cast<const Pack<T, VEC>*>(x + lo + n + g * VEC));
        }
    }

    // the rotated group written to y (c, s: this token's cos and sin by frequency)
    __device__ __forceinline__ void rotate_store(
        T* y, int lo, int g, int n, const float* c, const float* s, float sign) const
    {
        if constexpr (INTERLEAVED && VEC == 1) {
            float u, w;
            rotate_pair(to_f32(a.v[0]), to_f32(b.v[0]), c[g], __fmul_rn(s[g], sign), u, w);
            y[lo + 2 * g] = from_f32<T>(u);
            y[lo + 2 * g + 1] = from_f32<T>(w);
        } else if constexpr (INTERLEAVED) {
            Pack<T, VEC> out;
#pragma unroll
            for (int j = 0; j < VEC; j += 2) {
                const int i = (g * VEC + j) >> 1;
                float u, w;
                rotate_pair(to_f32(a.v[j]), to_f32(a.v[j + 1]), c[i], __fmul_rn(s[i], sign), u, w);
                out.v[j] = from_f32<T>(u);
                out.v[j + 1] = from_f32<T>(w);
            }
            const int e0 = lo + g * VEC;
            store_pack(reinterpret_cast<Pack<T, VEC>*>(y + e0), out);
        } else {
            Pack<T, VEC> out1, out2;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const int i = g * VEC + j;
                float u, w;
                rotate_pair(to_f32(a.v[j]), to_f32(b.v[j]), c[i], __fmul_rn(s[i], sign), u, w);
                out1.v[j] = from_f32<T>(u);
                out2.v[j] = from_f32<T>(w);
            }
            store_pack(reinterpret_cast<Pack<T, VEC>*>(y + lo + g * VEC), out1);
            store_pack(reinterpret_cast<Pack<T, VEC>*>(y + lo + n + g * VEC), out2);
        }
    }
};

// The position axis of frequency i under M-RoPE: contiguous sections (mode 1: [0, a) temporal,
// [a, b) height, the rest width) or interleaved (mode 2, Qwen3-VL: i % 3 == 1 below a height,
// i % 3 == 2 below b width, the rest temporal).
__device__ __forceinline__ int mrope_axis(int i, int mode, int a, int b) {
    if (mode == 1) return i < a ? 0 : (i < b ? 1 : 2);
    const int r = i % 3;
    return (r == 1 && i < a) ? 1 : ((r == 2 && i < b) ? 2 : 0);
}

// One block per token (b, t), of 128 threads (the __launch_bounds__ below; rope.py launches
// that many). Strides are in elements; the last axis is contiguous. In place, x_in and
// x_out are the same array (so neither is __restrict__). With use_positions, the token's
// position is positions[token] (int32 [B * T] in device memory), else offset + t; with
// mrope != 0, positions are [3, B * T] (one row per axis) and each frequency's cos/sin come
// from its axis' position.
template <typename T, int VEC, bool INTERLEAVED>
__global__ void __launch_bounds__(128) rope_qk(
    MILA_STRIDED const T* q_in, MILA_STRIDED T* q_out,
    MILA_STRIDED const T* k_in, MILA_STRIDED T* k_out,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table,
    const int* __restrict__ positions, int use_positions, long long offset,
    int n_t, int n_heads, int n_kv_heads, int head_dim, int n_freq,
    long long q_sb, long long q_st, long long k_sb, long long k_st,
    long long qo_sb, long long qo_st, long long ko_sb, long long ko_st,
    float sign, int copy_rest, int mrope, int mrope_a, int mrope_b)
{
    extern __shared__ float row[];  // [2 * n_freq]: cos then sin of this token's position
    const long long token = blockIdx.x;
    const long long b = token / n_t;
    const long long t = token - b * n_t;
    const long long p = use_positions ? positions[token] : offset + t;
    for (int i = threadIdx.x; i < n_freq; i += blockDim.x) {
        const long long pi = mrope
            ? positions[mrope_axis(i, mrope, mrope_a, mrope_b) * (long long)gridDim.x + token]
            : p;
        row[i] = cos_table[pi * n_freq + i];
        row[n_freq + i] = sin_table[pi * n_freq + i];
    }
    const float* c = row;
    const float* s = row + n_freq;
    const T* qi = q_in + b * q_sb + t * q_st;
    const T* ki = k_in + b * k_sb + t * k_st;
    T* qo = q_out + b * qo_sb + t * qo_st;
    T* ko = k_out + b * ko_sb + t * ko_st;
    const int groups = INTERLEAVED ? (VEC == 1 ? n_freq : (2 * n_freq) / VEC) : n_freq / VEC;
    const int items = (n_heads + n_kv_heads) * groups;
    // A thread's items go ROPE_BATCH at a time: all their loads, then all their stores (in
    // place, a store could alias a later load as far as the compiler knows, so one item at a
    // time would keep one item's loads in flight).
    Group<T, VEC, INTERLEAVED> held[ROPE_BATCH];
    const int step = ROPE_BATCH * (int)blockDim.x;
    __syncthreads();  // the row is staged
    for (int first = threadIdx.x; first < items; first += step) {
#pragma unroll
        for (int u = 0; u < ROPE_BATCH; ++u) {
            const int item = first + u * (int)blockDim.x;
            if (item < items) {
                const int h = item / groups;
                const bool is_q = h < n_heads;
                const int lo = (is_q ? h : h - n_heads) * head_dim;
                held[u].load(is_q ? qi : ki, lo, item - h * groups, n_freq);
            }
        }
#pragma unroll
        for (int u = 0; u < ROPE_BATCH; ++u) {
            const int item = first + u * (int)blockDim.x;
            if (item < items) {
                const int h = item / groups;
                const bool is_q = h < n_heads;
                const int lo = (is_q ? h : h - n_heads) * head_dim;
                held[u].rotate_store(is_q ? qo : ko, lo, item - h * groups, n_freq, c, s, sign);
            }
        }
    }
    if (copy_rest) {  // out of place: channels past the rotated part pass through
        const int rest = head_dim - 2 * n_freq;
        const int total = (n_heads + n_kv_heads) * rest;
        for (int e = threadIdx.x; e < total; e += blockDim.x) {
            const int h = e / rest;
            const int j = 2 * n_freq + (e - h * rest);
            if (h < n_heads) {
                qo[h * head_dim + j] = qi[h * head_dim + j];
            } else {
                ko[(h - n_heads) * head_dim + j] = ki[(h - n_heads) * head_dim + j];
            }
        }
    }
}
