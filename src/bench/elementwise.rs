//! `megatron bench elementwise`: a chain of element-wise operations fused by
//! `#[megatron::module]` into one generated kernel each way, against the same operations run one
//! kernel each (each written as its own module, as eager frameworks run them), forward and
//! backward on the host, next to the memory bandwidth of the machine measured in the same run.
//!
//! An element-wise chain is memory-bound: the fused forward reads its input and writes its
//! output once, and its backward reads the input and the output's gradient and writes the
//! input's gradient once; the unfused chain moves every intermediate through memory, twice
//! over in the backward.

use std::time::Instant;

use anyhow::Result;
use megatron_core::comm::ParallelState;
use megatron_core::comm::threads::launch;
use megatron_core::module::{Builder, Cx, Module, Site};
use megatron_core::parallel::{ParallelConfig, ParallelLayout};
use megatron_core::tensor::Tensor;

use super::machine::{read_write_pass, shares};

/// ReLU², fused: one kernel each way.
#[crate::module]
pub struct Relu2Fused {}

#[crate::module]
impl Relu2Fused {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = relu(x);
        h * h
    }
}

/// ReLU alone.
#[crate::module]
pub struct Relu {}

#[crate::module]
impl Relu {
    fn forward(&self, x: Tensor) -> Tensor {
        relu(x)
    }
}

/// The square alone.
#[crate::module]
pub struct Square {}

#[crate::module]
impl Square {
    fn forward(&self, x: Tensor) -> Tensor {
        x * x
    }
}

/// ReLU² as two kernels each way.
#[crate::module]
pub struct Relu2Unfused {
    relu: Relu,
    square: Square,
}

#[crate::module]
impl Relu2Unfused {
    fn forward(&self, x: Tensor) -> Tensor {
        self.square(self.relu(x))
    }
}

/// QuickGELU (`x·σ(1.702·x)`), fused.
#[crate::module]
pub struct QuickGeluFused {}

#[crate::module]
impl QuickGeluFused {
    fn forward(&self, x: Tensor) -> Tensor {
        x * sigmoid(1.702 * x)
    }
}

/// `1.702·x` alone.
#[crate::module]
pub struct Scale {}

#[crate::module]
impl Scale {
    fn forward(&self, x: Tensor) -> Tensor {
        1.702 * x
    }
}

/// The sigmoid alone.
#[crate::module]
pub struct Sigmoid {}

#[crate::module]
impl Sigmoid {
    fn forward(&self, x: Tensor) -> Tensor {
        sigmoid(x)
    }
}

/// A product alone.
#[crate::module]
pub struct Product {}

#[crate::module]
impl Product {
    fn forward(&self, a: Tensor, b: Tensor) -> Tensor {
        a * b
    }
}

/// QuickGELU as three kernels each way.
#[crate::module]
pub struct QuickGeluUnfused {
    scale: Scale,
    sigmoid: Sigmoid,
    product: Product,
}

#[crate::module]
impl QuickGeluUnfused {
    fn forward(&self, x: Tensor) -> Tensor {
        self.product(x, self.sigmoid(self.scale(x)))
    }
}

/// One chain's timings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChainTiming {
    /// The chain, as forward writes it.
    pub chain: &'static str,
    /// Its operations (the unfused run's kernels each way).
    pub operations: usize,
    /// Median forward + backward of the fused chain, in milliseconds.
    pub fused_ms: f64,
    /// Median forward + backward of the operations one kernel each, in milliseconds.
    pub unfused_ms: f64,
    /// `unfused_ms / fused_ms`.
    pub speedup: f64,
    /// The fused chain's least memory traffic (5 tensors moved: x and y forward, x, dy and dx
    /// backward) over its median time, in GB/s.
    pub fused_gbs: f64,
}

/// The whole report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ElementwiseReport {
    /// f32 elements of the chains' input.
    pub elements: usize,
    /// Compute threads.
    pub threads: usize,
    /// Memory bandwidth of a read-write pass over as many bytes on as many threads, in GB/s.
    pub machine_gbs: f64,
    /// The chains.
    pub chains: Vec<ChainTiming>,
}

/// The median of `repeats` timed runs of `f` (after one untimed), in milliseconds.
fn median_ms(repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The median forward + backward of module `M` on `x`.
fn time_module<M: Module>(
    cx: &Cx,
    x: &Tensor,
    repeats: usize,
    run: impl Fn(&M, &Cx, &Tensor) -> megatron_core::Result<Tensor>,
    spec: &M::Spec,
    ps: &ParallelState,
) -> Result<f64> {
    let m = M::build(spec, &mut Builder::for_rank(1, ps.groups()))?;
    median_ms(repeats, || {
        std::hint::black_box(run(&m, cx, x)?);
        Ok(())
    })
}

/// Times each chain fused and unfused on `elements` f32 values with `threads` compute threads.
pub fn run(elements: usize, threads: usize, repeats: usize) -> Result<ElementwiseReport> {
    megatron_core::kernels::parallel::set_threads(threads);
    let layout = ParallelLayout::new(&ParallelConfig::new(1))?;
    let mut reports = launch(1, |w| -> Result<Vec<ChainTiming>> {
        let ps = ParallelState::new(&w, &layout)?;
        let cx = Cx::new(&ps, 0);
        let values: Vec<f32> = (0..elements)
            .map(|i| ((i * 7919) % 2003) as f32 / 1001.0 - 1.0)
            .collect();
        let x = Tensor::from_vec(values, [elements])?;
        let dy = Tensor::from_vec(vec![0.5f32; elements], [elements])?;
        macro_rules! fwd_bwd {
            ($m:ty) => {
                |m: &$m, cx: &Cx, x: &Tensor| {
                    let (_, saved) = m.forward(cx, Site::ROOT, x)?;
                    m.backward(cx, Site::ROOT, saved, &dy)
                }
            };
        }
        let mut out = Vec::new();
        let relu2 = (
            time_module::<Relu2Fused>(
                &cx,
                &x,
                repeats,
                fwd_bwd!(Relu2Fused),
                &Relu2FusedSpec {},
                &ps,
            )?,
            time_module::<Relu2Unfused>(
                &cx,
                &x,
                repeats,
                fwd_bwd!(Relu2Unfused),
                &Relu2UnfusedSpec {
                    relu: ReluSpec {},
                    square: SquareSpec {},
                },
                &ps,
            )?,
        );
        out.push(("relu(x)²", 2, relu2));
        let quick = (
            time_module::<QuickGeluFused>(
                &cx,
                &x,
                repeats,
                fwd_bwd!(QuickGeluFused),
                &QuickGeluFusedSpec {},
                &ps,
            )?,
            time_module::<QuickGeluUnfused>(
                &cx,
                &x,
                repeats,
                fwd_bwd!(QuickGeluUnfused),
                &QuickGeluUnfusedSpec {
                    scale: ScaleSpec {},
                    sigmoid: SigmoidSpec {},
                    product: ProductSpec {},
                },
                &ps,
            )?,
        );
        out.push(("x·σ(1.702·x)", 3, quick));
        let bytes = 5.0 * 4.0 * elements as f64;
        Ok(out
            .into_iter()
            .map(|(chain, operations, (fused_ms, unfused_ms))| ChainTiming {
                chain,
                operations,
                fused_ms,
                unfused_ms,
                speedup: unfused_ms / fused_ms,
                fused_gbs: bytes / (fused_ms * 1e-3) / 1e9,
            })
            .collect())
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    // The machine: a read-write pass over two buffers of the chain's size on the same threads.
    let mut buffers = vec![vec![1.0f32; elements]; 2];
    let pass_ms = {
        let mut parts = shares(&mut buffers, threads);
        median_ms(repeats, || {
            std::thread::scope(|s| {
                for share in parts.iter_mut() {
                    s.spawn(move || read_write_pass(share));
                }
            });
            Ok(())
        })?
    };
    let machine_gbs = 2.0 * 2.0 * 4.0 * elements as f64 / (pass_ms * 1e-3) / 1e9;
    Ok(ElementwiseReport {
        elements,
        threads,
        machine_gbs,
        chains: reports.remove(0),
    })
}

impl std::fmt::Display for ElementwiseReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "element-wise chains of {} f32 elements, forward + backward, {} threads (memory: \
             {:.1} GB/s)",
            self.elements, self.threads, self.machine_gbs
        )?;
        writeln!(
            f,
            "{:<16} {:>4} {:>11} {:>13} {:>8} {:>12}",
            "chain", "ops", "fused (ms)", "unfused (ms)", "speedup", "fused GB/s"
        )?;
        for c in &self.chains {
            writeln!(
                f,
                "{:<16} {:>4} {:>11.2} {:>13.2} {:>7.2}× {:>12.1}",
                c.chain, c.operations, c.fused_ms, c.unfused_ms, c.speedup, c.fused_gbs
            )?;
        }
        Ok(())
    }
}
