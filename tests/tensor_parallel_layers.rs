//! Tensor-parallel layers against their unsharded selves: the same logical computation on
//! tp = 1, 2 and 4 gives the same outputs and, reassembled, the same gradients.

mod support;

use megatron::comm::threads::launch;
use megatron::comm::{ParallelState, ReduceOp};
use megatron::module::{
    Builder, ColumnParallel, Cx, Layer, Module, Op, Param, ParamSpec, RowParallel, Sharding, Site,
    VocabParallel, assemble_logical,
};
use megatron::ops;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::{DType, Tensor};
use megatron::tensor_parallel::{
    CausalSelfAttention, Embedding, EmbeddingSpec, Linear, LinearSpec, padded_vocab_size,
    vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward,
};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Runs `f` on every rank of a tp-way tensor-parallel world.
fn on_tp<T: Send>(tp: usize, f: impl Fn(&Cx, &mut Builder) -> R<T> + Sync) -> Vec<T> {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    launch(tp, |w| -> R<T> {
        let ps = ParallelState::new(&w, &layout)?;
        let cx = Cx::new(&ps, 1234);
        let mut b = Builder::for_rank(99, ps.groups());
        f(&cx, &mut b)
    })
    .unwrap()
}

fn det(len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
        .collect()
}

fn tensor(data: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(data, shape).unwrap()
}

/// Every parameter's spec and gradient on one rank.
fn grads(params: &[&Param]) -> Vec<(ParamSpec, Vec<f32>)> {
    params
        .iter()
        .map(|p| (p.spec().clone(), p.grad().to_vec::<f32>().unwrap()))
        .collect()
}

/// Logical gradients of each parameter, from every rank's parts.
fn assemble(ranks: &[Vec<(ParamSpec, Vec<f32>)>]) -> Vec<(String, Vec<f32>)> {
    (0..ranks[0].len())
        .map(|i| {
            let parts: Vec<(&ParamSpec, &[f32])> =
                ranks.iter().map(|r| (&r[i].0, r[i].1.as_slice())).collect();
            (
                ranks[0][i].0.name.clone(),
                assemble_logical(&parts).unwrap(),
            )
        })
        .collect()
}

#[test]
fn column_then_row_parallel_mlp_matches_the_unsharded_one() {
    let (s, b, h, f) = (3, 2, 8, 16);
    let x = det(s * b * h, 1);
    let dy = det(s * b * h, 2);
    let run = |tp: usize| {
        on_tp(tp, |cx, bld| {
            let fc1 = bld.scoped("fc1", |b| Linear::build_column(&LinearSpec::new(h, f), b))?;
            let fc2 = bld.scoped("fc2", |b| Linear::build_row(&LinearSpec::new(f, h), b))?;
            // Biases that are not zero (as initialised), so that one added twice, or not at
            // all, shows: fc1's split by output features, fc2's whole on every rank.
            let part = f / cx.tp_size();
            let b1 = det(f, 3)[cx.tp_rank() * part..][..part].to_vec();
            let fc1_bias = fc1.bias().expect("a bias");
            fc1_bias.set_values(&tensor(b1, &[part]))?;
            let fc2_bias = fc2.bias().expect("a bias");
            fc2_bias.set_values(&tensor(det(h, 4), &[h]))?;
            let x = tensor(x.clone(), &[s, b, h]);
            let site = Site::ROOT;
            let (a, fc1_saved) = fc1.forward_column(cx, site, &x)?;
            let (g, gelu_saved) = ops::gelu(cx, site, &a)?;
            let (y, fc2_saved) = fc2.forward_row(cx, site, &g)?;
            cx.tp().all_reduce(&y, ReduceOp::Sum)?;
            fc2.add_bias(cx, &y)?;
            let d = tensor(dy.clone(), &[s, b, h]);
            let dg = fc2.backward_row(cx, site, fc2_saved, &d)?;
            let da = ops::gelu_backward(cx, site, gelu_saved, &dg)?;
            let dx = fc1.backward_column(cx, site, fc1_saved, &da)?;
            cx.tp().all_reduce(&dx, ReduceOp::Sum)?;
            let params = [
                fc1.weight(),
                fc1.bias().unwrap(),
                fc2.weight(),
                fc2.bias().unwrap(),
            ];
            Ok((y.to_vec::<f32>()?, dx.to_vec::<f32>()?, grads(&params)))
        })
    };
    let reference = run(1);
    let ref_grads = assemble(&[reference[0].2.clone()]);
    for tp in [2, 4] {
        let out = run(tp);
        let sharded = assemble(&out.iter().map(|o| o.2.clone()).collect::<Vec<_>>());
        for rank in &out {
            support::assert_close_to_scale(
                &rank.0,
                &reference[0].0,
                1e-5,
                &format!("output tp {tp}"),
            );
            support::assert_close_to_scale(
                &rank.1,
                &reference[0].1,
                1e-5,
                &format!("input grad tp {tp}"),
            );
        }
        for ((name, g), (_, r)) in sharded.iter().zip(&ref_grads) {
            support::assert_close_to_scale(g, r, 1e-5, &format!("{name} tp {tp}"));
        }
    }
}

#[test]
fn vocab_parallel_cross_entropy_equals_the_plain_one() {
    let (rows, vocab) = (6, 10);
    let padded = padded_vocab_size(vocab, 4, 4); // 16: divisible for tp 1, 2 and 4
    let mut logits = det(rows * padded, 3)
        .iter()
        .map(|x| x * 4.0)
        .collect::<Vec<_>>();
    for r in 0..rows {
        logits[r * padded + vocab..(r + 1) * padded].fill(f32::NEG_INFINITY);
    }
    let targets: Vec<i64> = (0..rows as i64).map(|r| (r * 3) % vocab as i64).collect();
    let dloss = det(rows, 4);
    let plain = on_tp(1, |cx, _| {
        let (loss, saved) = ops::cross_entropy(
            cx,
            Site::ROOT,
            &tensor(logits.clone(), &[rows, padded]),
            &Tensor::from_slice(&targets, [rows])?,
        )?;
        let d =
            ops::cross_entropy_backward(cx, Site::ROOT, saved, &tensor(dloss.clone(), &[rows]))?;
        Ok((loss.to_vec::<f32>()?, d.to_vec::<f32>()?))
    })
    .remove(0);
    for tp in [1, 2, 4] {
        let out = on_tp(tp, |cx, _| {
            let local = padded / tp;
            let mine: Vec<f32> = (0..rows)
                .flat_map(|r| logits[r * padded + cx.tp_rank() * local..][..local].to_vec())
                .collect();
            let before = cx.tp().stats();
            let (loss, saved) = vocab_parallel_cross_entropy(
                cx,
                Site::ROOT,
                &tensor(mine, &[rows, local]),
                &Tensor::from_slice(&targets, [rows])?,
            )?;
            let comm = cx.tp().stats().since(&before);
            let d = vocab_parallel_cross_entropy_backward(
                cx,
                Site::ROOT,
                saved,
                &tensor(dloss.clone(), &[rows]),
            )?;
            Ok((loss.to_vec::<f32>()?, d.to_vec::<f32>()?, comm))
        });
        for (rank, (loss, d, comm)) in out.iter().enumerate() {
            support::assert_close_to_scale(loss, &plain.0, 1e-5, &format!("loss tp {tp}"));
            let local = padded / tp;
            let expected: Vec<f32> = (0..rows)
                .flat_map(|r| plain.1[r * padded + rank * local..][..local].to_vec())
                .collect();
            support::assert_close_to_scale(
                d,
                &expected,
                1e-5,
                &format!("dlogits tp {tp} rank {rank}"),
            );
            // Three all-reduces of one f32 per row: never the logits.
            let ar = comm.get(megatron::comm::OpKind::AllReduce);
            assert_eq!((ar.calls, ar.bytes), (3, 3 * rows as u64 * 4), "tp {tp}");
        }
    }
    // Padded columns get no gradient and the plain loss is finite.
    assert!(plain.0.iter().all(|l| l.is_finite()));
    assert!((0..rows).all(|r| {
        plain.1[r * padded + vocab..(r + 1) * padded]
            .iter()
            .all(|&g| g == 0.0)
    }));
}

#[test]
fn vocab_parallel_embedding_and_tied_logits_match_the_whole_table() {
    let (s, b, h, vocab) = (4, 2, 6, 13);
    let ids: Vec<i64> = (0..(s * b) as i64)
        .map(|i| (i * 5) % vocab as i64)
        .collect();
    let spec = EmbeddingSpec {
        vocab_size: vocab,
        hidden: h,
        init_std: 0.02,
        make_vocab_size_divisible_by: 4,
        untied: false,
    };
    let dh = det(s * b * h, 5);
    let run = |tp: usize| {
        on_tp(tp, |cx, bld| {
            let e = if tp == 1 {
                Embedding::build(&spec, bld)?
            } else {
                Embedding::build_vocab(&spec, bld)?
            };
            let ids = Tensor::from_slice(&ids, [s, b])?;
            let (x, saved) = e.forward_vocab(cx, Site::ROOT, &ids)?;
            cx.tp().all_reduce(&x, ReduceOp::Sum)?;
            let (logits, lsaved) = e.logits_forward(cx, Site::ROOT, &x)?;
            let dlogits = Tensor::full(logits.shape().clone(), 0.01, DType::F32);
            let dx = e.logits_backward(cx, Site::ROOT, lsaved, &dlogits)?;
            cx.tp().all_reduce(&dx, ReduceOp::Sum)?;
            e.backward_vocab(cx, Site::ROOT, saved, &tensor(dh.clone(), &[s, b, h]))?;
            Ok((
                x.to_vec::<f32>()?,
                logits.to_vec::<f32>()?,
                dx.to_vec::<f32>()?,
                grads(&[e.weight()]),
                e.padded_vocab_size(),
            ))
        })
    };
    let reference = run(1).remove(0);
    assert_eq!(reference.4, 16);
    for tp in [2, 4] {
        let out = run(tp);
        let padded = out[0].4;
        assert_eq!(padded, padded_vocab_size(vocab, 4, tp));
        for rank in &out {
            support::assert_close_to_scale(&rank.0, &reference.0, 1e-6, "lookup");
            support::assert_close_to_scale(&rank.2, &reference.2, 1e-5, "tied output input grad");
        }
        // Gathered logits: the real vocabulary matches, padding is −∞.
        let local = padded / tp;
        for row in 0..s * b {
            for v in 0..padded {
                let got = out[v / local].1[row * local + v % local];
                if v < vocab {
                    support::assert_close_to_scale(
                        &[got],
                        &[reference.1[row * 16 + v]],
                        1e-5,
                        "logit",
                    );
                } else {
                    assert_eq!(got, f32::NEG_INFINITY);
                }
            }
        }
        let g = assemble(&out.iter().map(|o| o.3.clone()).collect::<Vec<_>>());
        support::assert_close_to_scale(
            &g[0].1[..vocab * h],
            &reference.3[0].1[..vocab * h],
            1e-5,
            "embedding grad",
        );
    }
}

#[test]
fn attention_backward_matches_finite_differences() {
    // Full causal attention, and a sliding window of one key before each query.
    for window in [None, Some(1)] {
        attention_gradient_against_finite_differences(window);
    }
}

fn attention_gradient_against_finite_differences(window: Option<usize>) {
    let (s, b, heads, d) = (5, 2, 2, 3);
    let width = heads * 3 * d;
    let qkv = det(s * b * width, 6);
    let w = det(s * b * heads * d, 7);
    let dir = det(s * b * width, 8);
    on_tp(1, |cx, _| {
        let cx = cx.eval();
        let op = CausalSelfAttention::new(heads, 0.0).with_window(window);
        let loss = |x: &[f32]| -> R<f64> {
            let (y, _) = op.forward(&cx, Site::ROOT, &tensor(x.to_vec(), &[s, b, width]))?;
            Ok(y.to_vec::<f32>()?
                .iter()
                .zip(&w)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum())
        };
        let (_, saved) = op.forward(&cx, Site::ROOT, &tensor(qkv.clone(), &[s, b, width]))?;
        let grad = op
            .backward(
                &cx,
                Site::ROOT,
                saved,
                &tensor(w.clone(), &[s, b, heads * d]),
            )?
            .to_vec::<f32>()?;
        let eps = 1e-2f32;
        let shifted = |sign: f32| {
            qkv.iter()
                .zip(&dir)
                .map(|(x, d)| x + sign * eps * d)
                .collect::<Vec<_>>()
        };
        let fd = (loss(&shifted(1.0))? - loss(&shifted(-1.0))?) / (2.0 * f64::from(eps));
        let analytic: f64 = grad
            .iter()
            .zip(&dir)
            .map(|(g, d)| f64::from(*g) * f64::from(*d))
            .sum();
        assert!(
            (fd - analytic).abs() < 2e-3 * (1.0 + analytic.abs()),
            "window {window:?}: {fd} vs {analytic}"
        );
        Ok(())
    });
}

/// A sliding window of w keys is causal attention over the w + 1 positions ending at the
/// query: each query's output equals the last row of full causal attention over that stretch
/// of the sequence; a window as long as the sequence is causal attention bit for bit.
#[test]
fn a_sliding_window_is_causal_attention_over_the_windows_keys() {
    let (s, b, heads, d, window) = (7, 2, 2, 4, 2);
    let width = heads * 3 * d;
    let qkv = det(s * b * width, 11);
    on_tp(1, |cx, _| {
        let cx = cx.eval();
        let run = |op: &CausalSelfAttention, x: &[f32], len: usize| -> R<Vec<f32>> {
            let (y, _) = op.forward(&cx, Site::ROOT, &tensor(x.to_vec(), &[len, b, width]))?;
            Ok(y.to_vec::<f32>()?)
        };
        let full = CausalSelfAttention::new(heads, 0.0);
        let windowed = run(&full.clone().with_window(Some(window)), &qkv, s)?;
        let out = heads * d;
        for i in 0..s {
            let first = i.saturating_sub(window);
            let stretch = &qkv[first * b * width..(i + 1) * b * width];
            let alone = run(&full, stretch, i + 1 - first)?;
            let last = (i - first) * b * out;
            assert_eq!(
                &windowed[i * b * out..(i + 1) * b * out],
                &alone[last..last + b * out],
                "query {i}"
            );
        }
        assert_eq!(
            run(&full.clone().with_window(Some(s - 1)), &qkv, s)?,
            run(&full, &qkv, s)?
        );
        Ok(())
    });
}

#[test]
fn head_split_attention_with_dropout_matches_tp1() {
    let (s, b, heads, d) = (6, 2, 4, 2);
    let width = heads * 3 * d;
    let qkv = det(s * b * width, 9);
    let dy = det(s * b * heads * d, 10);
    let run = |tp: usize| {
        on_tp(tp, |cx, _| {
            let op = CausalSelfAttention::new(heads, 0.3);
            let local = width / tp;
            let mine: Vec<f32> = qkv
                .chunks(width)
                .flat_map(|row| row[cx.tp_rank() * local..][..local].to_vec())
                .collect();
            let (y, saved) =
                op.forward(cx, Site::ROOT.child("attn"), &tensor(mine, &[s, b, local]))?;
            let out_local = heads * d / tp;
            let dmine: Vec<f32> = dy
                .chunks(heads * d)
                .flat_map(|row| row[cx.tp_rank() * out_local..][..out_local].to_vec())
                .collect();
            let dx = op.backward(
                cx,
                Site::ROOT.child("attn"),
                saved,
                &tensor(dmine, &[s, b, out_local]),
            )?;
            Ok((y.to_vec::<f32>()?, dx.to_vec::<f32>()?))
        })
    };
    let whole = run(1).remove(0);
    for tp in [2, 4] {
        let parts = run(tp);
        let gather = |second: bool, cols: usize| -> Vec<f32> {
            let local = cols / tp;
            let rows = |p: &(Vec<f32>, Vec<f32>), r: usize| {
                let v = if second { &p.1 } else { &p.0 };
                v[r * local..(r + 1) * local].to_vec()
            };
            (0..s * b)
                .flat_map(|r| parts.iter().flat_map(move |p| rows(p, r)))
                .collect()
        };
        support::assert_close_to_scale(
            &gather(false, heads * d),
            &whole.0,
            1e-5,
            &format!("attention output tp {tp}"),
        );
        support::assert_close_to_scale(
            &gather(true, width),
            &whole.1,
            1e-5,
            &format!("attention input grad tp {tp}"),
        );
    }
}

#[test]
fn dropout_masks_do_not_depend_on_the_split() {
    let (rows, cols) = (5, 8);
    let x = det(rows * cols, 11);
    let whole = on_tp(1, |cx, _| {
        Ok(ops::dropout(
            cx,
            Site::ROOT,
            &tensor(x.clone(), &[rows, cols]),
            0.5,
            Sharding::Replicated,
        )?
        .0
        .to_vec::<f32>()?)
    })
    .remove(0);
    let parts = on_tp(2, |cx, _| {
        let local = cols / 2;
        let mine: Vec<f32> = x
            .chunks(cols)
            .flat_map(|r| r[cx.tp_rank() * local..][..local].to_vec())
            .collect();
        Ok(ops::dropout(
            cx,
            Site::ROOT,
            &tensor(mine, &[rows, local]),
            0.5,
            Sharding::SplitLastDim,
        )?
        .0
        .to_vec::<f32>()?)
    });
    let gathered: Vec<f32> = (0..rows)
        .flat_map(|r| {
            parts
                .iter()
                .flat_map(move |p| p[r * 4..(r + 1) * 4].to_vec())
        })
        .collect();
    assert_eq!(gathered, whole);
    assert!(whole.contains(&0.0) && whole.iter().any(|&v| v != 0.0));
}

#[test]
fn bad_inputs_are_errors_naming_the_numbers() {
    on_tp(2, |cx, bld| {
        let e = Embedding::build_vocab(&EmbeddingSpec::new(50, 4), bld)?;
        let err = e
            .forward_vocab(cx, Site::ROOT, &Tensor::from_slice(&[1i64, 50], [2, 1])?)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "token id 50 at position 1 is outside the vocabulary of 50 tokens"
        );
        let err = CausalSelfAttention::new(3, 0.0)
            .forward(cx, Site::ROOT, &Tensor::zeros([2, 1, 9], DType::F32))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "3 attention heads cannot be split over tp = 2");
        let err = bld
            .scoped("fc", |b| Linear::build_column(&LinearSpec::new(4, 5), b))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "parameter fc.weight: dimension 0 of [5, 4] (5) is not divisible by tp = 2"
        );
        let l = Linear::build(&LinearSpec::new(4, 6), bld)?;
        let err = Layer::forward(&l, cx, Site::ROOT, &Tensor::zeros([2, 5], DType::F32))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("input of shape [2, 5] has last dimension ≠ 4"),
            "{err}"
        );
        Ok(())
    });
}
