//! Attention as a general piece (issue 46, section 3): `DotProductAttention` over separate
//! queries, keys and values. With one head size and no groups it computes what
//! `CausalSelfAttention` computes from the fused projection; with grouped heads, a value head
//! size of its own and a sliding window it matches a plain f64 attention, and its gradients
//! match finite differences of that attention; `rope` turns each head as the fused rotary
//! kernels do; under context parallelism (every `--cp-comm-type`, value heads smaller or larger
//! than the query heads) attention and rope give each rank's rows of cp 1's; on the (emulated)
//! GPU it follows the host.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::context_parallel::{ContextParallelMulti, CpChunks, CpCommType};
use megatron::module::{Cx, MultiOp, Op, Sharding, Site};
use megatron::ops::{DotProductAttention, Rope, rope, rope_backward};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::Tensor;
use megatron::tensor_parallel::CausalSelfAttention;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn with_cx<T: Send>(f: impl Fn(&Cx) -> R<T> + Sync) -> T {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    launch(1, |w| -> R<T> {
        let ps = ParallelState::new(&w, &layout)?;
        f(&Cx::new(&ps, 0))
    })
    .unwrap()
    .remove(0)
}

fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
        .collect()
}

const S: usize = 6;
const B: usize = 2;

#[test]
fn one_head_size_without_groups_is_causal_self_attention() {
    let (heads, d) = (3, 4);
    let (q, k, v) = (
        values(S * B * heads * d, 1),
        values(S * B * heads * d, 2),
        values(S * B * heads * d, 3),
    );
    // The fused projection: per head [q | k | v].
    let mut qkv = Vec::new();
    for row in 0..S * B {
        for h in 0..heads {
            for x in [&q, &k, &v] {
                qkv.extend_from_slice(&x[(row * heads + h) * d..(row * heads + h + 1) * d]);
            }
        }
    }
    let dy = values(S * B * heads * d, 4);
    let (general, fused) = with_cx(|cx| {
        let t = |v: &[f32], w: usize| Tensor::from_vec(v.to_vec(), [S, B, w]);
        let (tq, tk, tv) = (t(&q, heads * d)?, t(&k, heads * d)?, t(&v, heads * d)?);
        let dyt = t(&dy, heads * d)?;
        let op = DotProductAttention::new(d);
        let (y, saved) = MultiOp::forward(&op, cx, Site::ROOT, &[&tq, &tk, &tv])?;
        let grads = MultiOp::backward(&op, cx, Site::ROOT, saved, &dyt)?;
        let mut general = vec![y.to_vec::<f32>()?];
        for g in grads {
            general.push(g.to_vec::<f32>()?);
        }
        let core = CausalSelfAttention::new(heads, 0.0);
        let (yf, sf) = Op::forward(&core, cx, Site::ROOT, &t(&qkv, heads * 3 * d)?)?;
        let dqkv = Op::backward(&core, cx, Site::ROOT, sf, &dyt)?.to_vec::<f32>()?;
        Ok((general, (yf.to_vec::<f32>()?, dqkv)))
    });
    let close = |a: &[f32], b: &[f32], what: &str| {
        let worst = support::max_abs_diff(a, b);
        assert!(worst < 1e-6, "{what}: {worst}");
    };
    close(&general[0], &fused.0, "output");
    // The fused gradient's per-head [dq | dk | dv] against the three.
    for (part, g) in general[1..].iter().enumerate() {
        let mut want = Vec::new();
        for row in 0..S * B {
            for h in 0..heads {
                let at = ((row * heads + h) * 3 + part) * d;
                want.extend_from_slice(&fused.1[at..at + d]);
            }
        }
        close(g, &want, ["dq", "dk", "dv"][part]);
    }
}

/// Causal attention in f64 with grouped heads, per-head sizes and a window: `[s, b, ·]` rows.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (heads, kv_heads, d, dv): (usize, usize, usize, usize),
    window: Option<usize>,
) -> Vec<f64> {
    let mut out = vec![0.0; S * B * heads * dv];
    let group = heads / kv_heads;
    for b in 0..B {
        for h in 0..heads {
            let g = h / group;
            for i in 0..S {
                let lo = window.map_or(0, |w| i.saturating_sub(w));
                let qi = &q[((i * B + b) * heads + h) * d..][..d];
                let scores: Vec<f64> = (lo..=i)
                    .map(|j| {
                        let kj = &k[((j * B + b) * kv_heads + g) * d..][..d];
                        qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (t, j) in (lo..=i).enumerate() {
                    let vj = &v[((j * B + b) * kv_heads + g) * dv..][..dv];
                    for c in 0..dv {
                        out[((i * B + b) * heads + h) * dv + c] += e[t] / z * vj[c];
                    }
                }
            }
        }
    }
    out
}

#[test]
fn grouped_heads_and_their_own_value_size_match_f64_and_finite_differences() {
    let (heads, kv_heads, d, dv, window) = (4, 2, 3, 5, Some(3));
    let (q, k, v) = (
        values(S * B * heads * d, 5),
        values(S * B * kv_heads * d, 6),
        values(S * B * kv_heads * dv, 7),
    );
    let c = values(S * B * heads * dv, 8);
    let (y, grads) = with_cx(|cx| {
        let t = |x: &[f32], w: usize| Tensor::from_vec(x.to_vec(), [S, B, w]);
        let op = DotProductAttention::new(d).with_window(window);
        let (tq, tk, tv) = (
            t(&q, heads * d)?,
            t(&k, kv_heads * d)?,
            t(&v, kv_heads * dv)?,
        );
        let (y, saved) = MultiOp::forward(&op, cx, Site::ROOT, &[&tq, &tk, &tv])?;
        let grads = MultiOp::backward(&op, cx, Site::ROOT, saved, &t(&c, heads * dv)?)?;
        let grads: Vec<Vec<f32>> = grads
            .iter()
            .map(|g| g.to_vec::<f32>())
            .collect::<Result<_, _>>()?;
        Ok((y.to_vec::<f32>()?, grads))
    });
    let f64s = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
    let (q64, k64, v64) = (f64s(&q), f64s(&k), f64s(&v));
    let sizes = (heads, kv_heads, d, dv);
    let want = reference(&q64, &k64, &v64, sizes, window);
    for (i, (g, w)) in y.iter().zip(&want).enumerate() {
        assert!((f64::from(*g) - w).abs() < 1e-5, "y[{i}] {g} vs {w}");
    }
    // Σ y ⊙ c, differentiated numerically in f64 at a few inputs of each.
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        reference(q, k, v, sizes, window)
            .iter()
            .zip(&c)
            .map(|(y, c)| y * f64::from(*c))
            .sum()
    };
    let h = 1e-6;
    for (which, n) in [(0, q.len()), (1, k.len()), (2, v.len())] {
        for i in [0, n / 3, n / 2, n - 1] {
            let mut ins = [q64.clone(), k64.clone(), v64.clone()];
            ins[which][i] += h;
            let plus = loss(&ins[0], &ins[1], &ins[2]);
            ins[which][i] -= 2.0 * h;
            let minus = loss(&ins[0], &ins[1], &ins[2]);
            let numeric = (plus - minus) / (2.0 * h);
            let got = f64::from(grads[which][i]);
            assert!(
                (got - numeric).abs() < 1e-4 * (1.0 + numeric.abs()),
                "d{}[{i}] = {got}, finite differences {numeric}",
                ["q", "k", "v"][which]
            );
        }
    }
}

#[test]
fn rope_turns_each_head_as_the_fused_kernels_do_and_back() {
    let (heads, d) = (3, 4);
    let x = values(S * B * heads * d, 9);
    let (turned, back, fused) = with_cx(|cx| {
        let t = Tensor::from_vec(x.clone(), [S, B, heads * d])?;
        let cfg = Rope::new(d);
        let (y, saved) = rope(cx, Site::ROOT, &t, &cfg, Sharding::Replicated)?;
        let back = rope_backward(cx, Site::ROOT, &cfg, saved, &y)?;
        // The fused path: every head a rotated one.
        let fused = cfg.rotary.apply(&t, (heads, 1, 1), d, 0, false)?;
        Ok((
            y.to_vec::<f32>()?,
            back.to_vec::<f32>()?,
            fused.to_vec::<f32>()?,
        ))
    });
    assert_eq!(turned, fused);
    // A rotation's backward is its inverse: the gradient of `y` turned back is `x`.
    for (a, b) in back.iter().zip(&x) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
    // Position 0 is not turned; later positions are.
    assert_eq!(turned[..B * heads * d], x[..B * heads * d]);
    assert_ne!(turned[B * heads * d..], x[B * heads * d..]);
}

/// Rope of `x` and attention of `q`, `k`, `v` (each `[s, b, ..]`) with output gradient `dy`,
/// and the inputs' gradients, on each rank of a `cp`-way group holding its chunks: every
/// rank's (rope, out, dq, dk, dv), in rank order.
fn chunked(
    (cp, kind): (usize, CpCommType),
    op: &DotProductAttention,
    cfg: &Rope,
    [x, q, k, v, dy]: [&Tensor; 5],
) -> Vec<[Vec<f32>; 5]> {
    let layout = ParallelLayout::new(&ParallelConfig::new(cp).with_cp(cp)).unwrap();
    launch(cp, |w| -> R<[Vec<f32>; 5]> {
        let ps = ParallelState::new(&w, &layout)?.with_cp_comm_type(&w, kind)?;
        let cx = Cx::new(&ps, 3);
        let chunks = CpChunks::new(x.dims()[0], cp, ps.groups().cp_rank())?;
        let mine = |t: &Tensor| chunks.take_local(t);
        let (turned, _) = rope(&cx, Site::ROOT, &mine(x)?, cfg, Sharding::Replicated)?;
        let (qm, km, vm) = (mine(q)?, mine(k)?, mine(v)?);
        let (y, saved) = op.forward_chunks(&cx, Site::ROOT, &[&qm, &km, &vm])?;
        let grads = op.backward_chunks(&cx, Site::ROOT, saved, &mine(dy)?)?;
        let [dq, dk, dv] = <[Tensor; 3]>::try_from(grads).expect("three gradients");
        Ok([turned, y, dq, dk, dv].map(|t| t.to_vec::<f32>().expect("f32")))
    })
    .unwrap()
}

#[test]
fn context_parallel_attention_and_rope_give_the_ranks_rows_of_cp_1() {
    let (s, b) = (16, 2);
    // 4 query heads sharing 2 key heads; values smaller, then larger than the query heads
    // (each padded to the larger inside the blocks); a window cutting the chunks.
    for (d_qk, d_v, window) in [(5, 3, None), (3, 5, Some(5))] {
        let (heads, kv) = (4, 2);
        let t = |w: usize, salt: usize| Tensor::from_vec(values(s * b * w, salt), [s, b, w]);
        let q = t(heads * d_qk, 1).unwrap();
        let k = t(kv * d_qk, 2).unwrap();
        let v = t(kv * d_v, 3).unwrap();
        let dy = t(heads * d_v, 4).unwrap();
        let x = t(heads * 4, 5).unwrap();
        let op = DotProductAttention::new(d_qk).with_window(window);
        let cfg = Rope::new(4);
        let inputs = [&x, &q, &k, &v, &dy];
        let full = chunked((1, CpCommType::default()), &op, &cfg, inputs).remove(0);
        let forms = [
            (2, CpCommType::P2p),
            (2, CpCommType::AllGather),
            (2, CpCommType::A2a),
            (4, CpCommType::AllGather),
        ];
        for (cp, kind) in forms {
            for (rank, got) in chunked((cp, kind), &op, &cfg, inputs).iter().enumerate() {
                let chunks = CpChunks::new(s, cp, rank).unwrap();
                let widths = [heads * 4, heads * d_v, heads * d_qk, kv * d_qk, kv * d_v];
                let names = ["rope", "out", "dq", "dk", "dv"];
                for (i, (got, want)) in got.iter().zip(&full).enumerate() {
                    let per = b * widths[i];
                    let rows: Vec<f32> = chunks
                        .ranges()
                        .into_iter()
                        .flat_map(|r| want[r.start * per..r.end * per].to_vec())
                        .collect();
                    let what = format!(
                        "{} d_qk {d_qk} d_v {d_v} cp {cp} {kind:?} rank {rank}",
                        names[i]
                    );
                    support::assert_close_f32(got, &rows, &what);
                }
            }
        }
    }
}

#[cfg(feature = "cuda")]
#[path = "../megatron-core/tests/emulated/device.rs"]
mod device;

/// On the GPU (or the emulated one) the general attention follows the host.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn the_general_attention_on_the_gpu_follows_the_host() {
    device::install_if_requested(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/megatron-core"
    )));
    let gpu = megatron::cuda::Gpu::new(0).expect("GPU 0");
    // The unfused kernels in f32 (heads padded from 3 to 5); then bf16 products through the
    // flash kernels (heads of 32, the values' 24 padded to them), to bf16's precision.
    // Also with packed documents attended apart (each document a sequence of its own on
    // every kernel: sample 0 has documents 0..2, 2..5, 5..6; sample 1 one).
    // The flash kernels take the documents in one launch each way: as many kernels as without
    // them, no more tiles (the emulated GPU counts both, a real one neither; the tiles skipped
    // at longer sequences: tests/flash_attention_on_cpu.rs).
    let docs = megatron::documents::Documents::from_starts(S, vec![vec![2, 5], vec![]], true, true)
        .unwrap();
    let mut flash_counts = Vec::new();
    for ((d, dv, flash, tolerance), packed) in [(3, 5, false, 1e-5), (32, 24, true, 3e-2)]
        .into_iter()
        .flat_map(|c| [(c, false), (c, true)])
    {
        gpu.set_bf16_products(flash);
        gpu.set_flash_attention(flash);
        let (heads, kv_heads) = (4, 2);
        let (q, k, v) = (
            values(S * B * heads * d, 5),
            values(S * B * kv_heads * d, 6),
            values(S * B * kv_heads * dv, 7),
        );
        let c = values(S * B * heads * dv, 8);
        // The outputs and gradients, and what the rank asked of the emulated GPU meanwhile.
        let run = |place: &(dyn Fn(Tensor) -> megatron::Result<Tensor> + Sync)| {
            with_cx(|cx| {
                let before = device::launches();
                let cx = &match packed {
                    true => cx.with_documents(&docs),
                    false => cx.at(0, 0),
                };
                let t = |x: &[f32], w: usize| place(Tensor::from_vec(x.to_vec(), [S, B, w])?);
                let op = DotProductAttention::new(d).with_window(Some(3));
                let (tq, tk, tv) = (
                    t(&q, heads * d)?,
                    t(&k, kv_heads * d)?,
                    t(&v, kv_heads * dv)?,
                );
                let (y, saved) = MultiOp::forward(&op, cx, Site::ROOT, &[&tq, &tk, &tv])?;
                let grads = MultiOp::backward(&op, cx, Site::ROOT, saved, &t(&c, heads * dv)?)?;
                let mut out = vec![y.to_vec::<f32>()?];
                for g in grads {
                    out.push(g.to_vec::<f32>()?);
                }
                Ok((out, before.zip(device::launches()).map(|(b, a)| a - b)))
            })
        };
        let (host, _) = run(&Ok);
        let (on_gpu, counts) = run(&|t| t.to_gpu(&gpu));
        if flash && let Some(counts) = counts {
            flash_counts.push(counts);
        }
        for (i, (g, h)) in on_gpu.iter().zip(&host).enumerate() {
            let worst = support::max_abs_diff(g, h);
            assert!(
                worst < tolerance,
                "flash {flash}, packed {packed}, output {i}: {worst}"
            );
        }
    }
    if device::launches().is_some() {
        assert_eq!(flash_counts.len(), 2, "the emulated GPU counted both runs");
    }
    if let [plain, packed] = flash_counts[..] {
        eprintln!("flash: {plain:?} one document a sample, {packed:?} packed");
        assert_eq!(packed.kernels, plain.kernels, "{plain:?} vs {packed:?}");
        assert!(
            packed.tiles <= plain.tiles && packed.tiles > 0,
            "{plain:?} vs {packed:?}"
        );
    }
    gpu.set_bf16_products(false);
    gpu.set_flash_attention(false);
}

#[test]
fn inputs_that_are_not_whole_heads_are_errors_naming_the_sizes() {
    let errors = with_cx(|cx| {
        let t = |w: usize| Tensor::from_vec(vec![0.5f32; S * B * w], [S, B, w]);
        let op = DotProductAttention::new(4);
        // Queries of 10 features are not heads of 4.
        let heads = MultiOp::forward(&op, cx, Site::ROOT, &[&t(10)?, &t(8)?, &t(8)?])
            .err()
            .map(|e| e.to_string());
        // Three query heads cannot share two key heads.
        let groups = MultiOp::forward(&op, cx, Site::ROOT, &[&t(12)?, &t(8)?, &t(8)?])
            .err()
            .map(|e| e.to_string());
        // Two tensors are not queries, keys and values.
        let count = MultiOp::forward(&op, cx, Site::ROOT, &[&t(8)?, &t(8)?])
            .err()
            .map(|e| e.to_string());
        let rope = rope(cx, Site::ROOT, &t(10)?, &Rope::new(4), Sharding::Replicated)
            .err()
            .map(|e| e.to_string());
        Ok([heads, groups, count, rope])
    });
    let [heads, groups, count, rope] = errors.map(|e| e.expect("an error"));
    assert!(
        heads.contains("queries of 10") && heads.contains("heads of 4"),
        "{heads}"
    );
    assert!(
        groups.contains("3 query heads cannot share 2 key heads"),
        "{groups}"
    );
    assert!(count.contains("not 2 tensors"), "{count}");
    assert!(
        rope.contains("10 features are not whole heads of 4"),
        "{rope}"
    );
}

#[test]
fn the_general_attention_as_a_plain_op_at_cp_2_names_the_attribute() {
    let layout = ParallelLayout::new(&ParallelConfig::new(2).with_cp(2)).unwrap();
    let errors = launch(2, |w| -> R<String> {
        let ps = ParallelState::new(&w, &layout)?;
        let cx = Cx::new(&ps, 3);
        let t = Tensor::from_vec(vec![0.5f32; 4 * 8], [4, 1, 8])?;
        let op = DotProductAttention::new(4);
        Ok(MultiOp::forward(&op, &cx, Site::ROOT, &[&t, &t, &t])
            .expect_err("an #[op] attention at cp 2")
            .to_string())
    })
    .unwrap();
    assert!(
        errors[0].contains("declare its field #[context_parallel]"),
        "{}",
        errors[0]
    );
}
