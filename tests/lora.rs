//! LoRA (issue 48): Megatron-Bridge's adapters beside a column-parallel and a row-parallel layer,
//! split over tensor parallelism as Bridge splits them. First written out in the DSL by hand —
//! beside the column-parallel `fc1`, A `[r, in]` split over the rank with its output gathered
//! and B `[out, r]` split over the output features as `fc1` is; beside the row-parallel `fc2`, A
//! split over the input features with its output all-reduced and B split over the output
//! features with its output gathered — and checked against the plain unsharded computation and
//! at tp 2 with and without sequence parallelism against one rank. Then the adapters every
//! column- and row-parallel `Linear` carries when its builder's LoRA config targets it (the
//! collectives in the generated code, docs/expanded-lora.md), given the hand-written module's
//! values: the same outputs, input gradients and adapter gradients at every tp, and with the
//! base frozen, no base gradient.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::distributed::sum_sequence_parallel_gradients;
use megatron::module::{Builder, Cx, Module, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::prelude::*;
use megatron::tensor::Tensor;
use megatron::tensor_parallel::lora::LoraConfig;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A GeLU MLP with a LoRA adapter beside each of its layers, written out.
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
/// Each parameter's values by name.
type Values = Vec<(String, Vec<f32>)>;

fn train(tp: usize, sp: bool, steps: usize) -> (Vec<f32>, Vec<f32>, Values) {
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

/// `x·Wᵀ + b + s·(xa·Aᵀ)·Bᵀ` in f64: a layer `(W, b)` and its adapter `(A, B)` reading `xa`.
fn adapted(
    x: &[f64],
    xa: &[f64],
    (w, b): (&[f32], &[f32]),
    (a, bm): (&[f32], &[f32]),
    inp: usize,
    s: f64,
) -> Vec<f64> {
    let base = linear(x, w, Some(b), inp);
    let adapter = linear(&linear(xa, a, None, inp), bm, None, RANK);
    base.iter().zip(&adapter).map(|(b, a)| b + s * a).collect()
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
    let layer = |x: &[f64], name: &str, inp| {
        let w = |m: &str| p(&format!("{name}{m}.weight"));
        let bias = p(&format!("{name}.bias"));
        adapted(x, x, (w(""), bias), (w("_lora_a"), w("_lora_b")), inp, s)
    };
    let h: Vec<f64> = layer(&x, "fc1", H).into_iter().map(gelu).collect();
    let want = layer(&h, "fc2", F);
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

/// The same MLP without adapters: built with a LoRA config, its layers carry them.
#[megatron::module]
pub struct Mlp {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl Mlp {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = gelu(self.fc1(x));
        self.fc2(h)
    }
}

/// The built-in adapters' names for the hand-written ones'.
fn built_in_name(name: &str) -> String {
    name.replace("_lora_a.", ".lora_a.")
        .replace("_lora_b.", ".lora_b.")
}

/// Each parameter's local values and gradient after one forward and backward at tp `tp`, and
/// the output and input gradient (sequence shards put together), for the hand-written module
/// (`built_in` false) or the built-in adapters given its values (with the base frozen when
/// `frozen`).
type Grads = Vec<(String, Vec<f32>, Vec<f32>)>;
fn one_pass(tp: usize, sp: bool, built_in: bool, frozen: bool) -> (Vec<f32>, Vec<f32>, Grads) {
    one_pass_with(tp, sp, built_in, frozen, 0.0)
}

/// [`one_pass`] with LoRA's dropout `p` on the built-in adapters' input.
fn one_pass_with(
    tp: usize,
    sp: bool,
    built_in: bool,
    frozen: bool,
    p: f32,
) -> (Vec<f32>, Vec<f32>, Grads) {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    let per_rank = launch(tp, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sp);
        let written = LoraMlp::build(&spec(), &mut Builder::for_rank(5, ps.groups()))?;
        let rank = ps.groups().tp_rank();
        let rows = if sp { SEQ / tp } else { SEQ };
        let part = |all: Vec<f32>| {
            let n = rows * BATCH * H;
            let start = if sp { rank * n } else { 0 };
            all[start..start + n].to_vec()
        };
        let cx = Cx::new(&ps, 0);
        let x = Tensor::from_vec(part(values(0)), [rows, BATCH, H])?;
        let dy = Tensor::from_vec(part(values(50)), [rows, BATCH, H])?;
        let run = |m: &dyn Fn() -> megatron::Result<(Tensor, Tensor)>| m();
        let mut grads = Vec::new();
        let (y, dx) = if built_in {
            let config = LoraConfig {
                rank: RANK,
                alpha: 2.0 * RANK as f32,
                dropout: p,
                targets: vec!["fc1".into(), "fc2".into()],
            };
            let spec = MlpSpec {
                fc1: LinearSpec::new(H, F),
                fc2: LinearSpec::new(F, H),
            };
            let b = Builder::for_rank(5, ps.groups()).with_lora(Some(config));
            let mut model = Mlp::build(&spec, &mut { b })?;
            let mut values = std::collections::HashMap::new();
            written.visit_params(&mut |p| {
                values.insert(built_in_name(&p.spec().name), p.value().clone());
            });
            model.visit_params(&mut |p| p.set_values(&values[&p.spec().name]).unwrap());
            if frozen {
                model.freeze(&|s| !megatron::tensor_parallel::lora::is_adapter_param(&s.name));
            }
            let out = run(&|| {
                let (y, saved) = model.forward(&cx, Site::ROOT, &x)?;
                Ok((y, model.backward(&cx, Site::ROOT, saved, &dy)?))
            })?;
            sum_sequence_parallel_gradients(std::slice::from_ref(&model), &ps)?;
            model.visit_params(&mut |p| {
                grads.push((
                    p.spec().name.clone(),
                    p.value().to_vec_f32().unwrap(),
                    p.grad().to_vec_f32().unwrap(),
                ))
            });
            out
        } else {
            let out = run(&|| {
                let (y, saved) = written.forward(&cx, Site::ROOT, &x)?;
                Ok((y, written.backward(&cx, Site::ROOT, saved, &dy)?))
            })?;
            sum_sequence_parallel_gradients(std::slice::from_ref(&written), &ps)?;
            written.visit_params(&mut |p| {
                grads.push((
                    built_in_name(&p.spec().name),
                    p.value().to_vec_f32().unwrap(),
                    p.grad().to_vec_f32().unwrap(),
                ))
            });
            out
        };
        Ok((y.to_vec::<f32>()?, dx.to_vec::<f32>()?, grads))
    })
    .unwrap();
    put_together(per_rank, sp)
}

/// The ranks' outputs and input gradients put together (their sequence shards with `sp`, else
/// rank 0's), with rank 0's gradients.
fn put_together(
    per_rank: Vec<(Vec<f32>, Vec<f32>, Grads)>,
    sp: bool,
) -> (Vec<f32>, Vec<f32>, Grads) {
    let (mut y, mut dx) = (Vec::new(), Vec::new());
    let grads = per_rank[0].2.clone();
    for (i, (a, b, _)) in per_rank.into_iter().enumerate() {
        if sp || i == 0 {
            y.extend(a);
            dx.extend(b);
        }
    }
    (y, dx, grads)
}

#[test]
fn the_built_in_adapters_are_the_hand_written_ones_at_every_tp() {
    for (tp, sp) in [(1, false), (2, false), (2, true)] {
        let written = one_pass(tp, sp, false, false);
        let built = one_pass(tp, sp, true, false);
        let what = format!("tp {tp} sp {sp}");
        assert!(
            support::max_abs_diff(&built.0, &written.0) < 1e-6,
            "{what}: output"
        );
        assert!(
            support::max_abs_diff(&built.1, &written.1) < 1e-6,
            "{what}: input gradient"
        );
        assert_eq!(built.2.len(), written.2.len());
        for ((name, v, g), (wname, wv, wg)) in built.2.iter().zip(&written.2) {
            assert_eq!(name, wname, "{what}");
            assert_eq!(v, wv, "{what}: {name}");
            let worst = support::max_abs_diff(g, wg);
            assert!(
                worst < 1e-5,
                "{what}: {name}'s gradient {worst} from the hand-written"
            );
        }
        // The base frozen: the same outputs and adapter gradients, no base gradient.
        let frozen = one_pass(tp, sp, true, true);
        assert!(
            support::max_abs_diff(&frozen.0, &written.0) < 1e-6,
            "{what}: frozen output"
        );
        assert!(
            support::max_abs_diff(&frozen.1, &written.1) < 1e-6,
            "{what}: frozen input grad"
        );
        for (name, _, g) in &frozen.2 {
            let adapter = megatron::tensor_parallel::lora::is_adapter_param(name);
            assert_eq!(!g.is_empty(), adapter, "{what}: {name}");
        }
    }
}

/// LoRA's dropout (PEFT's `lora_dropout`, before A): the built-in adapters' output is the plain
/// computation with the adapters' input dropped by the dropout primitive's mask at the layer's
/// site (the whole input beside the column-parallel layer, its features beside the row-parallel
/// one), and at tp 2, with and without sequence parallelism, each rank draws the one rank's
/// mask for its elements: the same outputs, input gradients and adapter gradients.
#[test]
fn lora_dropout_drops_the_adapters_input_as_one_rank_at_every_tp() {
    use megatron::module::Sharding;
    let p = 0.3;
    let one = one_pass_with(1, false, true, true, p);
    let value = |name: &str| one.2.iter().find(|(n, ..)| n == name).unwrap().1.clone();
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    let s = 2.0;
    let want = launch(1, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let cx = Cx::new(&ps, 0);
        let dropped = |site: &str, t: &Tensor, sharding| -> R<Vec<f64>> {
            let site = Site::ROOT.child(site).child("lora_dropout");
            let (d, _) = megatron::ops::dropout(&cx, site, t, p, sharding)?;
            Ok(d.to_vec_f32()?.iter().map(|&v| f64::from(v)).collect())
        };
        let x = Tensor::from_vec(values(0), [SEQ, BATCH, H])?;
        let xs: Vec<f64> = values(0).iter().map(|&v| f64::from(v)).collect();
        let d1 = dropped("fc1", &x, Sharding::Gathered)?;
        assert!(
            d1.iter().filter(|&&v| v == 0.0).count() > d1.len() / 10,
            "dropped"
        );
        let weights = |name: &str| {
            let v = |m: &str| value(&format!("{name}.{m}"));
            (
                (v("weight"), v("bias")),
                (v("lora_a.weight"), v("lora_b.weight")),
            )
        };
        let (base, lora) = weights("fc1");
        let h: Vec<f64> = adapted(&xs, &d1, (&base.0, &base.1), (&lora.0, &lora.1), H, s)
            .into_iter()
            .map(gelu)
            .collect();
        let ht = Tensor::from_vec(
            h.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            [SEQ, BATCH, F],
        )?;
        let d2 = dropped("fc2", &ht, Sharding::SplitLastDim)?;
        let (base, lora) = weights("fc2");
        Ok(adapted(
            &h,
            &d2,
            (&base.0, &base.1),
            (&lora.0, &lora.1),
            F,
            s,
        ))
    })
    .unwrap()
    .remove(0);
    let worst = one
        .0
        .iter()
        .zip(&want)
        .map(|(&g, w)| (f64::from(g) - w).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-4, "output {worst} from the plain computation");
    let without = one_pass_with(1, false, true, true, 0.0);
    assert!(
        support::max_abs_diff(&without.0, &one.0) > 1e-3,
        "dropout changes the output"
    );
    for sp in [false, true] {
        let two = one_pass_with(2, sp, true, true, p);
        let what = format!("tp 2 sp {sp}");
        assert!(
            support::max_abs_diff(&two.0, &one.0) < 1e-5,
            "{what}: output"
        );
        assert!(
            support::max_abs_diff(&two.1, &one.1) < 1e-5,
            "{what}: input gradient"
        );
        // Rank 0's part of each adapter's gradient: the first rows of A beside fc1 (split
        // over r), of both Bs (split over their outputs), the first columns of A beside fc2.
        for (name, _, g) in two.2.iter().filter(|(n, ..)| n.contains("lora")) {
            let (_, _, whole) = one.2.iter().find(|(n, ..)| n == name).unwrap();
            let want: Vec<f32> = match name.as_str() {
                "fc2.lora_a.weight" => whole
                    .chunks(F)
                    .flat_map(|row| row[..F / 2].to_vec())
                    .collect(),
                _ => whole[..whole.len() / 2].to_vec(),
            };
            let worst = support::max_abs_diff(g, &want);
            assert!(
                worst < 1e-5,
                "{what}: {name}'s gradient {worst} from one rank's"
            );
        }
    }
}

/// A whole (replicated) layer with its adapter written out, as multi-latent attention's down
/// projections carry one: every matrix whole on every rank, no collective.
#[megatron::module]
pub struct LoraDown {
    down: Linear,
    down_lora_a: Linear,
    down_lora_b: Linear,
    #[config]
    scale: f32,
}

#[megatron::module]
impl LoraDown {
    fn forward(&self, x: Tensor) -> Tensor {
        self.down(x) + self.down_lora_b(self.down_lora_a(x)) * self.scale
    }
}

/// The same whole layer, its adapter built in when the builder's LoRA config targets it.
#[megatron::module]
pub struct Down {
    down: Linear,
}

#[megatron::module]
impl Down {
    fn forward(&self, x: Tensor) -> Tensor {
        self.down(x)
    }
}

/// One forward and backward of the whole layer at tp `tp` (`sp`: each rank its shard of the
/// sequence), written out or built in with the written one's values (LoRA's dropout `p`):
/// the output, the input gradient (shards put together) and rank 0's gradients by name.
fn whole_pass(tp: usize, sp: bool, built_in: bool, p: f32) -> (Vec<f32>, Vec<f32>, Grads) {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    let per_rank = launch(tp, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sp);
        let adapter = |i, o| LinearSpec::new(i, o).with_bias(false).with_init_std(0.1);
        let spec = LoraDownSpec {
            down: LinearSpec::new(H, F),
            down_lora_a: adapter(H, RANK),
            down_lora_b: adapter(RANK, F),
            scale: 2.0,
        };
        let written = LoraDown::build(&spec, &mut Builder::for_rank(5, ps.groups()))?;
        let rows = if sp { SEQ / tp } else { SEQ };
        let start = if sp {
            ps.groups().tp_rank() * rows * BATCH * H
        } else {
            0
        };
        let x = values(0)[start..start + rows * BATCH * H].to_vec();
        let x = Tensor::from_vec(x, [rows, BATCH, H])?;
        let dy: Vec<f32> = (0..SEQ * BATCH * F)
            .map(|i| ((i * 37 % 101) as f32 / 101.0 - 0.5) * 2.0)
            .collect();
        let start = if sp {
            ps.groups().tp_rank() * rows * BATCH * F
        } else {
            0
        };
        let dy = Tensor::from_vec(
            dy[start..start + rows * BATCH * F].to_vec(),
            [rows, BATCH, F],
        )?;
        let cx = Cx::new(&ps, 0);
        let mut grads = Vec::new();
        let (y, dx) = if built_in {
            let config = LoraConfig {
                rank: RANK,
                alpha: 2.0 * RANK as f32,
                dropout: p,
                targets: vec!["down".into()],
            };
            let b = Builder::for_rank(5, ps.groups()).with_lora(Some(config));
            let spec = DownSpec {
                down: LinearSpec::new(H, F),
            };
            let model = Down::build(&spec, &mut { b })?;
            let mut values = std::collections::HashMap::new();
            written.visit_params(&mut |p| {
                values.insert(built_in_name(&p.spec().name), p.value().clone());
            });
            model.visit_params(&mut |p| p.set_values(&values[&p.spec().name]).unwrap());
            let (y, saved) = model.forward(&cx, Site::ROOT, &x)?;
            let dx = model.backward(&cx, Site::ROOT, saved, &dy)?;
            sum_sequence_parallel_gradients(std::slice::from_ref(&model), &ps)?;
            model.visit_params(&mut |p| {
                grads.push((
                    p.spec().name.clone(),
                    Vec::new(),
                    p.grad().to_vec_f32().unwrap(),
                ))
            });
            (y, dx)
        } else {
            let (y, saved) = written.forward(&cx, Site::ROOT, &x)?;
            let dx = written.backward(&cx, Site::ROOT, saved, &dy)?;
            sum_sequence_parallel_gradients(std::slice::from_ref(&written), &ps)?;
            written.visit_params(&mut |p| {
                grads.push((
                    built_in_name(&p.spec().name),
                    Vec::new(),
                    p.grad().to_vec_f32().unwrap(),
                ))
            });
            (y, dx)
        };
        Ok((y.to_vec::<f32>()?, dx.to_vec::<f32>()?, grads))
    })
    .unwrap();
    put_together(per_rank, sp)
}

/// An adapter beside a whole layer (multi-latent attention's `linear_q_down_proj` and
/// `linear_kv_down_proj`) computes what the written-out adapter does (output, input
/// gradient, every gradient), at tp 1 and at tp 2 with and without sequence parallelism
/// (each rank its shard of the sequence, the gradients summed over tp); its dropout draws
/// the one-rank masks.
#[test]
fn lora_beside_a_whole_layer_is_the_written_out_adapter_at_every_tp() {
    let one = whole_pass(1, false, false, 0.0);
    for (tp, sp) in [(1, false), (2, false), (2, true)] {
        let what = format!("tp {tp} sp {sp}");
        let (built, written) = (
            whole_pass(tp, sp, true, 0.0),
            whole_pass(tp, sp, false, 0.0),
        );
        for (part, got, want) in [
            ("output", &built.0, &written.0),
            ("input gradient", &built.1, &written.1),
            ("output vs one rank", &built.0, &one.0),
            ("input gradient vs one rank", &built.1, &one.1),
        ] {
            let worst = support::max_abs_diff(got, want);
            assert!(worst < 1e-5, "{what}: {part} {worst}");
        }
        assert_eq!(
            built.2.len(),
            4,
            "{what}: the layer's weight and bias, A and B"
        );
        for (name, _, g) in &built.2 {
            for (reference, grads) in [("written", &written.2), ("one rank", &one.2)] {
                let (_, _, want) = grads.iter().find(|(n, ..)| n == name).unwrap();
                let worst = support::max_abs_diff(g, want);
                assert!(
                    worst < 1e-5,
                    "{what}: {name}'s gradient {worst} from {reference}'s"
                );
            }
        }
    }
    // With dropout: sharded as one rank.
    let one = whole_pass(1, false, true, 0.3);
    assert_ne!(
        one.0,
        whole_pass(1, false, true, 0.0).0,
        "the dropout drops"
    );
    let two = whole_pass(2, true, true, 0.3);
    assert!(
        support::max_abs_diff(&two.0, &one.0) < 1e-5,
        "dropout at tp 2 sp"
    );
    assert!(
        support::max_abs_diff(&two.1, &one.1) < 1e-5,
        "dropout at tp 2 sp"
    );
}
