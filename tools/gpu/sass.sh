#!/usr/bin/env bash
# The flash-attention kernels' machine code for sm_90, without a GPU: each kernel compiled by
# NVRTC (the options the CUDA backend uses) for one head size at a time, assembled by ptxas,
# disassembled by cuobjdump, and summed up per kernel and head size (registers, spills,
# instructions, and the main loop's instructions per tile: HMMA, MUFU, integer, float). A
# static count, not a timing: what a tile's loop issues, where the tensor cores need about one
# HMMA every 4 cycles per SM sub-partition.
#   tools/gpu/sass.sh                 # the working tree
#   tools/gpu/sass.sh --rev HEAD~3    # a commit's kernels, to compare
#   tools/gpu/sass.sh --dims 96 --ops flash_forward   # opcode counts of one loop
# Downloads NVIDIA's wheels (NVRTC and nvcc 13.0 as the GPU machines; cuobjdump and nvdisasm
# 13.2, the oldest on PyPI) into target/ on first use.
set -euo pipefail
cd "$(dirname "$0")/../.."
fetch() {  # fetch DIR PACKAGE-SPEC
    local dir="$1" spec="$2"
    [ -d "$dir/nvidia" ] && return
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
    python3 -m pip download --quiet --no-deps --dest "$dir.tmp" "$spec"
    python3 -m zipfile -e "$dir.tmp"/*.whl "$dir.tmp/unpacked"
    rm -rf "$dir" && mv "$dir.tmp/unpacked" "$dir" && rm -rf "$dir.tmp"
}
fetch target/nvrtc-13.0 "nvidia-cuda-nvrtc==13.0.*"
fetch target/cuda-tools/nvcc "nvidia-cuda-nvcc==13.0.*"
fetch target/cuda-tools/cuobjdump "nvidia-cuda-cuobjdump==13.2.86"
fetch target/cuda-tools/nvdisasm "nvidia-cuda-nvdisasm==13.2.86"
chmod +x target/cuda-tools/*/nvidia/cu13/bin/* 2>/dev/null || true
export NVRTC_LIB="$PWD/target/nvrtc-13.0/nvidia/cu13/lib/libnvrtc.so.13"
export LD_LIBRARY_PATH="$PWD/target/nvrtc-13.0/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PTXAS="$PWD/target/cuda-tools/nvcc/nvidia/cu13/bin/ptxas"
export CUOBJDUMP="$PWD/target/cuda-tools/cuobjdump/nvidia/cu13/bin/cuobjdump"
export NVDISASM_PATH="$PWD/target/cuda-tools/nvdisasm/nvidia/cu13/bin"
exec python3 tools/gpu/sass.py "$@"
