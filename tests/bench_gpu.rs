//! `megatron bench gemm --device cuda`'s layer comparison runs both of its paths: a
//! column-parallel layer's forward with the bias added after the product and in cuBLASLt's
//! epilogue, on small sizes. Needs a GPU: `cargo test --features cuda --test bench_gpu --
//! --ignored`, or the emulated one (`MEGATRON_EMULATED_GPU=1`, see
//! `megatron-core/tests/emulated/device.rs`).
#![cfg(feature = "cuda")]

#[path = "../megatron-core/tests/emulated/device.rs"]
mod device;

use megatron::bench::gemm::GemmShape;
use megatron::gpu::gemm::biased_layer;
use megatron_core::cuda::Gpu;

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn the_biased_layer_bench_times_both_paths() {
    device::install_if_requested(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/megatron-core"
    )));
    let gpu = Gpu::new(0).expect("GPU 0");
    gpu.set_bf16_products(true);
    let shape = GemmShape {
        name: "small",
        m: 48,
        k: 32,
        n: 40,
        trans_a: false,
        trans_b: true,
    };
    let r = biased_layer(&gpu, shape, 1).expect("the layer bench");
    assert!(r.separate_ms > 0.0 && r.epilogue_ms > 0.0, "{r:?}");
    // The bench leaves the handle as the default has it.
    assert!(gpu.bias_epilogues());
}
