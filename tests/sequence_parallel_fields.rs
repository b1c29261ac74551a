//! Sequence parallelism correct by construction (issue 46, section 4): a module written with
//! the DSL whose fields without a split attribute read the sequence shard — a norm, a whole
//! `Linear`, a user's own layer implemented by hand, and a sub-module of the user's holding its
//! own tensor-parallel pair — around a column- and row-parallel pair (whose row biases have
//! their whole gradient on every rank) — and a `#[local]` module of two inputs that runs on this
//! rank's heads (the user's scale, applied per head). Trained a few steps at tp 2 with
//! sequence parallelism, every replicated parameter stays bit-identical on both ranks, and the
//! model follows one rank; before the generated `build` marked such fields, the whole linear's
//! weights drifted apart between the ranks (and the local scale's, whose gradient each rank
//! computes from its own heads).

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::distributed::sum_sequence_parallel_gradients;
use megatron::module::{Builder, Cx, Init, Layer, Module, Param, Site, Split};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::prelude::*;
use megatron::tensor::Tensor;
use megatron::tensor_parallel::{LayerNorm, LayerNormSpec, LinearSpec};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SEQ: usize = 8;
const BATCH: usize = 2;
const H: usize = 16;
const HEADS: usize = 4;
const D: usize = 3;

/// A user's layer, written by hand: each feature scaled by a learned factor (`y = x ⊙ w`).
#[derive(Debug)]
pub struct Scale {
    w: Param,
}

impl Module for Scale {
    type Spec = usize;
    type Saved = Tensor;

    fn build(hidden: &usize, b: &mut Builder) -> megatron::Result<Self> {
        let w = b.param(
            "w",
            [*hidden],
            Split::Replicated,
            Init::Normal { std: 0.5 },
            false,
        )?;
        Ok(Scale { w })
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        f(&self.w);
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.w);
    }
}

impl Layer for Scale {
    fn forward(&self, _cx: &Cx, _site: Site, x: &Tensor) -> megatron::Result<(Tensor, Tensor)> {
        let w = self.w.value().to_vec::<f32>()?;
        let y: Vec<f32> = x
            .to_vec::<f32>()?
            .iter()
            .enumerate()
            .map(|(i, v)| v * w[i % w.len()])
            .collect();
        Ok((Tensor::from_vec(y, x.shape().clone())?, x.clone()))
    }

    fn backward(&self, _cx: &Cx, _site: Site, x: Tensor, dy: &Tensor) -> megatron::Result<Tensor> {
        let dy_shape = dy.shape().clone();
        let w = self.w.value().to_vec::<f32>()?;
        let (x, dy) = (x.to_vec::<f32>()?, dy.to_vec::<f32>()?);
        let mut dw = vec![0f32; w.len()];
        let dx: Vec<f32> = dy
            .iter()
            .zip(&x)
            .enumerate()
            .map(|(i, (d, v))| {
                dw[i % w.len()] += d * v;
                d * w[i % w.len()]
            })
            .collect();
        self.w.accumulate_grad(|g| {
            let sum: Vec<f32> = g
                .to_vec::<f32>()?
                .iter()
                .zip(&dw)
                .map(|(a, b)| a + b)
                .collect();
            Ok(g.copy_from(&Tensor::from_vec(sum, [w.len()])?)?)
        })?;
        Ok(Tensor::from_vec(dx, dy_shape)?)
    }
}

/// A module of two inputs, run `#[local]` on this rank's heads: `a`'s heads scaled per
/// feature of a head (the user's layer, whose `D` factors every head shares), gated by `b`.
#[megatron::module]
pub struct HeadGate {
    scale: Scale,
}

#[megatron::module]
impl HeadGate {
    fn forward(&self, a: Tensor, b: Tensor) -> Tensor {
        self.scale(a) * sigmoid(b)
    }
}

/// A sub-module of the user's: a norm and a whole linear of its own, and a tensor-parallel
/// pair whose row bias must keep its whole gradient when the sub-module is marked whole.
#[megatron::module]
pub struct Inner {
    norm: LayerNorm,
    proj: Linear,
    #[column_parallel]
    a: Linear,
    #[row_parallel]
    b: Linear,
}

#[megatron::module]
impl Inner {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = self.proj(self.norm(x));
        self.b(gelu(self.a(h)))
    }
}

/// Every kind of field a user leaves without a split attribute, around a tensor-parallel pair.
#[megatron::module]
pub struct Mix {
    ln: LayerNorm,
    down: Linear,
    scale: Scale,
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
    inner: Inner,
    up: Linear,
    #[column_parallel]
    heads: Linear,
    #[local]
    gate: HeadGate,
    #[row_parallel]
    merge: Linear,
}

#[megatron::module]
impl Mix {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = self.scale(self.down(self.ln(x)));
        let y = self.fc2(gelu(self.fc1(h)));
        let (a, b) = split_heads(self.heads(h), [D, D]);
        let z = self.inner(y) + self.merge(self.gate(a, b));
        self.up(z)
    }
}

fn spec() -> MixSpec {
    MixSpec {
        ln: LayerNormSpec::new(H),
        down: LinearSpec::new(H, H),
        scale: H,
        fc1: LinearSpec::new(H, 4 * H),
        fc2: LinearSpec::new(4 * H, H),
        inner: InnerSpec {
            norm: LayerNormSpec::new(H),
            proj: LinearSpec::new(H, H),
            a: LinearSpec::new(H, 2 * H),
            b: LinearSpec::new(2 * H, H),
        },
        up: LinearSpec::new(H, H),
        heads: LinearSpec::new(H, HEADS * 2 * D),
        gate: HeadGateSpec { scale: D },
        merge: LinearSpec::new(HEADS * D, H),
    }
}

/// A deterministic `[SEQ, BATCH, H]` tensor's values.
fn values(salt: usize) -> Vec<f32> {
    (0..SEQ * BATCH * H)
        .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
        .collect()
}

/// The rows of the sequence rank `r` of `tp` holds.
fn shard(all: &[f32], r: usize, tp: usize) -> Vec<f32> {
    let rows = SEQ / tp * BATCH * H;
    all[r * rows..(r + 1) * rows].to_vec()
}

/// Every parameter (name, values) of each rank after `steps` steps of plain gradient descent
/// on the loss Σ y ⊙ c, at tp `tp`, with sequence parallelism when `sp`.
fn train(tp: usize, sp: bool, steps: usize) -> Vec<Vec<(String, Vec<f32>)>> {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    launch(tp, |w| -> R<Vec<(String, Vec<f32>)>> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sp);
        let model = Mix::build(&spec(), &mut Builder::for_rank(3, ps.groups()))?;
        let (rank, shards) = match sp {
            true => (ps.groups().tp_rank(), tp),
            false => (0, 1),
        };
        let shape = [SEQ / shards, BATCH, H];
        for step in 0..steps {
            let cx = Cx::new(&ps, step as u64);
            let x = Tensor::from_vec(shard(&values(step), rank, shards), shape)?;
            let dy = Tensor::from_vec(shard(&values(step + 100), rank, shards), shape)?;
            let (_, saved) = model.forward(&cx, Site::ROOT, &x)?;
            model.backward(&cx, Site::ROOT, saved, &dy)?;
            sum_sequence_parallel_gradients(std::slice::from_ref(&model), &ps)?;
            support::descend(&model, 0.05);
        }
        let mut out = Vec::new();
        model.visit_params(&mut |p| {
            if p.spec().split == Split::Replicated {
                out.push((p.spec().name.clone(), p.value().to_vec::<f32>().unwrap()));
            }
        });
        Ok(out)
    })
    .unwrap()
}

#[test]
fn replicated_parameters_stay_identical_on_every_rank_with_and_without_sequence_parallelism() {
    let one = train(1, false, 4).remove(0);
    let names: Vec<&str> = one.iter().map(|(n, _)| n.as_str()).collect();
    for want in [
        "ln.weight",
        "down.weight",
        "down.bias",
        "scale.w",
        "fc2.bias",
        "up.weight",
        "gate.scale.w",
    ] {
        assert!(names.contains(&want), "{want} not among {names:?}");
    }
    // With sequence parallelism every field reads a shard; without it only the local one
    // reads part of its values (its heads).
    for sp in [true, false] {
        let two = train(2, sp, 4);
        for ((name, a), (_, b)) in two[0].iter().zip(&two[1]) {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name} differs between the tp ranks (sequence parallel: {sp})"
            );
        }
        for ((name, got), (_, want)) in two[0].iter().zip(&one) {
            let worst = support::max_abs_diff(got, want);
            assert!(
                worst < 1e-5,
                "{name}: {worst} from one rank (sequence parallel: {sp})"
            );
        }
    }
}
