//! `megatron bench grouped-gemm`: GFLOP/s of the MoE experts' grouped product next to one dense
//! product of the same size and to a loop of one product per expert, with the FMA peak; and the
//! grouped product as a `--bf16` run multiplies (operands rounded to bf16), with the bf16 peak.

use std::time::{Duration, Instant};

use megatron_core::kernels::gemm::{Group, MatMut, MatRef, gemm, grouped_gemm, grouped_gemm_bf16};
use megatron_core::kernels::parallel;

use super::machine::{FmaPeak, fma_peaks, widest_peaks};

/// The experts' first product, `Y_e = X_e · W_eᵀ` for each expert e: rows routed to it by a
/// router (uneven), `k` hidden values in, `n` out.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ExpertsShape {
    /// Rows of each expert.
    pub rows: Vec<usize>,
    /// The inner dimension (hidden size).
    pub k: usize,
    /// Columns of each product (an expert's ffn size).
    pub n: usize,
}

impl ExpertsShape {
    /// `total` rows spread over experts in proportion to `weights`, `k` in and `n` out.
    fn spread(total: usize, weights: &[f64], k: usize, n: usize) -> Self {
        let sum: f64 = weights.iter().sum();
        let mut rows: Vec<usize> = weights
            .iter()
            .map(|w| (w / sum * total as f64) as usize)
            .collect();
        rows[0] += total - rows.iter().sum::<usize>();
        ExpertsShape { rows, k, n }
    }

    /// 4096 tokens routed top-2 over 8 experts of a GPT-2-small-sized MLP (hidden 768, ffn 3072),
    /// as unevenly as a router early in training spreads them (from 1.6× to 0.5× the mean).
    pub fn gpt2_small_top2() -> Self {
        let weights = [1.6, 1.3, 1.1, 1.0, 0.9, 0.8, 0.8, 0.5];
        ExpertsShape::spread(4096 * 2, &weights, 768, 3072)
    }

    /// Fine-grained experts (as DeepSeek-style MoE layers have): 4096 tokens routed top-8 over
    /// 64 experts of ffn 384 at hidden 768, from 1.6× to 0.4× the mean.
    pub fn fine_grained_top8() -> Self {
        let weights: Vec<f64> = (0..64).map(|e| 1.6 - 1.2 * e as f64 / 63.0).collect();
        ExpertsShape::spread(4096 * 8, &weights, 768, 384)
    }

    fn flops(&self) -> f64 {
        2.0 * (self.rows.iter().sum::<usize>() * self.k * self.n) as f64
    }
}

/// One way of running the products, measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Variant {
    /// What ran.
    pub name: &'static str,
    /// GFLOP/s of the median run.
    pub gflops_median: f64,
    /// GFLOP/s of the fastest run.
    pub gflops_best: f64,
    /// Median over the widest FMA peak.
    pub fraction_of_peak: f64,
}

/// One shape's measurements.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ShapeResult {
    /// The experts' shapes.
    pub shape: ExpertsShape,
    /// The grouped product, a loop of products, and one dense product of the same size.
    pub variants: Vec<Variant>,
}

/// The whole report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GroupedGemmReport {
    /// Threads of the products and the peak.
    pub threads: usize,
    /// FMA peaks measured with the same threads.
    pub peaks: Vec<FmaPeak>,
    /// Each shape's measurements.
    pub results: Vec<ShapeResult>,
}

fn values(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + seed) % 13) as f32 / 13.0 - 0.5)
        .collect()
}

/// Median and best seconds of `repeats` runs of `f` after one warm-up.
fn time(repeats: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<(f64, f64)> {
    f()?;
    let mut times = Vec::with_capacity(repeats.max(1));
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], times[0]))
}

/// Measures both shapes three ways with `threads` threads, `repeats` timed runs each.
pub fn run(threads: usize, repeats: usize) -> anyhow::Result<GroupedGemmReport> {
    let threads = threads.max(1);
    parallel::set_threads(threads);
    let peaks = fma_peaks(threads, Duration::from_millis(300), 3);
    let peak = widest_peaks(&peaks);
    let results = [
        ExpertsShape::gpt2_small_top2(),
        ExpertsShape::fine_grained_top8(),
    ]
    .into_iter()
    .map(|shape| measure(shape, repeats, peak))
    .collect::<anyhow::Result<_>>()?;
    Ok(GroupedGemmReport {
        threads,
        peaks,
        results,
    })
}

/// The experts' product of `shape` three ways in f32, and grouped in bf16; `peak`: the f32 and
/// the bf16 peaks.
fn measure(shape: ExpertsShape, repeats: usize, peak: (f64, f64)) -> anyhow::Result<ShapeResult> {
    let (k, n, e) = (shape.k, shape.n, shape.rows.len());
    let total: usize = shape.rows.iter().sum();
    let x = values(total * k, 1);
    let w = values(e * n * k, 2);
    let mut y = vec![0.0f32; total * n];
    let starts: Vec<usize> = shape
        .rows
        .iter()
        .scan(0, |at, &r| {
            let s = *at;
            *at += r;
            Some(s)
        })
        .collect();
    let mut variants = Vec::new();
    let mut record = |name, (median, best): (f64, f64), peak: f64| {
        variants.push(Variant {
            name,
            gflops_median: shape.flops() / median / 1e9,
            gflops_best: shape.flops() / best / 1e9,
            fraction_of_peak: shape.flops() / median / 1e9 / peak,
        })
    };
    let mut grouped = |bf16: bool| {
        time(repeats, || {
            let mut groups = Vec::with_capacity(e);
            let mut rest: &mut [f32] = &mut y;
            for (g, (&r, &s)) in shape.rows.iter().zip(&starts).enumerate() {
                let (c, tail) = std::mem::take(&mut rest).split_at_mut(r * n);
                rest = tail;
                groups.push(Group {
                    a: MatRef::row_major(&x[s * k..(s + r) * k], r, k)?,
                    b: MatRef::row_major(&w[g * n * k..(g + 1) * n * k], n, k)?.t(),
                    c: MatMut::row_major(c, r, n)?,
                });
            }
            match bf16 {
                true => grouped_gemm_bf16(1.0, groups, 0.0)?,
                false => grouped_gemm(1.0, groups, 0.0)?,
            }
            Ok(())
        })
    };
    let (f32_run, bf16_run) = (grouped(false)?, grouped(true)?);
    record("grouped (one job, every expert's blocks)", f32_run, peak.0);
    let looped = time(repeats, || {
        for (g, (&r, &s)) in shape.rows.iter().zip(&starts).enumerate() {
            gemm(
                1.0,
                MatRef::row_major(&x[s * k..(s + r) * k], r, k)?,
                MatRef::row_major(&w[g * n * k..(g + 1) * n * k], n, k)?.t(),
                0.0,
                MatMut::row_major(&mut y[s * n..(s + r) * n], r, n)?,
            )?;
        }
        Ok(())
    })?;
    record("a loop of one product per expert", looped, peak.0);
    let dense = time(repeats, || {
        Ok(gemm(
            1.0,
            MatRef::row_major(&x, total, k)?,
            MatRef::row_major(&w[..n * k], n, k)?.t(),
            0.0,
            MatMut::row_major(&mut y, total, n)?,
        )?)
    })?;
    record("one dense product of all rows", dense, peak.0);
    record("grouped, bf16 (of the bf16 peak)", bf16_run, peak.1);
    Ok(ShapeResult { shape, variants })
}

impl std::fmt::Display for GroupedGemmReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "MoE experts' product Y_e = X_e·W_eᵀ, f32 (and grouped in bf16), {} thread(s)",
            self.threads
        )?;
        for p in &self.peaks {
            let what = if p.bf16 { "bf16 peak" } else { "FMA peak" };
            writeln!(f, "  {what} {:<10} {:>7.1} GFLOP/s", p.isa, p.gflops)?;
        }
        for r in &self.results {
            let s = &r.shape;
            let (min, max) = (
                s.rows.iter().min().copied().unwrap_or(0),
                s.rows.iter().max().copied().unwrap_or(0),
            );
            writeln!(
                f,
                "  {} experts, {} rows in all ({min} to {max} each), k {}, n {}",
                s.rows.len(),
                s.rows.iter().sum::<usize>(),
                s.k,
                s.n
            )?;
            writeln!(
                f,
                "    {:<42} {:>9} {:>9} {:>8}",
                "variant", "median", "best", "of peak"
            )?;
            for v in &r.variants {
                writeln!(
                    f,
                    "    {:<42} {:>9.1} {:>9.1} {:>7.1}%",
                    v.name,
                    v.gflops_median,
                    v.gflops_best,
                    100.0 * v.fraction_of_peak
                )?;
            }
        }
        write!(
            f,
            "  (GFLOP/s; 'of peak' is the median over the widest FMA peak)"
        )
    }
}
