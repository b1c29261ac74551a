//! Every CUDA kernel program compiles with NVRTC for the GPUs megatron-rs targets. Needs only
//! libnvrtc (no GPU): CI installs NVIDIA's `nvidia-cuda-nvrtc` wheel and points
//! LD_LIBRARY_PATH at it.
#![cfg(feature = "cuda")]

use megatron_core::cuda::programs::{PROGRAMS, compile, kernel_names};

#[test]
fn every_program_compiles_for_hopper_and_ampere() {
    megatron_core::cuda::require_nvrtc().expect(
        "libnvrtc is needed to compile the kernels: install CUDA or `pip install nvidia-cuda-nvrtc` \
         and add its lib directory to LD_LIBRARY_PATH",
    );
    for arch in ["sm_90", "sm_80"] {
        for (name, source) in PROGRAMS {
            let ptx = compile(name, source, arch).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            for kernel in kernel_names(source) {
                assert!(
                    text.contains(&format!(".entry {kernel}(")),
                    "{name}.cu for {arch}: no entry {kernel} in the PTX"
                );
            }
        }
    }
}

#[test]
fn a_broken_source_is_an_error_with_nvrtcs_log() {
    megatron_core::cuda::require_nvrtc().expect("libnvrtc");
    let err = compile(
        "broken",
        "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        "sm_90",
    )
    .expect_err("does not compile");
    let msg = err.to_string();
    assert!(
        msg.contains("broken.cu") && msg.contains("undefined_name"),
        "{msg}"
    );
}
