// megatron-rs's CUDA kernel programs compiled for the CPU with shim.h, and one entry point that
// launches a kernel by name with cuLaunchKernel's calling convention (an array of pointers to
// the arguments), so that tests run the kernels' own source without a GPU.
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "shim.h"

#include "common.cuh"
#include "adam.cu"
#include "cross_entropy.cu"
#include "dropout.cu"
#include "elementwise.cu"
#include "embedding.cu"
#include "flash_attention.cu"
#include "heads.cu"
#include "layer_norm.cu"
#include "moe.cu"
#include "reduce.cu"
#include "rotary.cu"
#include "softmax.cu"
#include "vocab_parallel.cu"

// A kernel for the race check's own test: thread t puts in[t] into word t of the dynamic
// shared memory (a plain store, or with `async` an asynchronous copy it waits for when `wait`),
// passes a barrier when `sync`, and reads its neighbour's word into out[t].
extern "C" __global__ void emu_race_check_neighbours(const u32* in, u32* out, int async, int wait,
                                                     int sync) {
    DYNAMIC_SHARED(smem_raw);
    u32* words = reinterpret_cast<u32*>(smem_raw);
    const unsigned t = threadIdx.x, n = blockDim.x;
    if (async) {
        copy_async<4>(smem(&words[t]), &in[t]);
        copies_commit();
        if (wait) copies_wait<0>();
    } else {
        shared_store(&words[t], in[t]);
    }
    if (sync) __syncthreads();
    out[t] = shared_load(&words[(t + 1) % n]);
    copies_wait<0>();
}

// A kernel for the deadlock check's own test: every thread but (with `early`) thread 0 waits
// at a barrier.
extern "C" __global__ void emu_deadlock_check(int early) {
    if (early && threadIdx.x == 0) return;
    __syncthreads();
}

#include "emu_kernel.h"

// Every kernel of the programs (programs.rs), by file, and the emulation's own; a program
// with a kernel missing here fails to load on the emulated GPU.
static const EmuKernel EMU_KERNELS[] = {
    EMU_KERNEL(adam_step),
    EMU_KERNEL(cross_entropy_check_targets),
    EMU_KERNEL(cross_entropy_forward),
    EMU_KERNEL(cross_entropy_backward),
    EMU_KERNEL(dropout_apply),
    EMU_KERNEL(philox_words),
    EMU_KERNEL(gelu_forward),
    EMU_KERNEL(gelu_backward),
    EMU_KERNEL(swiglu_forward),
    EMU_KERNEL(swiglu_backward),
    EMU_KERNEL(rope),
    EMU_KERNEL(expand_groups),
    EMU_KERNEL(reduce_groups),
    EMU_KERNEL(add),
    EMU_KERNEL(add_assign),
    EMU_KERNEL(fill),
    EMU_KERNEL(bias_add_forward),
    EMU_KERNEL(bias_add_cast),
    EMU_KERNEL(bias_add_backward),
    EMU_KERNEL(f32_to_bf16),
    EMU_KERNEL(bf16_to_f32),
    EMU_KERNEL(sum_squares_partials),
    EMU_KERNEL(unscale_and_check),
    EMU_KERNEL(copy_dense),
    EMU_KERNEL(copy_strided),
    EMU_KERNEL(copy_to_strided),
    EMU_KERNEL(fill_bits),
    EMU_KERNEL(embedding_forward),
    EMU_KERNEL(embedding_backward),
    EMU_KERNEL(flash_backward_prepare),
    EMU_KERNEL(flash_forward),
    EMU_KERNEL(flash_backward_kv),
    EMU_KERNEL(flash_backward_q),
    EMU_KERNEL(layer_norm_forward),
    EMU_KERNEL(layer_norm_backward_dx),
    EMU_KERNEL(layer_norm_backward_partials),
    EMU_KERNEL(layer_norm_backward_finalize),
    EMU_KERNEL(fold_f32),
    EMU_KERNEL(fold_bf16),
    EMU_KERNEL(fold_f16),
    EMU_KERNEL(fold_i64),
    EMU_KERNEL(softmax_forward),
    EMU_KERNEL(softmax_backward),
    EMU_KERNEL(vocab_parallel_ce_local),
    EMU_KERNEL(vocab_parallel_ce_sum_exp),
    EMU_KERNEL(vocab_parallel_ce_finish),
    EMU_KERNEL(vocab_parallel_ce_backward),
    EMU_KERNEL(vocab_parallel_mask_columns),
    EMU_KERNEL(position_ids),
    EMU_KERNEL(moe_route_topk),
    EMU_KERNEL(moe_route_keep),
    EMU_KERNEL(moe_route_counts),
    EMU_KERNEL(moe_aux_scores),
    EMU_KERNEL(moe_aux_counts),
    EMU_KERNEL(moe_logsumexp),
    EMU_KERNEL(moe_route_losses),
    EMU_KERNEL(moe_expert_slots),
    EMU_KERNEL(moe_column_counts),
    EMU_KERNEL(moe_chunk_order),
    EMU_KERNEL(moe_affine_index),
    EMU_KERNEL(moe_permute_rows),
    EMU_KERNEL(moe_route_backward),
    EMU_KERNEL(moe_slot_sum),
    EMU_KERNEL(moe_slot_dots),
    EMU_KERNEL(moe_slot_scale),
    EMU_KERNEL(emu_race_check_neighbours),
    EMU_KERNEL(emu_deadlock_check),
};

// The kernels of programs generated at run time (#[megatron::module]'s fused element-wise
// kernels), added when their module is loaded (device.cpp); never removed, so that pointers to
// them stay valid.
inline std::deque<EmuKernel> emu_generated;
inline std::mutex emu_generated_lock;

// Adds generated kernels.
inline void emu_add_kernels(const EmuKernel* kernels, int count) {
    const std::lock_guard<std::mutex> lock(emu_generated_lock);
    for (int i = 0; i < count; ++i) emu_generated.push_back(kernels[i]);
}

// The kernel called `name`, or null.
inline const EmuKernel* emu_find_kernel(const char* name) {
    for (const auto& k : EMU_KERNELS) {
        if (std::strcmp(k.name, name) == 0) return &k;
    }
    const std::lock_guard<std::mutex> lock(emu_generated_lock);
    for (const auto& k : emu_generated) {
        if (std::strcmp(k.name, name) == 0) return &k;
    }
    return nullptr;
}

// Runs `kernel`; 0, -2 when the race check found shared memory touched by two threads between
// the same two barriers, or -3 when a block deadlocked at a barrier: then `*report` is set to
// what was found (races one per line; malloc'd, for the caller to free). One launch at a time
// (the emulated grid and its barriers are process-wide).
inline int emu_run_kernel(const EmuKernel& kernel, const unsigned* grid, const unsigned* block,
                          void** args, char** report) {
    static std::mutex one_at_a_time;
    const std::lock_guard<std::mutex> lock(one_at_a_time);
    emu_take_races();
    const bool finished =
        kernel.run({grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, args);
    const std::string found = emu_take_races();
    if (!finished) {
        *report = strdup((emu_fault + "\n" + found).c_str());
        return -3;
    }
    if (found.empty()) return 0;
    *report = strdup(found.c_str());
    return -2;
}

// The tiles the flash-attention kernels walked on the calling thread so far.
extern "C" unsigned long long emu_tiles_walked_here() { return emu_tiles_walked; }

// Runs kernel `name` on a grid of grid[0..3] blocks of block[0..3] threads: what
// `emu_run_kernel` returns, or -1 for an unknown name.
extern "C" int emu_launch_kernel(const char* name, const unsigned* grid, const unsigned* block,
                                 void** args, char** report) {
    const EmuKernel* kernel = emu_find_kernel(name);
    return kernel ? emu_run_kernel(*kernel, grid, block, args, report) : -1;
}
