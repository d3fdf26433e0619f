// A CPU emulator for the raw CUDA kernels of mila_py/ops/cuda (tests only).
//
// The kernel sources compile unchanged as C++: every block runs its threads as fibers
// (ucontext stacks, switched with _setjmp/_longjmp) on one OS thread, round-robin; __syncthreads() switches to the next fiber, so all
// threads of a block reach a barrier before any passes it. Warp shuffles exchange values
// through a block-wide buffer between two barriers, which is exact when every thread of the
// block calls the shuffle (as the block reductions of CUDA_PRELUDE do). Shared memory is a
// function-static array (blocks run one after another). Float intrinsics are plain IEEE
// operations (compile with -ffp-contract=off); atomics are plain read-modify-writes.
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
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

inline void barrier() {
    if (_setjmp(pool[current].resume) == 0) _longjmp(scheduler, 1);
}

inline void trampoline() {
    (*body)();
    pool[current].done = true;
    _longjmp(scheduler, 1);  // never returns: the scheduler's frame is the one that set it
}

inline void launch(dim3 grid, dim3 block, const std::function<void()>& kernel_call) {
    const unsigned n = block.x * block.y * block.z;
    if (pool.size() < n) pool.resize(n);
    for (unsigned i = 0; i < n; ++i) {
        if (pool[i].stack.empty()) pool[i].stack.resize(1 << 15);
    }
    body = &kernel_call;
    grid_dim = grid;
    block_dim = block;
    exchange.assign(n, 0.0f);
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                block_index = dim3{bx, by, bz};
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
            }
}

}  // namespace mila_emu

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(n)
#define threadIdx (mila_emu::thread_index)
#define blockIdx (mila_emu::block_index)
#define blockDim (mila_emu::block_dim)
#define gridDim (mila_emu::grid_dim)

inline void __syncthreads() { mila_emu::barrier(); }

inline float __shfl_xor_sync(unsigned int, float v, int lane_mask) {
    const unsigned me = threadIdx.x;
    mila_emu::exchange[me] = v;
    mila_emu::barrier();
    const float other = mila_emu::exchange[me ^ static_cast<unsigned>(lane_mask)];
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
inline float atomicAdd(float* address, float v) {
    const float old = *address;
    *address = old + v;
    return old;
}
