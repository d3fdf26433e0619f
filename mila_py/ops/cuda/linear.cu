// The CUDA LinearOp's few-row products, launched by linear.py (compiled after common.cuh).
//
// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for m < m_rows <= ROWS: a decode step's
// product (one row per sequence), memory-bound on W. Each kernel reads every weight once for all
// the rows of x (the rows' sums in each thread's registers), with FP32 accumulation; cuBLAS is
// not called, so a CUDA graph can capture the launch. Rows of x and out are ldx and ldo
// elements apart (views of larger buffers); W is given by its row stride ldw in either layout.

// W [N, K] with its rows contiguous (w[n * ldw + k]): one warp per output n, the lanes reading
// W's row coalesced (float4 where VEC: k_in, ldw and ldx multiples of 4, x and w 16-byte
// aligned), the row's partial sums reduced by warp shuffles.
template <int ROWS, bool VEC>
__global__ void __launch_bounds__(256) linear_gemv_nk(
    const float* __restrict__ x MILA_STRIDED, const float* __restrict__ w MILA_STRIDED,
    const float* __restrict__ bias, float* __restrict__ out MILA_STRIDED,
    int m_rows, int n_out, int k_in, long long ldx, long long ldw, long long ldo)
{
    const int lane = threadIdx.x & 31;
    const long long n = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= n_out) {
        return;  // the whole warp: no shuffle below waits for it
    }
    const float* wn = w + n * ldw;
    float acc[ROWS];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        acc[m] = 0.0f;
    }
    if constexpr (VEC) {
        const int k4 = k_in >> 2;
        const float4* w4 = reinterpret_cast<const float4*>(wn);
        for (int i = lane; i < k4; i += 32) {
            const float4 wv = w4[i];
#pragma unroll
            for (int m = 0; m < ROWS; ++m) {
                if (m < m_rows) {
                    const float4 xv = reinterpret_cast<const float4*>(x + m * ldx)[i];
                    float a = acc[m];
                    a = fmaf(xv.x, wv.x, a);
                    a = fmaf(xv.y, wv.y, a);
                    a = fmaf(xv.z, wv.z, a);
                    acc[m] = fmaf(xv.w, wv.w, a);
                }
            }
        }
    } else {
        for (int k = lane; k < k_in; k += 32) {
            const float wv = wn[k];
#pragma unroll
            for (int m = 0; m < ROWS; ++m) {
                if (m < m_rows) {
                    acc[m] = fmaf(x[m * ldx + k], wv, acc[m]);
                }
            }
        }
    }
    const float b = bias != nullptr ? bias[n] : 0.0f;
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        if (m < m_rows) {  // uniform over the warp: every lane shuffles
            const float s = mila_warp_sum(acc[m]);
            if (lane == 0) {
                out[m * ldo + n] = s + b;
            }
        }
    }
}

// W [N, K] as the transposed view of [K, N] storage (w[k * ldw + n], the INFERENCE layout of a
// widening Linear): 64 outputs per block of 256 threads, four slices of K each, consecutive
// threads reading consecutive n (coalesced); the slices' sums meet in shared memory.
template <int ROWS>
__global__ void __launch_bounds__(256) linear_gemv_kn(
    const float* __restrict__ x MILA_STRIDED, const float* __restrict__ w MILA_STRIDED,
    const float* __restrict__ bias, float* __restrict__ out MILA_STRIDED,
    int m_rows, int n_out, int k_in, long long ldx, long long ldw, long long ldo)
{
    static_assert(ROWS <= 16, "partial holds 16 rows");
    __shared__ float partial[4096];  // [4 slices][ROWS <= 16][64 outputs]
    const int col = threadIdx.x & 63;
    const int slice = threadIdx.x >> 6;
    const long long n = (long long)blockIdx.x * 64 + col;
    float acc[ROWS];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        acc[m] = 0.0f;
    }
    if (n < n_out) {
        for (long long k = slice; k < k_in; k += 4) {
            const float wv = w[k * ldw + n];
#pragma unroll
            for (int m = 0; m < ROWS; ++m) {
                if (m < m_rows) {
                    acc[m] = fmaf(x[m * ldx + k], wv, acc[m]);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        partial[(slice * ROWS + m) * 64 + col] = acc[m];
    }
    __syncthreads();
    if (slice == 0 && n < n_out) {
        const float b = bias != nullptr ? bias[n] : 0.0f;
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            if (m < m_rows) {
                const float s = (partial[m * 64 + col] + partial[(ROWS + m) * 64 + col]) +
                                (partial[(2 * ROWS + m) * 64 + col] +
                                 partial[(3 * ROWS + m) * 64 + col]);
                out[m * ldo + n] = s + b;
            }
        }
    }
}
