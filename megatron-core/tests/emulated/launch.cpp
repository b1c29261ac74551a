// megatron-rs's CUDA kernel programs compiled for the CPU with shim.h, and one entry point that
// launches a kernel by name with cuLaunchKernel's calling convention (an array of pointers to
// the arguments), so that tests run the kernels' own source without a GPU.
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "shim.h"

#include "common.cuh"
#include "adam.cu"
#include "cross_entropy.cu"
#include "dropout.cu"
#include "elementwise.cu"
#include "embedding.cu"
#include "flash_attention.cu"
#include "layer_norm.cu"
#include "reduce.cu"
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

template <class... A, std::size_t... I>
void emu_call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <class... A>
void emu_run(void (*kernel)(A...), emu_dim3 grid, emu_dim3 block, void** args) {
    emu_launch(grid, block, [&] { emu_call(kernel, args, std::index_sequence_for<A...>{}); });
}

struct EmuKernel {
    const char* name;
    void (*run)(emu_dim3, emu_dim3, void**);
};

#define EMU_KERNEL(k) {#k, [](emu_dim3 g, emu_dim3 b, void** a) { emu_run(k, g, b, a); }}

static const EmuKernel EMU_KERNELS[] = {
    EMU_KERNEL(softmax_forward),
    EMU_KERNEL(softmax_backward),
    EMU_KERNEL(dropout_apply),
    EMU_KERNEL(f32_to_bf16),
    EMU_KERNEL(copy_dense),
    EMU_KERNEL(copy_strided),
    EMU_KERNEL(gelu_forward),
    EMU_KERNEL(gelu_backward),
    EMU_KERNEL(bias_add_forward),
    EMU_KERNEL(bias_add_cast),
    EMU_KERNEL(adam_step),
    EMU_KERNEL(layer_norm_forward),
    EMU_KERNEL(layer_norm_backward_dx),
    EMU_KERNEL(layer_norm_backward_partials),
    EMU_KERNEL(layer_norm_backward_finalize),
    EMU_KERNEL(embedding_forward),
    EMU_KERNEL(embedding_backward),
    EMU_KERNEL(cross_entropy_check_targets),
    EMU_KERNEL(cross_entropy_forward),
    EMU_KERNEL(cross_entropy_backward),
    EMU_KERNEL(flash_forward),
    EMU_KERNEL(flash_backward_prepare),
    EMU_KERNEL(flash_backward_kv),
    EMU_KERNEL(flash_backward_q),
    EMU_KERNEL(emu_race_check_neighbours),
};

// Runs kernel `name` on a grid of grid[0..3] blocks of block[0..3] threads; 0, -1 for an
// unknown name, or -2 when the race check found shared memory touched by two threads between
// the same two barriers: then `*races` is set to the report (one race per line; malloc'd, for
// the caller to free). One launch at a time (the emulated grid and its barriers are
// process-wide).
extern "C" int emu_launch_kernel(const char* name, const unsigned* grid, const unsigned* block,
                                 void** args, char** races) {
    static std::mutex one_at_a_time;
    const std::lock_guard<std::mutex> lock(one_at_a_time);
    for (const auto& k : EMU_KERNELS) {
        if (std::strcmp(k.name, name) == 0) {
            emu_take_races();
            k.run({grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, args);
            const std::string found = emu_take_races();
            if (found.empty()) return 0;
            *races = strdup(found.c_str());
            return -2;
        }
    }
    return -1;
}
