// A CPU emulator for the raw CUDA kernels of mila_py/ops/cuda (tests only).
//
// The kernel sources compile unchanged as C++: every block runs its threads as fibers
// (ucontext stacks, switched with _setjmp/_longjmp) on one OS thread, round-robin; __syncthreads() switches to the next fiber, so all
// threads of a block reach a barrier before any passes it. Warp shuffles exchange values
// through a block-wide buffer between two barriers, which is exact when every thread of the
// block calls the shuffle (as the block reductions of common.cuh do). Shared memory is a
// function-static array (blocks run one after another); dynamic shared memory (extern
// __shared__, rewritten by kernel_emulator.py) is one buffer of the launch's size, filled with
// 0xff bytes (float NaNs) before every block and followed by a guard checked after it. Float
// intrinsics are plain IEEE operations (compile with -ffp-contract=off); atomics are plain
// read-modify-writes; the two PTX conversions the kernels use (fp16 <-> fp32) are emulated
// bit for bit. reinterpret_cast (rewritten to mila_emu::aligned_cast) checks the alignment the
// GPU requires of the access. What the GPU would trap on is recorded as a fault, which the
// launch returns and the Python side raises.
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

namespace mila_emu {

// A fiber starts once through makecontext/swapcontext (its own stack); every later switch is
// a _setjmp/_longjmp pair, which makes no system call (swapcontext saves the signal mask).
struct Fiber {
    ucontext_t context;
    jmp_buf resume;
    std::vector<char> stack;
    bool started = false;
    bool done = false;
};

inline dim3 thread_index, block_index, block_dim, grid_dim;
inline std::vector<Fiber> pool;  // fibers and their stacks, kept across launches
inline ucontext_t scheduler_context;
inline jmp_buf scheduler;
inline unsigned current = 0;
inline const std::function<void()>* body = nullptr;
inline std::vector<float> exchange;
inline std::vector<double> exchange_double;

// The first fault of a launch (empty if none): what a GPU would have trapped on.
inline std::string fault;

inline void report(const char* what) {
    if (!fault.empty()) return;
    char where[96];
    std::snprintf(where, sizeof where, " (block %u, thread %u)", block_index.x, thread_index.x);
    fault = std::string(what) + where;
}

// Dynamic shared memory: the launch's bytes, then a guard of poison bytes.
constexpr std::size_t kSharedGuard = 256;
struct alignas(16) SharedChunk {
    unsigned char bytes[16];
};
inline std::vector<SharedChunk> shared_storage;
inline std::size_t shared_bytes = 0;

template <typename T>
T* dynamic_shared() {
    return reinterpret_cast<T*>(shared_storage.data());
}

inline void poison_shared() {
    std::memset(shared_storage.data(), 0xff, shared_storage.size() * sizeof(SharedChunk));
}

inline void check_shared_guard() {
    const auto* bytes = reinterpret_cast<const unsigned char*>(shared_storage.data());
    for (std::size_t i = shared_bytes; i < shared_bytes + kSharedGuard; ++i) {
        if (bytes[i] != 0xff) {
            if (fault.empty()) {
                fault = "write past the end of dynamic shared memory (block " +
                        std::to_string(block_index.x) + ")";
            }
            return;
        }
    }
}

// reinterpret_cast with the GPU's alignment rule: an access through a T* or T& needs an address
// that is a multiple of alignof(T) (a misaligned vector load traps on the GPU). A misaligned cast
// is reported and yields a scratch object, so the CPU never makes the misaligned access.
alignas(64) inline unsigned char misaligned_scratch[256];

template <typename To, typename From>
To aligned_cast(From&& from) {
    if constexpr (std::is_pointer_v<To>) {
        using Target = std::remove_cv_t<std::remove_pointer_t<To>>;
        const auto address = reinterpret_cast<std::uintptr_t>(from);
        if constexpr (!std::is_void_v<Target>) {
            static_assert(sizeof(Target) <= sizeof misaligned_scratch);
            if (address % alignof(Target) != 0) {
                char what[128];
                std::snprintf(what, sizeof what,
                              "misaligned access: address %#llx is not a multiple of %zu",
                              static_cast<unsigned long long>(address), alignof(Target));
                report(what);
                return reinterpret_cast<To>(misaligned_scratch);
            }
        }
        return reinterpret_cast<To>(from);
    } else if constexpr (std::is_reference_v<To>) {
        using Target = std::remove_cv_t<std::remove_reference_t<To>>;
        static_assert(sizeof(Target) <= sizeof misaligned_scratch);
        const auto address = reinterpret_cast<std::uintptr_t>(&from);
        if (address % alignof(Target) != 0) {
            report("misaligned access through a reference");
            return reinterpret_cast<To>(misaligned_scratch);
        }
        return reinterpret_cast<To>(from);
    } else {
        return reinterpret_cast<To>(from);
    }
}

// PTX cvt.f32.f16: exact.
inline float ptx_cvt_f32_f16(unsigned short h) {
    const unsigned sign = (h & 0x8000u) << 16;
    const unsigned exponent = (h >> 10) & 0x1fu;
    const unsigned mantissa = h & 0x3ffu;
    unsigned bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);  // infinity, NaN
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else {
        const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal, 0
        return sign ? -magnitude : magnitude;
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// PTX cvt.rn.f16.f32: round to nearest even, overflow to infinity, subnormal results kept, NaN to
// the canonical NaN 0x7fff.
inline unsigned short ptx_cvt_rn_f16_f32(float f) {
    unsigned u;
    std::memcpy(&u, &f, sizeof u);
    const unsigned sign = (u >> 16) & 0x8000u;
    const unsigned magnitude = u & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return 0x7fffu;
    if (magnitude >= 0x38800000u) {  // at least 2^-14: a normal fp16, or infinity
        unsigned r = magnitude - 0x38000000u;  // rebias the exponent: 127 -> 15
        r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
        return static_cast<unsigned short>(sign | (r < 0x7c00u ? r : 0x7c00u));
    }
    const unsigned exponent = magnitude >> 23;
    if (exponent < 102) return static_cast<unsigned short>(sign);  // below 2^-25: rounds to 0
    // a subnormal fp16: round (mantissa * 2^(exponent - 150)) / 2^-24 to an integer
    const unsigned mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const unsigned shift = 126 - exponent;  // 14 .. 24
    unsigned q = mantissa >> shift;
    const unsigned rest = mantissa & ((1u << shift) - 1u);
    const unsigned half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1u))) ++q;
    return static_cast<unsigned short>(sign | q);
}

inline void barrier() {
    if (_setjmp(pool[current].resume) == 0) _longjmp(scheduler, 1);
}

inline void trampoline() {
    (*body)();
    pool[current].done = true;
    _longjmp(scheduler, 1);  // never returns: the scheduler's frame is the one that set it
}

// Runs every block of the grid; returns the first fault's text, or nullptr.
inline const char* launch(dim3 grid, dim3 block, std::size_t dynamic_shared_bytes,
                          const std::function<void()>& kernel_call) {
    const unsigned n = block.x * block.y * block.z;
    fault.clear();
    shared_bytes = dynamic_shared_bytes;
    shared_storage.resize((dynamic_shared_bytes + kSharedGuard + 15) / 16);
    if (pool.size() < n) pool.resize(n);
    for (unsigned i = 0; i < n; ++i) {
        if (pool[i].stack.empty()) pool[i].stack.resize(1 << 15);
    }
    body = &kernel_call;
    grid_dim = grid;
    block_dim = block;
    exchange.assign(n, 0.0f);
    exchange_double.assign(n, 0.0);
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                block_index = dim3{bx, by, bz};
                poison_shared();
                for (unsigned i = 0; i < n; ++i) {
                    Fiber& f = pool[i];
                    getcontext(&f.context);
                    f.context.uc_stack.ss_sp = f.stack.data();
                    f.context.uc_stack.ss_size = f.stack.size();
                    f.context.uc_link = nullptr;
                    f.started = f.done = false;
                    makecontext(&f.context, trampoline, 0);
                }
                bool live = true;
                while (live) {
                    live = false;
                    for (unsigned i = 0; i < n; ++i) {
                        Fiber& f = pool[i];
                        if (f.done) continue;
                        live = true;
                        current = i;
                        thread_index = dim3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
                        if (_setjmp(scheduler) == 0) {
                            if (!f.started) {
                                f.started = true;
                                swapcontext(&scheduler_context, &f.context);
                            } else {
                                _longjmp(f.resume, 1);
                            }
                        }
                    }
                }
                check_shared_guard();
            }
    return fault.empty() ? nullptr : fault.c_str();
}

}  // namespace mila_emu

#define __global__
#define __align__(n) alignas(n)
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define threadIdx (mila_emu::thread_index)
#define blockIdx (mila_emu::block_index)
#define blockDim (mila_emu::block_dim)
#define gridDim (mila_emu::grid_dim)

inline void __syncthreads() { mila_emu::barrier(); }

template <typename T>
inline std::vector<T>& shuffle_exchange();
template <>
inline std::vector<float>& shuffle_exchange<float>() { return mila_emu::exchange; }
template <>
inline std::vector<double>& shuffle_exchange<double>() { return mila_emu::exchange_double; }

template <typename T>
inline T __shfl_xor_sync(unsigned int, T v, int lane_mask) {
    std::vector<T>& exchange = shuffle_exchange<T>();
    const unsigned me = threadIdx.x;
    exchange[me] = v;
    mila_emu::barrier();
    const T other = exchange[me ^ static_cast<unsigned>(lane_mask)];
    mila_emu::barrier();
    return other;
}

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
// CUDA's 16-byte vector type and its streaming-hint accesses (the hints change no value)
struct alignas(16) int4 { int x, y, z, w; };
inline int4 __ldcs(const int4* p) { return *p; }
inline int4 __ldg(const int4* p) { return *p; }  // the read-only cache path
inline void __stcs(int4* p, int4 v) { *p = v; }

inline float atomicAdd(float* address, float v) {
    const float old = *address;
    *address = old + v;
    return old;
}
