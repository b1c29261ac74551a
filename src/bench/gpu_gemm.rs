//! `megatron bench gemm --device cuda`: TFLOP/s of cuBLAS products (bf16 inputs, f32
//! accumulation and output, as training runs them) on the shapes of a GPT-1.2B step, next to
//! the GPU's dense bf16 peak.

use std::time::Instant;

use megatron_core::cuda::Gpu;
use megatron_core::cuda::blas::{Blas, MatmulShape};

use super::gemm::GemmShape;

/// H100 SXM dense bf16 tensor-core peak, TFLOP/s (NVIDIA's data sheet, without sparsity).
pub const H100_SXM_BF16_TFLOPS: f64 = 989.0;

/// The shapes: the 8192³ product NVIDIA quotes, and GPT-1.2B's layer at micro-batch 4 × 2048
/// tokens (hidden 2048, ffn 8192): the QKV, MLP and output products, forward and backward.
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
        let mut times = Vec::new();
        for round in 0..=repeats.max(1) {
            gpu.synchronize()?;
            let start = Instant::now();
            for _ in 0..10 {
                blas.matmul(product, &a.as_view(), &b.as_view(), &mut c.as_view_mut())?;
            }
            gpu.synchronize()?;
            if round > 0 {
                times.push(start.elapsed().as_secs_f64() / 10.0);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let tflops = 2.0 * (m * n * k) as f64 / median / 1e12;
        results.push(GpuGemmResult {
            shape,
            tflops_median: tflops,
            fraction_of_peak: tflops / H100_SXM_BF16_TFLOPS,
        });
    }
    Ok(GpuGemmReport {
        device,
        peak_tflops: H100_SXM_BF16_TFLOPS,
        results,
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
        Ok(())
    }
}
