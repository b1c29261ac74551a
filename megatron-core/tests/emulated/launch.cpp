// megatron-rs's CUDA kernel programs compiled for the CPU with shim.h, and one entry point that
// launches a kernel by name with cuLaunchKernel's calling convention (an array of pointers to
// the arguments), so that tests run the kernels' own source without a GPU.
#include <cstring>
#include <mutex>
#include <utility>

#include "shim.h"

#include "common.cuh"
#include "dropout.cu"
#include "elementwise.cu"
#include "softmax.cu"

template <class... A, std::size_t... I>
void emu_call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <class... A>
void emu_run(void (*kernel)(A...), unsigned grid, unsigned block, void** args) {
    emu_launch(grid, block, [&] { emu_call(kernel, args, std::index_sequence_for<A...>{}); });
}

struct EmuKernel {
    const char* name;
    void (*run)(unsigned, unsigned, void**);
};

#define EMU_KERNEL(k) {#k, [](unsigned g, unsigned b, void** a) { emu_run(k, g, b, a); }}

static const EmuKernel EMU_KERNELS[] = {
    EMU_KERNEL(softmax_forward), EMU_KERNEL(softmax_backward), EMU_KERNEL(dropout_apply),
    EMU_KERNEL(f32_to_bf16),     EMU_KERNEL(copy_strided),
};

// Runs kernel `name` on `grid` blocks of `block` threads; 0, or -1 for an unknown name. One
// launch at a time (the emulated grid and its barriers are process-wide).
extern "C" int emu_launch_kernel(const char* name, unsigned grid, unsigned block, void** args) {
    static std::mutex one_at_a_time;
    const std::lock_guard<std::mutex> lock(one_at_a_time);
    for (const auto& k : EMU_KERNELS) {
        if (std::strcmp(k.name, name) == 0) {
            k.run(grid, block, args);
            return 0;
        }
    }
    return -1;
}
