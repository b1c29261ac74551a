//! LoRA written in the DSL (issue 48): Megatron-Bridge's adapters beside a column-parallel and a
//! row-parallel layer, split over tensor parallelism as Bridge splits them — beside the
//! column-parallel `fc1`, A `[r, in]` split over the rank with its output gathered and B
//! `[out, r]` split over the output features as `fc1` is; beside the row-parallel `fc2`, A split
//! over the input features with its output all-reduced and B split over the output features
//! with its output gathered — checked against the plain unsharded computation, and at tp 2
//! with and without sequence parallelism against one rank.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::distributed::sum_sequence_parallel_gradients;
use megatron::module::{Builder, Cx, Module, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::prelude::*;
use megatron::tensor::Tensor;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A GeLU MLP with a LoRA adapter beside each of its layers.
#[megatron::module]
pub struct LoraMlp {
    #[column_parallel]
    fc1: Linear,
    #[column_parallel(gather_output)]
    fc1_lora_a: Linear,
    #[column_parallel]
    fc1_lora_b: Linear,
    #[row_parallel]
    fc2: Linear,
    #[row_parallel]
    fc2_lora_a: Linear,
    #[column_parallel(gather_output)]
    fc2_lora_b: Linear,
    #[config]
    scale: f32,
}

#[megatron::module]
impl LoraMlp {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = gelu(self.fc1(x) + self.fc1_lora_b(self.fc1_lora_a(x)) * self.scale);
        self.fc2(h) + self.fc2_lora_b(self.fc2_lora_a(h)) * self.scale
    }
}

const SEQ: usize = 8;
const BATCH: usize = 2;
const H: usize = 16;
const F: usize = 32;
const RANK: usize = 4;

fn spec() -> LoraMlpSpec {
    // B drawn, not zero as LoRA starts it, so that every path carries values.
    let adapter = |i, o| LinearSpec::new(i, o).with_bias(false).with_init_std(0.1);
    LoraMlpSpec {
        fc1: LinearSpec::new(H, F),
        fc1_lora_a: adapter(H, RANK),
        fc1_lora_b: adapter(RANK, F),
        fc2: LinearSpec::new(F, H),
        fc2_lora_a: adapter(F, RANK),
        fc2_lora_b: adapter(RANK, H),
        scale: 2.0,
    }
}

fn values(salt: usize) -> Vec<f32> {
    (0..SEQ * BATCH * H)
        .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
        .collect()
}

/// Rank 0's output and input gradient after `steps` steps of gradient descent on Σ y ⊙ c at
/// tp `tp` (sequence parallelism when `sp`; the shards put back together), and the one-rank
/// parameters before the first step, by name.
fn train(tp: usize, sp: bool, steps: usize) -> (Vec<f32>, Vec<f32>, Vec<(String, Vec<f32>)>) {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    let per_rank = launch(tp, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sp);
        let model = LoraMlp::build(&spec(), &mut Builder::for_rank(5, ps.groups()))?;
        let mut params = Vec::new();
        model.visit_params(&mut |p| {
            params.push((p.spec().name.clone(), p.value().to_vec_f32().unwrap()))
        });
        let rank = ps.groups().tp_rank();
        let rows = if sp { SEQ / tp } else { SEQ };
        let part = |all: Vec<f32>| {
            let n = rows * BATCH * H;
            let start = if sp { rank * n } else { 0 };
            all[start..start + n].to_vec()
        };
        let (mut y_out, mut dx_out): (Vec<f32>, Vec<f32>) = (Vec::new(), Vec::new());
        for step in 0..steps {
            let cx = Cx::new(&ps, step as u64);
            let x = Tensor::from_vec(part(values(step)), [rows, BATCH, H])?;
            let dy = Tensor::from_vec(part(values(step + 50)), [rows, BATCH, H])?;
            let (y, saved) = model.forward(&cx, Site::ROOT, &x)?;
            let dx = model.backward(&cx, Site::ROOT, saved, &dy)?;
            sum_sequence_parallel_gradients(std::slice::from_ref(&model), &ps)?;
            y_out = y.to_vec()?;
            dx_out = dx.to_vec()?;
            support::descend(&model, 0.01);
        }
        Ok((y_out, dx_out, params))
    })
    .unwrap();
    let mut y = Vec::new();
    let mut dx = Vec::new();
    let params = per_rank[0].2.clone();
    for (i, (a, b, _)) in per_rank.into_iter().enumerate() {
        if sp || i == 0 {
            y.extend(a);
            dx.extend(b);
        }
    }
    (y, dx, params)
}

/// `x·Wᵀ (+ b)` in f64 for `x` `[rows, in]`, `w` `[out, in]`.
fn linear(x: &[f64], w: &[f32], b: Option<&[f32]>, inp: usize) -> Vec<f64> {
    let out = w.len() / inp;
    x.chunks(inp)
        .flat_map(|row| {
            (0..out).map(move |o| {
                let dot: f64 = (0..inp).map(|i| row[i] * f64::from(w[o * inp + i])).sum();
                dot + b.map_or(0.0, |b| f64::from(b[o]))
            })
        })
        .collect()
}

fn gelu(v: f64) -> f64 {
    0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
}

#[test]
fn lora_beside_column_and_row_layers_is_the_plain_computation_at_every_tp() {
    let (y, _, params) = train(1, false, 1);
    let p = |name: &str| params.iter().find(|(n, _)| n == name).unwrap().1.as_slice();
    let s = 2.0;
    let x: Vec<f64> = values(0).iter().map(|&v| f64::from(v)).collect();
    let base = linear(&x, p("fc1.weight"), Some(p("fc1.bias")), H);
    let adapter = linear(
        &linear(&x, p("fc1_lora_a.weight"), None, H),
        p("fc1_lora_b.weight"),
        None,
        RANK,
    );
    let h: Vec<f64> = base
        .iter()
        .zip(&adapter)
        .map(|(b, a)| gelu(b + s * a))
        .collect();
    let base = linear(&h, p("fc2.weight"), Some(p("fc2.bias")), F);
    let adapter = linear(
        &linear(&h, p("fc2_lora_a.weight"), None, F),
        p("fc2_lora_b.weight"),
        None,
        RANK,
    );
    let want: Vec<f64> = base.iter().zip(&adapter).map(|(b, a)| b + s * a).collect();
    let worst = y
        .iter()
        .zip(&want)
        .map(|(&g, w)| (f64::from(g) - w).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-5, "{worst}");
    let one = train(1, false, 4);
    for sp in [false, true] {
        let two = train(2, sp, 4);
        for (what, got, want) in [
            ("output", &two.0, &one.0),
            ("input gradient", &two.1, &one.1),
        ] {
            assert_eq!(got.len(), want.len());
            let worst = support::max_abs_diff(got, want);
            assert!(worst < 1e-5, "tp 2 (sp {sp}): {what} {worst} from one rank");
        }
    }
}
