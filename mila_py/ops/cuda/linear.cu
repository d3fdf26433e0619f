// The CUDA LinearOp's decode products, launched by linear.py (compiled after common.cuh).
//
// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for m < m_rows <= ROWS <= 16: a decode step's
// product, one row of x per sequence. W is [N, K] rows (row stride ldw, K contiguous); rows of x
// and out are ldx and ldo elements apart (views of larger buffers). Storage T is float,
// mila_half or mila_bf16; the sums are float32 and each output is rounded once. No cuBLAS call,
// so a CUDA graph captures the launch (CuPy refuses cuBLAS while a stream captures).
//
// Such a product is bound by reading W once (x is at most 16 rows; W is 8 MB to 1 GB per call
// at the Llama-3.2-1B shape), so the kernel is written for HBM bandwidth:
// - one warp streams NW whole rows of W, its lanes reading consecutive 16-byte chunks (int4:
//   4 floats or 8 halves), 512 bytes per warp load. NW = 2 for 4 and 8 rows of x, so that
//   each chunk of x, read from L1, serves two rows of W (L1 traffic is ROWS / NW times W's);
//   NW = 1 for 1 and 2 rows (more warps for small N) and for 16 (registers);
// - each lane issues U chunks per row of W before it uses any (U = 8 for 1-2 rows, else 4):
//   NW * U * 16 = 64-128 B per lane, 2-4 KB per warp in flight. Blocks of 4 warps, one warp
//   per NW outputs: N / (4 NW) blocks, 256 to 32000 at the 1B shape, so each of an H200's 132
//   SMs holds 8-32 warps (<= 128 registers per thread, __launch_bounds__(128, 4)) and
//   16-128 KB of loads in flight, above the ~20 KB per SM that ~4.2 TB/s at ~600 ns of
//   latency asks for (Little's law);
// - W is read with __ldcs (evict-first: no step reads it again before L2 has turned over), x
//   with __ldg (read-only path: every warp reads all of x, at most 16 * 8192 * 4 = 512 KB,
//   which stays in L1/L2; staging it in shared memory would not cut the per-SM traffic);
// - the lanes' partial sums meet by warp shuffles, once per (row of x, row of W).
// VEC = false is the scalar fallback for operands the 16-byte loads cannot take (K, ldw or ldx
// not a multiple of the chunk, W or x not 16-byte aligned): the same warps, one element per
// lane and step.

// The values of a 16-byte chunk of T storage as floats (E = 16 / sizeof(T) of them).
__device__ __forceinline__ void mila_unpack16(const int4 v, float* f, float*) {
    f[0] = __uint_as_float((unsigned int)v.x);
    f[1] = __uint_as_float((unsigned int)v.y);
    f[2] = __uint_as_float((unsigned int)v.z);
    f[3] = __uint_as_float((unsigned int)v.w);
}

__device__ __forceinline__ void mila_unpack_pair(unsigned int u, float* f, mila_bf16*) {
    f[0] = __uint_as_float(u << 16);  // the lower address holds the first element
    f[1] = __uint_as_float(u & 0xffff0000u);
}

__device__ __forceinline__ void mila_unpack_pair(unsigned int u, float* f, mila_half*) {
    mila_half lo, hi;
    lo.bits = (unsigned short)(u & 0xffffu);
    hi.bits = (unsigned short)(u >> 16);
    f[0] = to_f32(lo);
    f[1] = to_f32(hi);
}

template <typename T>
__device__ __forceinline__ void mila_unpack16(const int4 v, float* f, T* tag) {
    mila_unpack_pair((unsigned int)v.x, f, tag);
    mila_unpack_pair((unsigned int)v.y, f + 2, tag);
    mila_unpack_pair((unsigned int)v.z, f + 4, tag);
    mila_unpack_pair((unsigned int)v.w, f + 6, tag);
}

template <typename T, int ROWS, bool VEC>
__global__ void __launch_bounds__(128, 4) linear_rows(
    const T* __restrict__ x MILA_STRIDED, const T* __restrict__ w MILA_STRIDED,
    const T* __restrict__ bias, T* __restrict__ out MILA_STRIDED,
    int m_rows, int n_out, int k_in, long long ldx, long long ldw, long long ldo)
{
    constexpr int E = 16 / (int)sizeof(T);  // elements per 16-byte chunk
    constexpr int NW = ROWS == 4 || ROWS == 8 ? 2 : 1;  // rows of W per warp (linear.py too)
    constexpr int U = ROWS <= 2 ? 8 : 4;                 // chunks per lane and W row in flight
    T* const tag = nullptr;                 // selects mila_unpack16's storage type
    const int lane = threadIdx.x & 31;
    const long long n0 = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * NW;
    // a warp's rows past n_out read the last row instead (never written): every warp of the
    // block runs the same code to the end, shuffles included
    const T* wr[NW];
#pragma unroll
    for (int r = 0; r < NW; ++r) {
        wr[r] = w + (n0 + r < n_out ? n0 + r : (long long)n_out - 1) * ldw;
    }
    float acc[NW][ROWS];
#pragma unroll
    for (int r = 0; r < NW; ++r) {
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            acc[r][m] = 0.0f;
        }
    }
    if constexpr (VEC) {
        const int chunks = k_in / E;
        int c = lane;
        for (; c + 32 * (U - 1) < chunks; c += 32 * U) {
            int4 wv[NW][U];
#pragma unroll
            for (int r = 0; r < NW; ++r) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    wv[r][u] = __ldcs(reinterpret_cast<const int4*>(wr[r]) + c + 32 * u);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float wf[NW][E];
#pragma unroll
                for (int r = 0; r < NW; ++r) {
                    mila_unpack16(wv[r][u], wf[r], tag);
                }
#pragma unroll
                for (int m = 0; m < ROWS; ++m) {
                    if (m < m_rows) {
                        const int4* xm = reinterpret_cast<const int4*>(x + m * ldx);
                        float xf[E];
                        mila_unpack16(__ldg(xm + c + 32 * u), xf, tag);
#pragma unroll
                        for (int r = 0; r < NW; ++r) {
#pragma unroll
                            for (int e = 0; e < E; ++e) {
                                acc[r][m] = fmaf(xf[e], wf[r][e], acc[r][m]);
                            }
                        }
                    }
                }
            }
        }
        for (; c < chunks; c += 32) {  // the last chunks, fewer than U per lane
            float wf[NW][E];
#pragma unroll
            for (int r = 0; r < NW; ++r) {
                mila_unpack16(__ldcs(reinterpret_cast<const int4*>(wr[r]) + c), wf[r], tag);
            }
#pragma unroll
            for (int m = 0; m < ROWS; ++m) {
                if (m < m_rows) {
                    float xf[E];
                    mila_unpack16(__ldg(reinterpret_cast<const int4*>(x + m * ldx) + c), xf, tag);
#pragma unroll
                    for (int r = 0; r < NW; ++r) {
#pragma unroll
                        for (int e = 0; e < E; ++e) {
                            acc[r][m] = fmaf(xf[e], wf[r][e], acc[r][m]);
                        }
                    }
                }
            }
        }
    } else {
#pragma unroll 4
        for (int k = lane; k < k_in; k += 32) {
            float wk[NW];
#pragma unroll
            for (int r = 0; r < NW; ++r) {
                wk[r] = to_f32(wr[r][k]);
            }
#pragma unroll
            for (int m = 0; m < ROWS; ++m) {
                if (m < m_rows) {
                    const float xk = to_f32(x[m * ldx + k]);
#pragma unroll
                    for (int r = 0; r < NW; ++r) {
                        acc[r][m] = fmaf(xk, wk[r], acc[r][m]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NW; ++r) {
        const long long n = n0 + r;
        const bool mine = lane == 0 && n < n_out;
        const float b = (mine && bias != nullptr) ? to_f32(bias[n]) : 0.0f;
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            if (m < m_rows) {  // uniform over the warp: every lane shuffles
                const float s = mila_warp_sum(acc[r][m]);
                if (mine) {
                    out[m * ldo + n] = from_f32<T>(s + b);
                }
            }
        }
    }
}
