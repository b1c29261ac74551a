//! Sequence parallelism (`--sequence-parallel`) on thread ranks against tensor parallelism
//! alone and against one rank: one forward and backward of the DSL's GPT (losses and every
//! gradient, once the sequence-parallel region's gradients are summed over tp), 20 training
//! steps with dropout, and the collectives that replace the all-reduces.

mod support;

use megatron::comm::threads::launch;
use megatron::comm::{OpKind, ParallelState};
use megatron::distributed::sum_sequence_parallel_gradients;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Cx, Module, ParamSpec, Site, assemble_logical};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::{DType, Tensor};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SEQ: usize = 16;
const BATCH: usize = 2;

fn tiny(dropout: f32) -> GptConfig {
    support::tiny_gpt(dropout)
}

fn ids(salt: i64) -> Tensor {
    support::token_ids(SEQ, BATCH, salt)
}

/// What one forward and backward gave a rank.
struct Pass {
    losses: Vec<f32>,
    /// Every parameter's gradient as backward left it.
    partial: Vec<(ParamSpec, Vec<f32>)>,
    /// The same once the sequence-parallel region's gradients are summed over tp.
    grads: Vec<(ParamSpec, Vec<f32>)>,
    /// The tensor-parallel collectives: kind, calls, bytes.
    tp_ops: Vec<(OpKind, u64, u64)>,
}

fn grads_of(model: &Gpt) -> Vec<(ParamSpec, Vec<f32>)> {
    let mut grads = Vec::new();
    model.visit_params(&mut |p| grads.push((p.spec().clone(), p.grad().to_vec::<f32>().unwrap())));
    grads
}

/// One forward and backward of the whole model on every rank of a tp-way world.
fn one_pass(tp: usize, sequence_parallel: bool, dropout: f32) -> Vec<Pass> {
    let config = tiny(dropout);
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    launch(tp, |w| -> R<Pass> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sequence_parallel);
        let model = Gpt::build(&config.spec(), &mut Builder::for_rank(17, ps.groups()))?;
        let cx = Cx::new(&ps, 5);
        let before = ps.tp().stats();
        let (losses, saved) = model.forward(&cx, Site::ROOT, &ids(0), &ids(1))?;
        let dl = Tensor::full(
            losses.shape().clone(),
            1.0 / (SEQ * BATCH) as f32,
            DType::F32,
        );
        model.backward(&cx, Site::ROOT, saved, &dl)?;
        let stats = ps.tp().stats().since(&before);
        let partial = grads_of(&model);
        sum_sequence_parallel_gradients(std::slice::from_ref(&model), &ps)?;
        Ok(Pass {
            losses: losses.to_vec::<f32>()?,
            partial,
            grads: grads_of(&model),
            tp_ops: stats
                .ops
                .iter()
                .map(|(k, s)| (*k, s.calls, s.bytes))
                .collect(),
        })
    })
    .unwrap()
}

/// `a` against `b` to `tol` of `b`'s largest magnitude.
fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * scale)
}

/// Each parameter's gradient over the ranks (summed over tp where it lives in the
/// sequence-parallel region), assembled into the logical tensor (the real rows of the padded
/// vocabulary), against the reference's.
fn assert_grads_match(ranks: &[Pass], reference: &Pass, what: &str) {
    for (i, (spec, g)) in reference.grads.iter().enumerate() {
        let parts: Vec<(&ParamSpec, &[f32])> = ranks
            .iter()
            .map(|r| (&r.grads[i].0, r.grads[i].1.as_slice()))
            .collect();
        let whole = assemble_logical(&parts).unwrap();
        let n = if spec.name == "wte.weight" {
            256 * 32
        } else {
            g.len()
        };
        assert!(
            close(&whole[..n], &g[..n], 1e-5),
            "{what}: {} differs from tp 1",
            spec.name
        );
    }
}

#[test]
fn one_pass_with_sequence_parallelism_matches_tp1() {
    for dropout in [0.0, 0.2] {
        let reference = one_pass(1, false, dropout).remove(0);
        for tp in [2, 4] {
            let what = format!("tp {tp} sequence parallel, dropout {dropout}");
            let ranks = one_pass(tp, true, dropout);
            for r in &ranks {
                assert!(close(&r.losses, &reference.losses, 1e-5), "{what}: losses");
            }
            assert_grads_match(&ranks, &reference, &what);
            // Without the sum over tp, the norms' and the positions' gradients are each rank's
            // shard's only: the sum is what makes them the whole sequence's.
            let mut summed = 0;
            for (i, (spec, g)) in reference.grads.iter().enumerate() {
                if spec.sequence_parallel {
                    summed += 1;
                    assert!(
                        !close(&ranks[0].partial[i].1, g, 1e-3),
                        "{what}: {} is whole before the sum over tp",
                        spec.name
                    );
                }
            }
            // ln1, ln2 of each block and ln_f (weight and bias), and the positions.
            assert_eq!(summed, 2 * 2 * 2 + 2 + 1, "{what}");
        }
    }
}

#[test]
fn sequence_parallel_collectives_replace_the_all_reduces() {
    let config = tiny(0.0);
    let (l, h) = (config.num_layers as u64, config.hidden_size as u64);
    let bsh = (SEQ * BATCH) as u64 * h * 4;
    let bs = (SEQ * BATCH) as u64 * 4;
    for tp in [2, 4] {
        for rank in one_pass(tp, true, 0.0) {
            let get = |kind| {
                rank.tp_ops
                    .iter()
                    .find(|(k, _, _)| *k == kind)
                    .map_or((0, 0), |&(_, c, b)| (c, b))
            };
            // Per layer forward: all-gathers before qkv and fc1, reduce-scatters after proj
            // and fc2; backward the mirror. The embedding's reduce-scatter and the tied output
            // layer's all-gather forward, their mirrors backward. Each of the 4l + 2
            // all-reduces of b·s·h that tensor parallelism alone makes is one all-gather and one
            // reduce-scatter of b·s·h (what a ring all-reduce is made of); the counters record
            // the shard a rank sends, b·s·h / tp. Besides, qkv, fc1 and the tied output layer
            // keep their input's shard, not the gathered sequence (as Megatron-LM and the
            // paper's memory formula): their backward gathers it again, 2l + 1 more
            // all-gathers. The cross-entropy's 3 all-reduces of b·s stay.
            let n = 4 * l + 2;
            let shard = bsh / tp as u64;
            let gathers = n + 2 * l + 1;
            assert_eq!(
                get(OpKind::AllGather),
                (gathers, gathers * shard),
                "tp {tp}: all-gathers"
            );
            assert_eq!(
                get(OpKind::ReduceScatter),
                (n, n * shard),
                "tp {tp}: reduce-scatters"
            );
            assert_eq!(get(OpKind::AllReduce), (3, 3 * bs), "tp {tp}: all-reduces");
        }
    }
}

/// Losses and gradient norms of 20 steps on `tp × dp` ranks with dropout on.
fn curve(tp: usize, dp: usize, sequence_parallel: bool) -> Vec<(f64, f64)> {
    support::gpt_curve(&tiny(0.1), (tp, dp), sequence_parallel, SEQ, 20)
}

#[test]
fn twenty_steps_with_dropout_match_tp1() {
    let reference = curve(1, 1, false);
    for (tp, dp) in [(2, 1), (4, 1), (2, 2)] {
        let got = curve(tp, dp, true);
        support::assert_curves_close(
            &got,
            &reference,
            1e-4,
            0.0,
            &format!("tp {tp} dp {dp} sequence parallel"),
        );
    }
}
