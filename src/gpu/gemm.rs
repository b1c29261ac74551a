//! `megatron bench gemm --device cuda`: TFLOP/s of cuBLAS products (bf16 inputs, f32
//! accumulation and output, as training runs them) on the shapes of a GPT-1.2B step, next to
//! the GPU's dense bf16 peak; and a column-parallel linear layer's forward with its bias added
//! by a kernel after the product against cuBLASLt's bias epilogue.

use std::time::Instant;

use megatron_core::comm::ParallelState;
use megatron_core::cuda::Gpu;
use megatron_core::cuda::blas::{Blas, MatmulShape};
use megatron_core::module::{Builder, ColumnParallel, Cx, Site, params_to_gpu_with_copies};
use megatron_core::tensor::{DType, Tensor};
use megatron_core::tensor_parallel::{Linear, LinearSpec};

use crate::bench::gemm::GemmShape;

/// H100 SXM dense bf16 tensor-core peak, TFLOP/s (NVIDIA's data sheet, without sparsity).
pub const H100_SXM_BF16_TFLOPS: f64 = 989.0;

/// The shapes: the 8192³ product NVIDIA quotes, and a layer of hidden 2048 and ffn 8192 at
/// 8192 tokens (GPT-1.2B's is hidden 1536: see [`BIASED`]): the QKV and MLP products, forward
/// and backward.
pub const SHAPES: [GemmShape; 5] = [
    GemmShape {
        name: "square 8192³",
        m: 8192,
        k: 8192,
        n: 8192,
        trans_a: false,
        trans_b: false,
    },
    GemmShape {
        name: "qkv forward  Y = X·Wᵀ",
        m: 8192,
        k: 2048,
        n: 6144,
        trans_a: false,
        trans_b: true,
    },
    GemmShape {
        name: "fc1 forward  Y = X·Wᵀ",
        m: 8192,
        k: 2048,
        n: 8192,
        trans_a: false,
        trans_b: true,
    },
    GemmShape {
        name: "fc1 backward dX = dY·W",
        m: 8192,
        k: 8192,
        n: 2048,
        trans_a: false,
        trans_b: false,
    },
    GemmShape {
        name: "fc1 backward dW = dYᵀ·X",
        m: 8192,
        k: 8192,
        n: 2048,
        trans_a: true,
        trans_b: false,
    },
];

/// GPT-1.2B's column-parallel layers at micro-batch 4 × 2048 tokens (hidden 1536): the fused
/// QKV projection and the MLP's first layer, `Y = X·Wᵀ + b` with bf16 `X`, `W` and `Y`.
pub const BIASED: [GemmShape; 2] = [
    GemmShape {
        name: "qkv  Y = X·Wᵀ + b",
        m: 8192,
        k: 1536,
        n: 4608,
        trans_a: false,
        trans_b: true,
    },
    GemmShape {
        name: "fc1  Y = X·Wᵀ + b",
        m: 8192,
        k: 1536,
        n: 6144,
        trans_a: false,
        trans_b: true,
    },
];

/// A linear layer's forward measured both ways.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BiasedResult {
    /// The layer's product.
    #[serde(flatten)]
    pub shape: GemmShape,
    /// Median ms of the product (f32 out) then the bias kernel (bf16 out).
    pub separate_ms: f64,
    /// Median ms with bias epilogues on (bf16 out): one cuBLASLt product where it has an
    /// algorithm for the problem, else the same two kernels as `separate_ms`.
    pub epilogue_ms: f64,
    /// Whether cuBLASLt had an algorithm with the bias epilogue for this problem.
    pub epilogue_taken: bool,
}

/// A measured shape.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuGemmResult {
    /// The shape.
    #[serde(flatten)]
    pub shape: GemmShape,
    /// TFLOP/s of the median run.
    pub tflops_median: f64,
    /// Median over the peak.
    pub fraction_of_peak: f64,
}

/// The whole report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuGemmReport {
    /// The device's name.
    pub device: String,
    /// The peak the fractions refer to.
    pub peak_tflops: f64,
    /// One entry per shape.
    pub results: Vec<GpuGemmResult>,
    /// One entry per biased layer.
    pub biased: Vec<BiasedResult>,
}

/// The median of `repeats` timed batches of 10 runs of `step` (after a warm-up batch), in
/// seconds per run.
fn median_seconds(
    gpu: &Gpu,
    repeats: usize,
    mut step: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let mut times = Vec::new();
    for round in 0..=repeats.max(1) {
        gpu.synchronize()?;
        let start = Instant::now();
        for _ in 0..10 {
            step()?;
        }
        gpu.synchronize()?;
        if round > 0 {
            times.push(start.elapsed().as_secs_f64() / 10.0);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// A column-parallel layer's forward (one rank) on `gpu` in bf16, with its bias added after
/// the product and in the product's epilogue.
pub fn biased_layer(gpu: &Gpu, shape: GemmShape, repeats: usize) -> anyhow::Result<BiasedResult> {
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1);
    let mut b = Builder::for_rank(1, ps.groups());
    let mut layer = Linear::build_column(&LinearSpec::new(shape.k, shape.n), &mut b)?;
    // f32 values with bf16 compute copies, as a mixed-precision run keeps them.
    params_to_gpu_with_copies(&mut layer, gpu, Some(DType::BF16))?;
    let x = Tensor::zeros_on([shape.m, shape.k], DType::BF16, gpu)?;
    let time = |epilogue: bool| {
        gpu.set_bias_epilogues(epilogue);
        median_seconds(gpu, repeats, || {
            layer.forward_column(&cx, Site::ROOT, &x)?;
            Ok(())
        })
    };
    let separate = time(false)?;
    let epilogue = time(true)?;
    // The same problem asked of cuBLASLt directly: bf16 operands, an f32 bias, a bf16 output.
    let w = Tensor::zeros_on([shape.n, shape.k], DType::BF16, gpu)?;
    let bias = Tensor::zeros_on([shape.n], DType::F32, gpu)?;
    let out = Tensor::zeros_on([shape.m, shape.n], DType::BF16, gpu)?;
    let epilogue_taken = megatron_core::ops::matmul_bias_into(&x, &w.t()?, &bias, &out)?;
    Ok(BiasedResult {
        shape,
        separate_ms: separate * 1e3,
        epilogue_ms: epilogue * 1e3,
        epilogue_taken,
    })
}

/// Measures every shape on GPU 0, `repeats` timed batches of 10 products after a warm-up.
pub fn run(repeats: usize) -> anyhow::Result<GpuGemmReport> {
    let gpu = Gpu::new(0)?;
    let blas = Blas::new(&gpu)?;
    let device = gpu
        .context()
        .name()
        .unwrap_or_else(|_| "CUDA device 0".to_string());
    let mut results = Vec::new();
    for shape in SHAPES {
        let (m, n, k) = (shape.m, shape.n, shape.k);
        let a = gpu.zeros::<half::bf16>(m * k)?;
        let b = gpu.zeros::<half::bf16>(k * n)?;
        let mut c = gpu.zeros::<f32>(m * n)?;
        let product = MatmulShape {
            trans_a: shape.trans_a,
            trans_b: shape.trans_b,
            ..MatmulShape::new(m, n, k)
        };
        let median = median_seconds(&gpu, repeats, || {
            blas.matmul(product, &a.as_view(), &b.as_view(), &mut c.as_view_mut())?;
            Ok(())
        })?;
        let tflops = 2.0 * (m * n * k) as f64 / median / 1e12;
        results.push(GpuGemmResult {
            shape,
            tflops_median: tflops,
            fraction_of_peak: tflops / H100_SXM_BF16_TFLOPS,
        });
    }
    gpu.set_bf16_products(true);
    let biased = BIASED
        .into_iter()
        .map(|shape| biased_layer(&gpu, shape, repeats))
        .collect::<anyhow::Result<_>>()?;
    Ok(GpuGemmReport {
        device,
        peak_tflops: H100_SXM_BF16_TFLOPS,
        results,
        biased,
    })
}

impl std::fmt::Display for GpuGemmReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "cuBLAS bf16 → f32 products on {} (peak {:.0} TFLOP/s dense bf16):",
            self.device, self.peak_tflops
        )?;
        for r in &self.results {
            writeln!(
                f,
                "  {:<26} {:>5}×{:<5}×{:>5}  {:>7.1} TFLOP/s  {:>5.1}% of peak",
                r.shape.name,
                r.shape.m,
                r.shape.k,
                r.shape.n,
                r.tflops_median,
                100.0 * r.fraction_of_peak
            )?;
        }
        writeln!(
            f,
            "A column-parallel layer's forward, bf16 in and out (ms, TFLOP/s of the product):"
        )?;
        for r in &self.biased {
            let tflops = |ms: f64| 2.0 * (r.shape.m * r.shape.n * r.shape.k) as f64 / ms / 1e9;
            writeln!(
                f,
                "  {:<26} {:>5}×{:<5}×{:>5}  product then bias kernel {:.3} ms ({:.1})  \
                 epilogues on {:.3} ms ({:.1}){}",
                r.shape.name,
                r.shape.m,
                r.shape.k,
                r.shape.n,
                r.separate_ms,
                tflops(r.separate_ms),
                r.epilogue_ms,
                tflops(r.epilogue_ms),
                if r.epilogue_taken {
                    ", one cuBLASLt product"
                } else {
                    ": cuBLASLt had no algorithm, the same two kernels"
                },
            )?;
        }
        Ok(())
    }
}
