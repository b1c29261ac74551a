//! Several inputs and the shape operations (issue 46, section 2): a module that splits, narrows
//! and concatenates replicated features, cuts a column-parallel output per head
//! (`split_heads`) after a sub-module of two outputs (`-> (Tensor, Tensor)`), chunks the input and swaps its halves (`chunk`), broadcasts one head computed whole on every rank to this rank's heads
//! (`broadcast_heads`), feeds two values to an op of its own (`MultiOp`), and joins the heads
//! again (`cat_heads`) for a row-parallel layer: DeepSeek's latent attention's data movement,
//! without the attention. Its input gradient matches finite differences, and tp 2 (with and
//! without sequence parallelism) computes what tp 1 does.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::distributed::sum_sequence_parallel_gradients;
use megatron::module::{Builder, Cx, Module, MultiOp, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::prelude::*;
use megatron::tensor::Tensor;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `a ⊙ tanh(b)`, an op of two tensors written by hand (host only).
#[derive(Debug, Clone, Default)]
pub struct TanhGate;

impl MultiOp for TanhGate {
    type Saved = (Tensor, Tensor);

    fn forward(
        &self,
        _cx: &Cx,
        _site: Site,
        xs: &[&Tensor],
    ) -> megatron::Result<(Tensor, Self::Saved)> {
        if xs[0].shape() != xs[1].shape() {
            return Err(megatron::Error::Invalid(format!(
                "TanhGate: shapes {} and {}",
                xs[0].shape(),
                xs[1].shape()
            )));
        }
        let (a, b) = (xs[0].to_vec::<f32>()?, xs[1].to_vec::<f32>()?);
        let y: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a * b.tanh()).collect();
        Ok((
            Tensor::from_vec(y, xs[0].shape().clone())?,
            (xs[0].clone(), xs[1].clone()),
        ))
    }

    fn backward(
        &self,
        _cx: &Cx,
        _site: Site,
        (a, b): Self::Saved,
        dy: &Tensor,
    ) -> megatron::Result<Vec<Tensor>> {
        let (av, bv, g) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?, dy.to_vec::<f32>()?);
        let da: Vec<f32> = bv.iter().zip(&g).map(|(b, g)| g * b.tanh()).collect();
        let db: Vec<f32> = av
            .iter()
            .zip(&bv)
            .zip(&g)
            .map(|((a, b), g)| g * a * (1.0 - b.tanh() * b.tanh()))
            .collect();
        Ok(vec![
            Tensor::from_vec(da, a.shape().clone())?,
            Tensor::from_vec(db, b.shape().clone())?,
        ])
    }
}

const H: usize = 16;
const R1: usize = 6;
const R2: usize = 4;
const HEADS: usize = 4;
const A: usize = 3;
const B: usize = 3;
const D: usize = 2;

/// A module of two outputs: the latent down-projection cut in two parts, the first normed.
#[megatron::module]
pub struct Down {
    proj: Linear,
    norm: LayerNorm,
}

#[megatron::module]
impl Down {
    fn forward(&self, x: Tensor) -> (Tensor, Tensor) {
        let (lo, hi) = split(self.proj(x), [R1, R2]);
        (self.norm(lo), hi)
    }
}

/// The data movement of latent attention: replicated features split and joined, per-head
/// parts of a column-parallel output, a broadcast head, a two-input op, the heads joined.
#[megatron::module]
pub struct Latent {
    down: Down,
    #[column_parallel]
    up: Linear,
    k_rope: Linear,
    #[op]
    gate: TanhGate,
    #[row_parallel]
    out: Linear,
}

#[megatron::module]
impl Latent {
    fn forward(&self, x: Tensor) -> Tensor {
        let (lo, hi) = self.down(x);
        let joined = cat(hi, narrow(lo, 1, R1 - 2), lo);
        let (a, b) = split_heads(self.up(joined), [A, B]);
        let (x1, x2) = chunk(x, 2);
        let r = broadcast_heads(self.k_rope(cat(x2, x1)), HEADS);
        let q = cat_heads(a, self.gate(b, a), r, [A, B, D]);
        self.out(q)
    }
}

fn spec() -> LatentSpec {
    LatentSpec {
        down: DownSpec {
            proj: LinearSpec::new(H, R1 + R2),
            norm: LayerNormSpec::new(R1),
        },
        up: LinearSpec::new(R2 + R1 - 2 + R1, HEADS * (A + B)),
        k_rope: LinearSpec::new(H, D),
        gate: TanhGate,
        out: LinearSpec::new(HEADS * (A + B + D), H),
    }
}

const SEQ: usize = 4;
const BATCH: usize = 2;

fn values(salt: usize) -> Vec<f32> {
    (0..SEQ * BATCH * H)
        .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
        .collect()
}

/// The output and input gradient (the whole sequence) after `steps` steps of gradient descent
/// on Σ y ⊙ c, at tp `tp` (with sequence parallelism when `sp`).
fn run(tp: usize, sp: bool, steps: usize, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    let per_rank = launch(tp, |w| -> R<(Vec<f32>, Vec<f32>)> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sp);
        let model = Latent::build(&spec(), &mut Builder::for_rank(7, ps.groups()))?;
        let rank = ps.groups().tp_rank();
        let rows = if sp { SEQ / tp } else { SEQ };
        let part = |all: &[f32]| {
            let n = rows * BATCH * H;
            let start = if sp { rank * n } else { 0 };
            all[start..start + n].to_vec()
        };
        let mut out = (Vec::new(), Vec::new());
        for step in 0..steps.max(1) {
            let cx = Cx::new(&ps, step as u64);
            let xs = if step + 1 == steps.max(1) {
                x.to_vec()
            } else {
                values(step)
            };
            let x = Tensor::from_vec(part(&xs), [rows, BATCH, H])?;
            let c = Tensor::from_vec(part(&values(99)), [rows, BATCH, H])?;
            let (y, saved) = model.forward(&cx, Site::ROOT, &x)?;
            let dx = model.backward(&cx, Site::ROOT, saved, &c)?;
            sum_sequence_parallel_gradients(std::slice::from_ref(&model), &ps)?;
            out = (y.to_vec()?, dx.to_vec()?);
            support::descend(&model, 0.05);
        }
        Ok(out)
    })
    .unwrap();
    if sp {
        let (mut y, mut dx) = (Vec::new(), Vec::new());
        for (a, b) in per_rank {
            y.extend(a);
            dx.extend(b);
        }
        (y, dx)
    } else {
        per_rank.into_iter().next().expect("rank 0")
    }
}

#[test]
fn the_input_gradient_matches_finite_differences() {
    let x = values(3);
    let (_, dx) = run(1, false, 1, &x);
    let c = values(99);
    let loss = |x: &[f32]| -> f64 {
        let (y, _) = run(1, false, 1, x);
        y.iter()
            .zip(&c)
            .map(|(y, c)| f64::from(*y) * f64::from(*c))
            .sum()
    };
    for i in [0, 5, 17, 40, 77, 100, 127] {
        let h = 1e-2;
        let (mut plus, mut minus) = (x.clone(), x.clone());
        plus[i] += h;
        minus[i] -= h;
        let numeric = (loss(&plus) - loss(&minus)) / (2.0 * f64::from(h));
        let got = f64::from(dx[i]);
        assert!(
            (got - numeric).abs() < 2e-2 * (1.0 + numeric.abs()),
            "dx[{i}] = {got}, finite differences {numeric}"
        );
    }
}

#[test]
fn tensor_parallel_runs_compute_what_one_rank_does() {
    let x = values(5);
    let one = run(1, false, 3, &x);
    for sp in [false, true] {
        let two = run(2, sp, 3, &x);
        for (what, got, want) in [
            ("output", &two.0, &one.0),
            ("input gradient", &two.1, &one.1),
        ] {
            let worst = support::max_abs_diff(got, want);
            assert!(worst < 1e-5, "tp 2 (sp {sp}): {what} {worst} from one rank");
        }
    }
}
