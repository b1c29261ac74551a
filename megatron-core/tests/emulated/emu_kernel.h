// A kernel of the emulated GPU: its name, how to run it on an emulated grid with
// cuLaunchKernel's arguments (an array of pointers to them), and its parameters' sizes and
// kinds (what a graph keeps of a launch). Shared by launch.cpp's table of the programs' kernels
// and by the kernels generated at run time (device.cpp compiles those when their module loads).
// Included after shim.h.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

template <class... A, std::size_t... I>
void emu_call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <class... A>
bool emu_run(void (*kernel)(A...), emu_dim3 grid, emu_dim3 block, void** args) {
    return emu_launch(grid, block,
                      [&] { emu_call(kernel, args, std::index_sequence_for<A...>{}); });
}

// The sizes of a kernel's parameters, in order (what a graph keeps of a launch's arguments).
template <class... A>
std::vector<std::size_t> emu_param_sizes(void (*)(A...)) {
    return {sizeof(std::remove_reference_t<A>)...};
}

// What a kernel does with a parameter of type `A`: 0 not a pointer, 1 reads through it (a
// pointer to const), 2 may write through it; 3 (4) a table of pointers it reads (writes)
// through.
template <class A>
constexpr int emu_param_kind() {
    if constexpr (!std::is_pointer_v<A>) {
        return 0;
    } else {
        using T = std::remove_pointer_t<A>;
        if constexpr (std::is_pointer_v<std::remove_cv_t<T>>) {
            return std::is_const_v<std::remove_pointer_t<std::remove_cv_t<T>>> ? 3 : 4;
        } else {
            return std::is_const_v<T> ? 1 : 2;
        }
    }
}

template <class... A>
std::vector<int> emu_param_kinds(void (*)(A...)) {
    return {emu_param_kind<A>()...};
}

struct EmuKernel {
    const char* name;
    bool (*run)(emu_dim3, emu_dim3, void**);
    std::vector<std::size_t> (*param_sizes)();
    std::vector<int> (*param_kinds)();
};

#define EMU_KERNEL(k)                                                              \
    {#k, [](emu_dim3 g, emu_dim3 b, void** a) { return emu_run(k, g, b, a); }, \
     [] { return emu_param_sizes(k); }, [] { return emu_param_kinds(k); }}

