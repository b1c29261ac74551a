// The CUDA execution model on the CPU, enough to run megatron-rs's kernel sources unchanged on a
// machine without a GPU (for tests): blocks run one after another on the launching thread, each
// CUDA thread of a block is a fiber (its own stack, switched to and from in user space), so that
// `__syncthreads` and the warp-wide operations suspend a thread until its block (warp) has
// arrived, as on a GPU. `__shared__` memory is a function-local static (shared by the one block
// running). A block whose threads wait at a barrier that the others never reach (they finished)
// is reported as a deadlock, where a GPU would hang. Compile with -ffp-contract=off, as NVRTC
// keeps the kernels' explicit roundings.
//
// Accesses to the dynamic shared memory that go through the shim (asynchronous copies, matrix
// loads, and the kernels' `emu_shared_read`/`emu_shared_write` hooks) are checked for races, as
// compute-sanitizer's racecheck does on a GPU: two threads of a block touching a byte between
// the same two barriers, at least one of them writing, is reported (`emu_take_races`). An
// asynchronous copy counts as writing its destination from the moment it starts until its
// thread waits for it, whatever barriers pass in between.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)
// Kernels that need another path under emulation (the tensor-core products) test this.
#define EMULATED_CUDA 1

struct emu_dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// The running fiber's indices (one block runs at a time, its fibers on one thread).
inline emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim, gridDim;
// The thread's index in its block, x fastest (what lanes and warps are counted in).
inline unsigned emu_tid;

struct float4 {
    float x, y, z, w;
};
struct uint4 {
    unsigned x, y, z, w;
};
struct uint2 {
    unsigned x, y;
};
struct float2 {
    float x, y;
};

inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

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
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __longlong_as_double(long long i) {
    double d;
    std::memcpy(&d, &i, 8);
    return d;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }

using std::isfinite;
using std::isnan;
using std::max;
using std::min;

inline void emu_next_epoch();

// The bytes of each fiber's stack.
constexpr std::size_t EMU_STACK_BYTES = 1 << 20;

// A suspended fiber (or the scheduler): where it goes on. On x86-64 a switch saves the
// callee-saved registers on the stack it leaves and keeps the stack pointer (the kernels never
// change the floating-point control words, so those are not switched); elsewhere it is
// ucontext's (whose switches also make a system call).
#if defined(__x86_64__)
struct EmuContext {
    void* sp = nullptr;
};
extern "C" void emu_switch_x86_64(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl emu_switch_x86_64
    .hidden emu_switch_x86_64
    .type emu_switch_x86_64, @function
emu_switch_x86_64:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_x86_64, .-emu_switch_x86_64
)");
// Saves the running context in `from` and resumes `to`.
inline void emu_switch(EmuContext& from, const EmuContext& to) { emu_switch_x86_64(&from.sp, to.sp); }
// A context that starts `entry` (which must never return) on the stack ending at `top`.
inline void emu_make_context(EmuContext& c, char* top, void (*entry)()) {
    // `entry` is "returned" to from the switch, with the stack as a call would leave it.
    auto* a = reinterpret_cast<std::uint64_t*>(
        (reinterpret_cast<std::uintptr_t>(top) - 16) & ~std::uintptr_t{15});
    a[0] = reinterpret_cast<std::uint64_t>(entry);
    a[1] = 0;
    std::uint64_t* sp = a - 6;  // r15..r12, rbx, rbp
    for (int i = 0; i < 6; ++i) sp[i] = 0;
    c.sp = sp;
}
#else
struct EmuContext {
    ucontext_t uc;
};
inline void emu_switch(EmuContext& from, const EmuContext& to) { swapcontext(&from.uc, &to.uc); }
inline void emu_make_context(EmuContext& c, char* top, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = top - EMU_STACK_BYTES;
    c.uc.uc_stack.ss_size = EMU_STACK_BYTES;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

// One CUDA thread of the running block: its context and whether it finished or waits at a
// barrier.
struct EmuFiber {
    EmuContext context;
    // The top of its stack, once started.
    char* stack = nullptr;
    bool done = false, waiting = false;
};
// A barrier of fibers: `expected` arrivals release it; `on_release` runs once, before any of
// them goes on.
struct EmuBarrier {
    unsigned expected = 0, arrived = 0;
    std::vector<unsigned> waiters;
    void (*on_release)() = nullptr;
};
inline std::vector<EmuFiber> emu_fibers;
// The scheduler's context (the launching thread's own stack), and the fiber running.
inline EmuContext emu_scheduler;
inline unsigned emu_running;

// Suspends the running fiber until the scheduler resumes it.
inline void emu_yield() { emu_switch(emu_fibers[emu_running].context, emu_scheduler); }

// The fibers ready to run, in order (a ring: each fiber is in it at most once).
inline std::vector<unsigned> emu_ready;
inline std::size_t emu_ready_head = 0, emu_ready_count = 0;

inline void emu_make_ready(unsigned fiber) {
    emu_ready[(emu_ready_head + emu_ready_count++) % emu_ready.size()] = fiber;
}

inline void emu_arrive_and_wait(EmuBarrier& b) {
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        if (b.on_release) b.on_release();
        for (unsigned w : b.waiters) {
            emu_fibers[w].waiting = false;
            emu_make_ready(w);
        }
        b.waiters.clear();
        return;
    }
    b.waiters.push_back(emu_running);
    emu_fibers[emu_running].waiting = true;
    emu_yield();
}

// The running block's barrier and its warps' exchange buffers and barriers. A warp-wide
// exchange of values (shuffle, ballot, tensor-core product) writes this lane's part, waits for
// the warp and reads the others': one barrier, as the buffers alternate between two copies (a
// lane can only come back to a copy after the next exchange's barrier, which every lane
// reaches after reading it).
struct EmuWarp {
    double lanes[2][32];
    // Every lane's fragments of a tensor-core product.
    unsigned mma_a[2][32][4], mma_b[2][32][2];
    // Which copy each lane's next exchange uses.
    unsigned char copy[32];
    // Every lane's row address of a shared-memory matrix load.
    const unsigned short* rows[32];
    EmuBarrier bar;
};
inline EmuBarrier emu_block_barrier;
inline std::vector<EmuWarp> emu_warps;

inline void __syncthreads() { emu_arrive_and_wait(emu_block_barrier); }

// The copy of the exchange buffers this lane's next exchange uses (see EmuWarp).
inline unsigned emu_exchange_copy(EmuWarp& w, unsigned lane) {
    const unsigned c = w.copy[lane];
    w.copy[lane] = (unsigned char)(c ^ 1);
    return c;
}

template <class T>
inline T emu_shfl_xor(T v, int lane_mask) {
    const unsigned lane = emu_tid % 32;
    EmuWarp& w = emu_warps[emu_tid / 32];
    const unsigned c = emu_exchange_copy(w, lane);
    w.lanes[c][lane] = (double)v;
    emu_arrive_and_wait(w.bar);
    return (T)w.lanes[c][lane ^ (unsigned)lane_mask];
}
inline float __shfl_xor_sync(unsigned, float v, int m) { return emu_shfl_xor(v, m); }
inline double __shfl_xor_sync(unsigned, double v, int m) { return emu_shfl_xor(v, m); }
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int m) { return emu_shfl_xor(v, m); }

// Bit i set when lane i's predicate holds (every lane of a full warp takes part).
inline unsigned __ballot_sync(unsigned, int predicate) {
    const unsigned lane = emu_tid % 32, first = emu_tid - lane;
    const unsigned threads = blockDim.x * blockDim.y * blockDim.z;
    EmuWarp& w = emu_warps[emu_tid / 32];
    const unsigned c = emu_exchange_copy(w, lane);
    w.lanes[c][lane] = predicate != 0 ? 1.0 : 0.0;
    emu_arrive_and_wait(w.bar);
    unsigned bits = 0;
    for (unsigned i = 0; i < 32 && first + i < threads; ++i) {
        if (w.lanes[c][i] != 0.0) bits |= 1u << i;
    }
    return bits;
}

// The block's dynamic shared memory (blocks run one at a time): as much as a Hopper SM has.
alignas(16) inline unsigned char emu_dynamic_shared[232448];

// The race check's record of one byte of dynamic shared memory: the last interval between
// barriers (epoch) in which it was written and by which thread, and the last in which it was
// read and by which thread (EMU_READERS when by several).
struct EmuShadow {
    unsigned long long write_epoch = 0, read_epoch = 0;
    int writer = -1, reader = -1;
};
constexpr int EMU_READERS = -2;
// Reports kept per launch (the first ones; later races are counted).
constexpr std::size_t EMU_MAX_REPORTS = 4;

inline std::mutex emu_shadow_lock;
inline std::vector<EmuShadow> emu_shadow(sizeof emu_dynamic_shared);
// The current interval between barriers: it grows with every barrier and every block, so that
// records of earlier intervals and blocks never meet the current one.
inline unsigned long long emu_epoch = 0;
// The current block's first epoch (to number its barriers in reports).
inline unsigned long long emu_block_epoch = 0;
inline std::vector<std::string> emu_race_reports;
inline std::size_t emu_races_found = 0;

// Records that thread `tid` reads (or writes) `bytes` bytes at `p`; reports a race when another
// thread wrote them (or read or wrote them) since the last barrier. Addresses outside the
// dynamic shared memory are not checked.
inline void emu_shared_access(const void* p, std::size_t bytes, bool write, int tid) {
    const auto* at = static_cast<const unsigned char*>(p);
    if (at < emu_dynamic_shared || at + bytes > emu_dynamic_shared + sizeof emu_dynamic_shared) {
        return;
    }
    const std::size_t offset = at - emu_dynamic_shared;
    const std::lock_guard<std::mutex> lock(emu_shadow_lock);
    bool reported = false;
    for (std::size_t i = 0; i < bytes; ++i) {
        EmuShadow& b = emu_shadow[offset + i];
        std::string other;
        if (b.write_epoch == emu_epoch && b.writer != tid) {
            other = "written by thread " + std::to_string(b.writer);
        } else if (write && b.read_epoch == emu_epoch && b.reader != tid) {
            other = b.reader == EMU_READERS ? std::string("read by several threads")
                                            : "read by thread " + std::to_string(b.reader);
        }
        if (!other.empty() && !reported) {
            reported = true;
            if (emu_races_found++ < EMU_MAX_REPORTS) {
                emu_race_reports.push_back(
                    "block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) +
                    ", " + std::to_string(blockIdx.z) + "), after barrier " +
                    std::to_string(emu_epoch - emu_block_epoch) + ": shared byte " +
                    std::to_string(offset + i) + " " + other + " and " +
                    (write ? "written" : "read") + " by thread " + std::to_string(tid) +
                    " with no barrier between");
            }
        }
        if (write) {
            b.write_epoch = emu_epoch;
            b.writer = tid;
        } else if (b.read_epoch != emu_epoch) {
            b.read_epoch = emu_epoch;
            b.reader = tid;
        } else if (b.reader != tid) {
            b.reader = EMU_READERS;
        }
    }
}

// The kernels' hooks: this thread reads (writes) `bytes` bytes of shared memory at `p`.
inline void emu_shared_read(const void* p, std::size_t bytes) {
    emu_shared_access(p, bytes, false, (int)emu_tid);
}
inline void emu_shared_write(const void* p, std::size_t bytes) {
    emu_shared_access(p, bytes, true, (int)emu_tid);
}

// The races reported since the last call, one line each (empty when none), and how many
// there were in all.
inline std::string emu_take_races() {
    std::string out;
    for (const std::string& r : emu_race_reports) out += r + "\n";
    if (emu_races_found > emu_race_reports.size()) {
        out += std::to_string(emu_races_found - emu_race_reports.size()) + " more\n";
    }
    emu_race_reports.clear();
    emu_races_found = 0;
    return out;
}

// d += a·b for one warp-wide m16n8k16 product of bf16 fragments with f32 accumulation
// (mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32), the fragments laid out over the lanes
// as the PTX ISA specifies (lane = 4g + t): A[r][c] is half (c & 1) of register
// (r >= 8) + 2·(c >= 8) of lane 4·(r % 8) + (c % 8) / 2; B[k][n] is half (k & 1) of register
// (k >= 8) of lane 4n + (k % 8) / 2; lane 4g + t holds D[g][2t, 2t+1] and D[g+8][2t, 2t+1].
// Every lane of the warp must call it.
inline void emu_mma_m16n8k16_bf16(float* d, const unsigned* a, const unsigned* b) {
    const unsigned lane = emu_tid % 32;
    EmuWarp& w = emu_warps[emu_tid / 32];
    const unsigned copy = emu_exchange_copy(w, lane);
    for (int i = 0; i < 4; ++i) w.mma_a[copy][lane][i] = a[i];
    for (int i = 0; i < 2; ++i) w.mma_b[copy][lane][i] = b[i];
    emu_arrive_and_wait(w.bar);
    const auto bf16 = [](unsigned reg, int half) {
        return __uint_as_float(((reg >> (16 * half)) & 0xffffu) << 16);
    };
    const auto A = [&](int r, int c) {
        return bf16(w.mma_a[copy][4 * (r % 8) + (c % 8) / 2][(r >= 8) + 2 * (c >= 8)], c & 1);
    };
    const auto B = [&](int k, int n) {
        return bf16(w.mma_b[copy][4 * n + (k % 8) / 2][k >= 8], k & 1);
    };
    const int g = (int)lane >> 2, t = (int)lane & 3;
    float out[4];
    for (int c = 0; c < 4; ++c) {
        const int row = g + 8 * (c >> 1), col = 2 * t + (c & 1);
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
        out[c] = d[c] + sum;
    }
    for (int c = 0; c < 4; ++c) d[c] = out[c];
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: four 8×8 matrices of 16-bit elements,
// lanes 8i .. 8i + 7 giving the addresses of matrix i's rows 0..7; lane 4g + t receives in r[i]
// the elements (g, 2t) and (g, 2t + 1) of matrix i, or with `trans` (2t, g) and (2t + 1, g).
// Every lane of the warp must call it. Unlike the value exchanges it waits for the warp twice:
// it reads shared memory, and no lane may go on (and store there) before every lane has read,
// as none can past one warp instruction on a GPU.
inline void emu_ldmatrix_x4(unsigned* r, const void* p, bool trans) {
    const unsigned lane = emu_tid % 32;
    EmuWarp& w = emu_warps[emu_tid / 32];
    w.rows[lane] = static_cast<const unsigned short*>(p);
    emu_shared_read(p, 16);
    emu_arrive_and_wait(w.bar);
    const unsigned g = lane >> 2, t = lane & 3;
    unsigned out[4];
    for (int i = 0; i < 4; ++i) {
        const unsigned short* const* m = &w.rows[8 * i];
        const unsigned lo = trans ? m[2 * t][g] : m[g][2 * t];
        const unsigned hi = trans ? m[2 * t + 1][g] : m[g][2 * t + 1];
        out[i] = lo | (hi << 16);
    }
    emu_arrive_and_wait(w.bar);
    for (int i = 0; i < 4; ++i) r[i] = out[i];
}

// Tiles the flash-attention kernels walked on this host thread (count_tile in
// flash_attention.cu; a block's fibers run on the thread that launched it), read with
// megatron_emu_launches().
inline thread_local unsigned long long emu_tiles_walked = 0;
inline void emu_count_tile() { ++emu_tiles_walked; }

// cp.async: a thread's copies from global to shared memory, grouped by commit_group. They
// land as late as wait_group allows (when it is called), so that a kernel reading a tile
// before waiting for it reads stale data here as it could on a GPU. Until then the race check
// counts their destinations as written by their thread in every interval between barriers.
struct EmuCopy {
    void* dst;
    const void* src;
    int bytes;
};
struct EmuThreadCopies {
    std::vector<EmuCopy> open;
    std::deque<std::vector<EmuCopy>> groups;
};
// Every thread's copies in flight (slot `emu_tid`), set up per block.
inline std::vector<EmuThreadCopies> emu_copies;

inline void emu_cp_async(void* dst, const void* src, int bytes) {
    emu_shared_write(dst, bytes);
    emu_copies[emu_tid].open.push_back({dst, src, bytes});
}
inline void emu_cp_async_commit() {
    EmuThreadCopies& c = emu_copies[emu_tid];
    c.groups.push_back(std::move(c.open));
    c.open.clear();
}
// Completes every group but the newest `pending`.
inline void emu_cp_async_wait(int pending) {
    EmuThreadCopies& mine = emu_copies[emu_tid];
    while ((int)mine.groups.size() > pending) {
        for (const EmuCopy& c : mine.groups.front()) {
            emu_shared_write(c.dst, c.bytes);
            std::memcpy(c.dst, c.src, c.bytes);
        }
        mine.groups.pop_front();
    }
}

// The next interval between barriers of the running block (every thread waits in the barrier):
// copies still in flight write their destinations in it too.
inline void emu_next_epoch() {
    ++emu_epoch;
    for (std::size_t tid = 0; tid < emu_copies.size(); ++tid) {
        const EmuThreadCopies& c = emu_copies[tid];
        for (const EmuCopy& copy : c.open) emu_shared_access(copy.dst, copy.bytes, true, (int)tid);
        for (const auto& group : c.groups) {
            for (const EmuCopy& copy : group) {
                emu_shared_access(copy.dst, copy.bytes, true, (int)tid);
            }
        }
    }
}

// Atomics: one lock for all (the emulation's threads of a block run concurrently).
inline std::mutex emu_atomics;
template <class T>
inline T atomicMin(T* address, T value) {
    const std::lock_guard<std::mutex> lock(emu_atomics);
    const T old = *address;
    if (value < old) *address = value;
    return old;
}

// Fiber stacks (their tops), kept from launch to launch (mapped on demand, only touched pages
// are backed). A fiber takes one when it starts and gives it back when it finishes, so that a
// kernel without barriers runs every thread on the same, cache-warm stack.
inline std::vector<char*> emu_free_stacks;
inline const std::function<void()>* emu_kernel;

// Maps one more stack into the free ones; false when there is no memory.
inline bool emu_new_stack() {
    // Each stack grows down towards an unmapped page: an overflow stops the process.
    const std::size_t guard = 1 << 16;
    auto* base = static_cast<char*>(mmap(nullptr, EMU_STACK_BYTES + guard,
                                         PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (base == MAP_FAILED) return false;
    mprotect(base, guard, PROT_NONE);
    emu_free_stacks.push_back(base + guard + EMU_STACK_BYTES);
    return true;
}

// A fiber's life: the kernel, then back to the scheduler for good.
inline void emu_fiber_main() {
    (*emu_kernel)();
    emu_fibers[emu_running].done = true;
    emu_yield();
}

// Each thread's index in its block, by its number (x fastest).
inline std::vector<emu_dim3> emu_thread_index;

// Why the last launch stopped early (a deadlock), empty when it ran to the end.
inline std::string emu_fault;

// Runs `kernel` (a call of one kernel with its arguments bound) over a grid of `grid` blocks of
// `block` threads (x fastest, as CUDA numbers them); false, with `emu_fault` set, when a block's
// threads wait at a barrier the others never reach (the rest of the grid does not run).
inline bool emu_launch(emu_dim3 grid, emu_dim3 block, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = block;
    emu_fault.clear();
    emu_kernel = &kernel;
    const unsigned threads = block.x * block.y * block.z;
    const unsigned warps = (threads + 31) / 32;
    emu_thread_index.resize(threads);
    for (unsigned t = 0; t < threads; ++t) {
        emu_thread_index[t] = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
    }
    for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                // The block's state, reset in place (its buffers are reused block to block).
                emu_block_barrier.expected = threads;
                emu_block_barrier.arrived = 0;
                emu_block_barrier.waiters.clear();
                emu_block_barrier.on_release = [] { emu_next_epoch(); };
                emu_copies.resize(threads);
                for (EmuThreadCopies& c : emu_copies) {
                    c.open.clear();
                    c.groups.clear();
                }
                emu_block_epoch = ++emu_epoch;
                emu_warps.resize(warps);
                for (unsigned w = 0; w < warps; ++w) {
                    emu_warps[w].bar.expected = std::min(32u, threads - 32 * w);
                    emu_warps[w].bar.arrived = 0;
                    emu_warps[w].bar.waiters.clear();
                    std::fill(std::begin(emu_warps[w].copy), std::end(emu_warps[w].copy), 0);
                }
                emu_fibers.assign(threads, EmuFiber{});
                // Each ready thread in turn runs until it finishes or waits at a barrier (and
                // is made ready again when the barrier releases it).
                blockIdx = {bx, by, bz};
                emu_ready.resize(threads);
                emu_ready_head = 0;
                emu_ready_count = 0;
                for (unsigned t = 0; t < threads; ++t) emu_make_ready(t);
                unsigned finished = 0;
                while (emu_ready_count > 0) {
                    const unsigned t = emu_ready[emu_ready_head];
                    emu_ready_head = (emu_ready_head + 1) % threads;
                    --emu_ready_count;
                    EmuFiber& f = emu_fibers[t];
                    if (!f.stack) {
                        if (emu_free_stacks.empty() && !emu_new_stack()) {
                            emu_fault = "no memory for another thread stack";
                            return false;
                        }
                        f.stack = emu_free_stacks.back();
                        emu_free_stacks.pop_back();
                        emu_make_context(f.context, f.stack, emu_fiber_main);
                    }
                    emu_running = emu_tid = t;
                    threadIdx = emu_thread_index[t];
                    emu_switch(emu_scheduler, f.context);
                    if (f.done) {
                        emu_free_stacks.push_back(f.stack);
                        ++finished;
                    }
                }
                if (finished < threads) {
                    for (const EmuFiber& f : emu_fibers) {
                        // Abandoned: its stack is free again.
                        if (f.waiting) emu_free_stacks.push_back(f.stack);
                    }
                    emu_fault = "block (" + std::to_string(bx) + ", " + std::to_string(by) + ", " +
                                std::to_string(bz) + "): " + std::to_string(threads - finished) +
                                " of " + std::to_string(threads) +
                                " threads wait at a barrier the others never reach "
                                "(they finished): a GPU would hang";
                    return false;
                }
            }
        }
    }
    return true;
}
