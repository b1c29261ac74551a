// The CUDA execution model on CPU threads, enough to run megatron-rs's kernel sources unchanged
// on a machine without a GPU (for tests): a block is one OS thread per CUDA thread, blocks run
// one after another, `__shared__` memory is a function-local static (shared by the one block
// running), `__syncthreads` a barrier of the block, and warp shuffles exchange through a
// per-warp buffer between two barriers of the warp. Compile with -ffp-contract=off, as NVRTC
// keeps the kernels' explicit roundings.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static

struct emu_dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim, gridDim;

struct float4 {
    float x, y, z, w;
};
struct uint4 {
    unsigned x, y, z, w;
};
struct uint2 {
    unsigned x, y;
};

inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }
inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
inline float __fmul_rn(float a, float b) { return a * b; }

using std::isnan;
using std::max;
using std::min;

// The running block's barrier and its warps' exchange buffers and barriers.
struct EmuWarp {
    double lanes[32];
    std::unique_ptr<std::barrier<>> bar;
};
inline std::unique_ptr<std::barrier<>> emu_block_barrier;
inline std::vector<EmuWarp> emu_warps;

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

template <class T>
inline T emu_shfl_xor(T v, int lane_mask) {
    const unsigned lane = threadIdx.x % 32;
    EmuWarp& w = emu_warps[threadIdx.x / 32];
    w.lanes[lane] = (double)v;
    w.bar->arrive_and_wait();
    const T r = (T)w.lanes[lane ^ (unsigned)lane_mask];
    w.bar->arrive_and_wait();
    return r;
}
inline float __shfl_xor_sync(unsigned, float v, int m) { return emu_shfl_xor(v, m); }
inline double __shfl_xor_sync(unsigned, double v, int m) { return emu_shfl_xor(v, m); }

// Runs `kernel` (a call of one kernel with its arguments bound) over a grid of `grid` blocks of
// `block` threads (1-D; `block` a multiple of 32 when the kernel uses warp functions).
inline void emu_launch(unsigned grid, unsigned block, const std::function<void()>& kernel) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    const unsigned warps = (block + 31) / 32;
    for (unsigned b = 0; b < grid; ++b) {
        emu_block_barrier = std::make_unique<std::barrier<>>(block);
        emu_warps = std::vector<EmuWarp>(warps);
        for (unsigned w = 0; w < warps; ++w) {
            emu_warps[w].bar = std::make_unique<std::barrier<>>(std::min(32u, block - 32 * w));
        }
        std::vector<std::thread> threads;
        threads.reserve(block);
        for (unsigned t = 0; t < block; ++t) {
            threads.emplace_back([=, &kernel] {
                threadIdx = {t, 0, 0};
                blockIdx = {b, 0, 0};
                kernel();
            });
        }
        for (auto& th : threads) th.join();
    }
}
