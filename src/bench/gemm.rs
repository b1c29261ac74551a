//! `megatron bench gemm`: GFLOP/s of the transformer's GEMM shapes next to the FMA peak.

use std::time::{Duration, Instant};

use megatron_core::kernels::parallel;
use megatron_core::ops::{cpu_bf16_products, matmul_into};
use megatron_core::tensor::{DType, Tensor};

use super::machine::{FmaPeak, fma_peaks, widest_peaks};

/// One GEMM shape of a training step.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct GemmShape {
    /// What the product is.
    pub name: &'static str,
    /// Rows of C.
    pub m: usize,
    /// Inner dimension.
    pub k: usize,
    /// Columns of C.
    pub n: usize,
    /// Whether A is read through a transposed view.
    pub trans_a: bool,
    /// Whether B is read through a transposed view.
    pub trans_b: bool,
}

/// The shapes the issue names: a square product and a GPT-2-small MLP layer (4096 tokens,
/// hidden 768, ffn 3072), forward and both backward products, with transposes as training
/// reads them.
pub const SHAPES: [GemmShape; 4] = [
    GemmShape {
        name: "square 1024³",
        m: 1024,
        k: 1024,
        n: 1024,
        trans_a: false,
        trans_b: false,
    },
    GemmShape {
        name: "fc1 forward  Y = X·Wᵀ",
        m: 4096,
        k: 768,
        n: 3072,
        trans_a: false,
        trans_b: true,
    },
    GemmShape {
        name: "fc1 backward dX = dY·W",
        m: 4096,
        k: 3072,
        n: 768,
        trans_a: false,
        trans_b: false,
    },
    GemmShape {
        name: "fc1 backward dW = dYᵀ·X",
        m: 3072,
        k: 4096,
        n: 768,
        trans_a: true,
        trans_b: false,
    },
];

/// A measured shape.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GemmResult {
    /// The shape.
    #[serde(flatten)]
    pub shape: GemmShape,
    /// `"f32"`, or `"bf16"`: the operands rounded to bf16, the sums in f32 (`--bf16`).
    pub precision: &'static str,
    /// GFLOP/s of the fastest run.
    pub gflops_best: f64,
    /// GFLOP/s of the median run.
    pub gflops_median: f64,
    /// Median GFLOP/s over the widest peak of the precision: f32 FMA, or bf16 pairs' where the
    /// CPU has them (else f32 FMA's).
    pub fraction_of_peak: f64,
    /// The kernel the product ran on (`"avx512 14×32"`, `"avx2+fma 6×16"`, `"matrixmultiply"`,
    /// `"avx512bf16 14×32"`).
    pub kernel: String,
}

/// The whole report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GemmReport {
    /// Threads the GEMMs and the peak measurement used.
    pub threads: usize,
    /// FMA peaks of every instruction set, measured with the same threads.
    pub peaks: Vec<FmaPeak>,
    /// One entry per shape.
    pub results: Vec<GemmResult>,
}

/// Operand `rows × cols` as the product reads it: a transposed view of a `cols × rows` tensor
/// when `transposed`.
fn operand(rows: usize, cols: usize, transposed: bool, seed: usize) -> anyhow::Result<Tensor> {
    let data: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7 + seed) % 13) as f32 / 13.0 - 0.5)
        .collect();
    Ok(if transposed {
        Tensor::from_vec(data, [cols, rows])?.t()?
    } else {
        Tensor::from_vec(data, [rows, cols])?
    })
}

/// Measures every shape with `threads` threads, `repeats` timed runs each after one warm-up.
pub fn run(threads: usize, repeats: usize) -> anyhow::Result<GemmReport> {
    let threads = threads.max(1);
    parallel::set_threads(threads);
    let peaks = fma_peaks(threads, Duration::from_millis(300), 3);
    let (f32_peak, bf16_peak) = widest_peaks(&peaks);
    let mut results = Vec::new();
    for bf16 in [false, true] {
        let _products = cpu_bf16_products(bf16);
        for shape in SHAPES {
            let a = operand(shape.m, shape.k, shape.trans_a, 1)?;
            let b = operand(shape.k, shape.n, shape.trans_b, 2)?;
            let c = Tensor::zeros([shape.m, shape.n], DType::F32);
            matmul_into(1.0, &a, &b, 0.0, &c)?;
            let mut times: Vec<f64> = (0..repeats.max(1))
                .map(|_| {
                    let start = Instant::now();
                    matmul_into(1.0, &a, &b, 0.0, &c).map(|()| start.elapsed().as_secs_f64())
                })
                .collect::<Result<_, _>>()?;
            times.sort_by(f64::total_cmp);
            let flops = 2.0 * (shape.m * shape.k * shape.n) as f64;
            let median = times[times.len() / 2];
            let peak = if bf16 { bf16_peak } else { f32_peak };
            results.push(GemmResult {
                shape,
                precision: if bf16 { "bf16" } else { "f32" },
                gflops_best: flops / times[0] / 1e9,
                gflops_median: flops / median / 1e9,
                fraction_of_peak: flops / median / 1e9 / peak,
                kernel: if bf16 {
                    megatron_core::kernels::gemm::bf16_kernel_name()
                } else {
                    megatron_core::kernels::gemm::kernel_name().to_string()
                },
            });
        }
    }
    Ok(GemmReport {
        threads,
        peaks,
        results,
    })
}

impl std::fmt::Display for GemmReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "GEMM, {} thread(s)", self.threads)?;
        for p in &self.peaks {
            let what = if p.bf16 { "bf16 dot peak" } else { "FMA peak" };
            writeln!(f, "  {what:<13} {:<10} {:>7.1} GFLOP/s", p.isa, p.gflops)?;
        }
        writeln!(
            f,
            "  {:<26} {:<4} {:>16} {:>9} {:>9} {:>8}  kernel",
            "shape", "", "m × k × n", "median", "best", "of peak"
        )?;
        for r in &self.results {
            let s = &r.shape;
            let dims = format!("{}×{}×{}", s.m, s.k, s.n);
            writeln!(
                f,
                "  {:<26} {:<4} {:>16} {:>9.1} {:>9.1} {:>7.1}%  {}",
                s.name,
                r.precision,
                dims,
                r.gflops_median,
                r.gflops_best,
                100.0 * r.fraction_of_peak,
                r.kernel
            )?;
        }
        write!(
            f,
            "  (GFLOP/s; 'of peak' is the median over the widest peak above of its precision: \
             bf16 products round their operands to bf16 and sum in f32, as --bf16 runs)"
        )
    }
}
