//! The attention, embedding and vocab-parallel cross-entropy layers on the GPU against the same
//! layers on the host: a model built on the host, a clone moved to the GPU, the same inputs
//! through both (host and device inputs), outputs, input gradients and parameter gradients
//! compared (attention dropout masks are the CPU's). Then tensor parallelism 2 on one GPU (the
//! device-local communicator) against the host at tp 1.
//!
//! Every test needs a GPU: they are ignored by default and run with
//! `cargo test -p megatron-core --features cuda --test cuda_layers_attention_vocab -- --ignored`.
#![cfg(feature = "cuda")]

mod support;

use std::sync::Arc;

use megatron_core::comm::gpu_local::LocalGpu;
use megatron_core::comm::threads::launch;
use megatron_core::comm::{ParallelState, ReduceOp};
use megatron_core::cuda::Gpu;
use megatron_core::module::{
    Builder, Cx, Lookup, Module, Op, Param, ParamSpec, Site, VocabParallel, assemble_logical,
    params_to_gpu,
};
use megatron_core::parallel::{ParallelConfig, ParallelLayout};
use megatron_core::tensor::{DType, Tensor};
use megatron_core::tensor_parallel::{
    CausalSelfAttention, Embedding, EmbeddingSpec, PositionEmbedding, PositionEmbeddingSpec,
    split_last_dim, vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward,
    vocab_parallel_cross_entropy_backward_to,
};
use support::{det, gpu, tensor};

type R<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `t`'s elements as f32 (bf16 outputs widened).
fn host(t: &Tensor) -> Vec<f32> {
    t.to_f32_contiguous().unwrap().to_vec::<f32>().unwrap()
}

/// `a` against `b` within `tol` relative to `b`'s largest finite magnitude; infinities and
/// NaNs must match exactly.
fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(1e-6);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if !y.is_finite() {
            assert!(
                x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                "{what}[{i}]: {x} vs {y}"
            );
            continue;
        }
        assert!(
            (x - y).abs() <= tol * scale,
            "{what}[{i}]: GPU {x} vs host {y} (scale {scale})"
        );
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The gradient of one parameter, wherever it lives.
fn grad(p: &Param) -> Vec<f32> {
    host(p.grad())
}

/// Deterministic attention inputs of `(seq, batch, heads, head_dim)`: the fused projection
/// `[s, b, heads·3·d]` and an output gradient `[s, b, heads·d]`.
fn attention_inputs(s: usize, b: usize, heads: usize, d: usize) -> (Tensor, Tensor) {
    let width = heads * 3 * d;
    let qkv = tensor(
        det(s * b * width, s + d).iter().map(|x| 2.0 * x).collect(),
        &[s, b, width],
    );
    let dy = tensor(det(s * b * heads * d, 3 * s + b), &[s, b, heads * d]);
    (qkv, dy)
}

/// Attention forward and backward: (output, input gradient).
fn attention(op: &CausalSelfAttention, cx: &Cx, qkv: &Tensor, dy: &Tensor) -> R<(Tensor, Tensor)> {
    let site = Site::ROOT.child("attn");
    let (y, saved) = op.forward(cx, site, qkv)?;
    let dx = op.backward(cx, site, saved, dy)?;
    Ok((y, dx))
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn attention_on_the_gpu_matches_the_host() -> R {
    let g = gpu();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234);
    // (seq, batch, heads, head_dim): odd sizes, one head, one batch entry, one position.
    // (seq, batch, heads, head_dim, sliding window): odd sizes, one head, one batch entry, one
    // position; windows inside and across the softmax kernels' groups of 4 keys.
    for (s, b, heads, d, window) in [
        (7, 3, 4, 8, None),
        (5, 1, 1, 3, None),
        (1, 2, 2, 4, None),
        (33, 2, 3, 16, None),
        (7, 3, 4, 8, Some(2)),
        (33, 2, 3, 16, Some(5)),
        (9, 1, 1, 3, Some(0)),
    ] {
        let (qkv, dy) = attention_inputs(s, b, heads, d);
        for (p, training) in [(0.0, true), (0.3, true), (0.3, false)] {
            let op = CausalSelfAttention::new(heads, p).with_window(window);
            let cx = if training { cx.at(2, 1) } else { cx.eval() };
            let (y_h, dx_h) = attention(&op, &cx, &qkv, &dy)?;
            let (y_d, dx_d) = attention(&op, &cx, &qkv.to_gpu(&g)?, &dy.to_gpu(&g)?)?;
            assert!(
                y_d.gpu().is_some() && dx_d.gpu().is_some(),
                "results stay on the GPU"
            );
            assert_eq!(y_d.dims(), y_h.dims());
            assert_eq!(dx_d.dims(), dx_h.dims());
            let what = format!(
                "s {s} b {b} heads {heads} d {d} window {window:?} p {p} training {training}"
            );
            close(
                &host(&y_d),
                &host(&y_h),
                1e-5,
                &format!("attention output, {what}"),
            );
            close(
                &host(&dx_d),
                &host(&dx_h),
                1e-5,
                &format!("attention input grad, {what}"),
            );
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn flash_attention_on_the_gpu_matches_the_host() -> R {
    // A handle of its own: the products and attention settings are per handle.
    let g = gpu().with_new_stream()?;
    g.set_bf16_products(true);
    g.set_flash_attention(true);
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 99);
    // (seq, batch, heads, head_dim): every built head size, partial tiles, several tiles; and
    // a head size the kernels lack (attention stays unfused there).
    for (s, b, heads, d) in [
        (70, 2, 2, 64),
        (37, 1, 3, 96),
        (130, 1, 1, 128),
        (33, 2, 2, 32),
        (7, 3, 4, 8),
    ] {
        let (qkv, dy) = attention_inputs(s, b, heads, d);
        for (p, training) in [(0.0, true), (0.3, true), (0.3, false)] {
            let op = CausalSelfAttention::new(heads, p);
            let cx = if training { cx.at(2, 1) } else { cx.eval() };
            let (y_h, dx_h) = attention(&op, &cx, &qkv, &dy)?;
            let (y_d, dx_d) = attention(&op, &cx, &qkv.to_gpu(&g)?, &dy.to_gpu(&g)?)?;
            let what = format!("s {s} b {b} heads {heads} d {d} p {p} training {training}");
            // bf16 operands against f32 ones.
            close(
                &host(&y_d),
                &host(&y_h),
                2e-2,
                &format!("flash output, {what}"),
            );
            close(
                &host(&dx_d),
                &host(&dx_h),
                3e-2,
                &format!("flash input grad, {what}"),
            );
            // The backward has no atomics: a second run is the same bit for bit.
            let (y_2, dx_2) = attention(&op, &cx, &qkv.to_gpu(&g)?, &dy.to_gpu(&g)?)?;
            assert_eq!(bits(&host(&y_2)), bits(&host(&y_d)), "{what}");
            assert_eq!(bits(&host(&dx_2)), bits(&host(&dx_d)), "{what}");
        }
    }
    Ok(())
}

/// Sliding windows in the flash kernels: a window inside one key tile, and one reaching across
/// tiles of 64 keys (the forward's tiles before a row's window, the key-gradient's queries past
/// a key's), as the host computes them, dropout included.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn flash_attention_with_a_sliding_window_matches_the_host() -> R {
    let g = gpu().with_new_stream()?;
    g.set_bf16_products(true);
    g.set_flash_attention(true);
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 7);
    for (s, b, heads, d, window) in [(70, 2, 2, 64, 5), (150, 1, 1, 32, 66)] {
        let (qkv, dy) = attention_inputs(s, b, heads, d);
        for (p, training) in [(0.0, false), (0.3, true)] {
            let op = CausalSelfAttention::new(heads, p).with_window(Some(window));
            let cx = if training { cx.at(2, 1) } else { cx.eval() };
            let (y_h, dx_h) = attention(&op, &cx, &qkv, &dy)?;
            let (y_d, dx_d) = attention(&op, &cx, &qkv.to_gpu(&g)?, &dy.to_gpu(&g)?)?;
            let what = format!("s {s} b {b} heads {heads} d {d} window {window} p {p}");
            close(
                &host(&y_d),
                &host(&y_h),
                2e-2,
                &format!("flash output, {what}"),
            );
            close(
                &host(&dx_d),
                &host(&dx_h),
                3e-2,
                &format!("flash input grad, {what}"),
            );
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn flash_backward_in_chunks_of_queries_matches_one_chunk() -> R {
    use megatron_core::cuda::kernels::flash_attention::{
        FlashShape, SCORE_GRADIENT_BUDGET, flash_attention_backward, flash_attention_forward,
    };
    use megatron_core::cuda::kernels::operand::In;
    let g = gpu();
    // Four chunks of 64 queries with the smallest budget, the last partial.
    let sh = FlashShape {
        seq: 200,
        batch: 2,
        heads: 2,
        head_dim: 64,
        window: None,
    };
    let qkv: Vec<half::bf16> = det(sh.qkv_len(), 3)
        .into_iter()
        .map(half::bf16::from_f32)
        .collect();
    let qkv = g.upload(&qkv)?;
    let d_out = g.upload(&det(sh.out_len(), 4))?;
    let mut out = g.zeros::<half::bf16>(sh.out_len())?;
    let mut lse = g.zeros::<f32>(sh.rows())?;
    let scale = 0.125;
    flash_attention_forward(
        &g,
        &qkv.as_view(),
        sh,
        scale,
        None,
        None,
        &mut out.as_view_mut(),
        &mut lse.as_view_mut(),
    )?;
    let (qkv_v, out_v, lse_v, d_out_v) =
        (qkv.as_view(), out.as_view(), lse.as_view(), d_out.as_view());
    let backward = |budget: usize| -> R<Vec<half::bf16>> {
        let mut d_qkv = g.zeros::<half::bf16>(sh.qkv_len())?;
        flash_attention_backward(
            &g,
            &qkv_v,
            &out_v,
            &lse_v,
            In::F32(&d_out_v),
            sh,
            scale,
            None,
            None,
            &mut d_qkv.as_view_mut(),
            budget,
        )?;
        Ok(g.download(&d_qkv)?)
    };
    let (whole, chunked) = (backward(SCORE_GRADIENT_BUDGET)?, backward(1)?);
    let widen = |v: Vec<half::bf16>| v.into_iter().map(f32::from).collect::<Vec<f32>>();
    let (whole, chunked) = (widen(whole), widen(chunked));
    // Key and value gradients rounded to bf16 once per chunk.
    close(&chunked, &whole, 1e-2, "flash gradient in chunks");
    // The query gradients of a chunk do not depend on the others: the same bits.
    let dq = |v: &[f32]| -> Vec<u32> {
        v.chunks(sh.head_dim)
            .step_by(3)
            .flatten()
            .map(|x| x.to_bits())
            .collect()
    };
    assert_eq!(dq(&chunked), dq(&whole));
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn flash_kernels_refuse_what_they_lack_with_the_numbers() -> R {
    use megatron_core::cuda::kernels::flash_attention::{FlashShape, flash_attention_forward};
    let g = gpu();
    let sh = FlashShape {
        seq: 4,
        batch: 1,
        heads: 1,
        head_dim: 48,
        window: None,
    };
    let qkv = g.zeros::<half::bf16>(sh.qkv_len())?;
    let mut out = g.zeros::<half::bf16>(sh.out_len())?;
    let mut lse = g.zeros::<f32>(sh.rows())?;
    let run = |sh: FlashShape,
               scale: f32,
               out: &mut cudarc::driver::CudaSlice<half::bf16>,
               lse: &mut cudarc::driver::CudaSlice<f32>| {
        flash_attention_forward(
            &g,
            &qkv.as_view(),
            sh,
            scale,
            None,
            None,
            &mut out.as_view_mut(),
            &mut lse.as_view_mut(),
        )
        .expect_err("refused")
        .to_string()
    };
    let msg = run(sh, 1.0, &mut out, &mut lse);
    assert!(
        msg.contains("head size 48 is not one of the built ones [32, 64, 96, 128]"),
        "{msg}"
    );
    let sh = FlashShape { head_dim: 32, ..sh };
    let msg = run(sh, 1.0, &mut out, &mut lse);
    assert!(
        msg.contains("`qkv` has 576 elements, expected 384"),
        "{msg}"
    );
    let msg = run(sh, -0.5, &mut out, &mut lse);
    assert!(
        msg.contains("the score scale must be positive and finite, not -0.5"),
        "{msg}"
    );
    Ok(())
}

/// What the embedding head gives on one rank: lookup output, logits, losses, dlogits, the input
/// gradient of the tied layer, and the parameter gradients (word, position).
struct Head {
    x: Vec<f32>,
    logits: Vec<f32>,
    losses: Vec<f32>,
    dlogits: Vec<f32>,
    dh: Vec<f32>,
    grads: Vec<(ParamSpec, Vec<f32>)>,
}

/// ids → word + position embedding → tied logits → vocab-parallel cross-entropy, and back.
/// `put` moves an input to the layers' device (or leaves it on the host).
fn head(
    cx: &Cx,
    wte: &Embedding,
    wpe: &PositionEmbedding,
    ids: &Tensor,
    targets: &Tensor,
    dloss: &Tensor,
    put: &dyn Fn(&Tensor) -> R<Tensor>,
) -> R<Head> {
    let (e, s_wte) = wte.forward_vocab(cx, Site::ROOT.child("wte"), &put(ids)?)?;
    cx.tp().all_reduce(&e, ReduceOp::Sum)?;
    let (p, s_wpe) = Lookup::forward(wpe, cx, Site::ROOT.child("wpe"), &put(ids)?)?;
    let x = megatron_core::ops::add(&e, &p)?;
    let (logits, s_logits) = wte.logits_forward(cx, Site::ROOT.child("logits"), &x)?;
    let (losses, s_ce) = vocab_parallel_cross_entropy(cx, Site::ROOT, &logits, &put(targets)?)?;
    let dlogits = vocab_parallel_cross_entropy_backward(cx, Site::ROOT, s_ce, &put(dloss)?)?;
    let dh = wte.logits_backward(cx, Site::ROOT.child("logits"), s_logits, &dlogits)?;
    cx.tp().all_reduce(&dh, ReduceOp::Sum)?;
    wte.backward_vocab(cx, Site::ROOT.child("wte"), s_wte, &dh)?;
    Lookup::backward(wpe, cx, Site::ROOT.child("wpe"), s_wpe, &dh)?;
    Ok(Head {
        x: host(&x),
        logits: host(&logits),
        losses: host(&losses),
        dlogits: host(&dlogits),
        dh: host(&dh),
        grads: [wte.weight(), wpe_weight(wpe)]
            .iter()
            .map(|p| (p.spec().clone(), grad(p)))
            .collect(),
    })
}

fn wpe_weight(wpe: &PositionEmbedding) -> &Param {
    let mut out = None;
    wpe.visit_params(&mut |p| out = Some(p));
    out.expect("the position embedding has a weight")
}

fn zero_grads<M: Module>(m: &M) {
    m.visit_params(&mut |p| p.grad().fill(0.0).unwrap());
}

const VOCAB: usize = 13;
const HIDDEN: usize = 24;
const SEQ: usize = 6;
const BATCH: usize = 3;

fn specs() -> (EmbeddingSpec, PositionEmbeddingSpec) {
    (
        EmbeddingSpec {
            vocab_size: VOCAB,
            hidden: HIDDEN,
            init_std: 0.5,
            make_vocab_size_divisible_by: 4,
            untied: false,
        },
        PositionEmbeddingSpec {
            max_positions: 8,
            hidden: HIDDEN,
            init_std: 0.5,
        },
    )
}

fn inputs() -> (Tensor, Tensor, Tensor) {
    let n = SEQ * BATCH;
    let ids: Vec<i64> = (0..n as i64).map(|i| (i * 5 + 2) % VOCAB as i64).collect();
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 7 + 1) % VOCAB as i64).collect();
    (
        Tensor::from_slice(&ids, [SEQ, BATCH]).unwrap(),
        Tensor::from_slice(&targets, [SEQ, BATCH]).unwrap(),
        tensor(det(n, 11), &[SEQ, BATCH]),
    )
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn the_logits_gradient_for_products_is_bf16_with_the_f32_ones_bits_rounded() -> R {
    // A handle that multiplies in bf16; logits of 6 rows × 16 (a vocabulary slice).
    let g = gpu().with_new_stream()?;
    g.set_bf16_products(true);
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234);
    let (rows, vocab) = (6, 16);
    let logits = tensor(
        det(rows * vocab, 41).iter().map(|x| 4.0 * x).collect(),
        &[rows, vocab],
    );
    let targets = Tensor::from_vec((0..rows as i64).map(|r| (r * 5) % 16).collect(), [rows])?;
    let dloss = tensor(det(rows, 42), &[rows]).to_gpu(&g)?;
    let (_, saved) = vocab_parallel_cross_entropy(&cx, Site::ROOT, &logits.to_gpu(&g)?, &targets)?;
    let f32_grad = vocab_parallel_cross_entropy_backward(&cx, Site::ROOT, saved.clone(), &dloss)?;
    let to_products = true;
    let bf16_grad =
        vocab_parallel_cross_entropy_backward_to(&cx, Site::ROOT, saved, &dloss, to_products)?;
    assert_eq!(
        (f32_grad.dtype(), bf16_grad.dtype()),
        (DType::F32, DType::BF16)
    );
    let rounded = f32_grad.to_dtype(DType::BF16)?.to_vec::<half::bf16>()?;
    let got = bf16_grad.to_vec::<half::bf16>()?;
    let bits16 = |v: Vec<half::bf16>| v.into_iter().map(half::bf16::to_bits).collect::<Vec<_>>();
    assert_eq!(bits16(got), bits16(rounded));
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn embeddings_tied_logits_and_cross_entropy_on_the_gpu_match_the_host() -> R {
    let g = gpu();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1234);
    let mut b = Builder::for_rank(99, ps.groups());
    let (espec, pspec) = specs();
    let wte = Embedding::build_vocab(&espec, &mut b)?;
    let wpe = PositionEmbedding::build(&pspec, &mut b)?;
    let (ids, targets, dloss) = inputs();
    let reference = head(&cx, &wte, &wpe, &ids, &targets, &dloss, &|t| Ok(t.clone()))?;
    assert_eq!(wte.padded_vocab_size(), 16, "padding rows to mask");
    let (mut wte_d, mut wpe_d) = (wte.clone(), wpe.clone());
    params_to_gpu(&mut wte_d, &g)?;
    params_to_gpu(&mut wpe_d, &g)?;
    // Inputs left on the host (ids and targets uploaded by the layers) and put on the device.
    let on_host: &dyn Fn(&Tensor) -> R<Tensor> = &|t| Ok(t.clone());
    let on_device: &dyn Fn(&Tensor) -> R<Tensor> = &|t| Ok(t.to_gpu(&g)?);
    for (how, put) in [("host inputs", on_host), ("device inputs", on_device)] {
        zero_grads(&wte_d);
        zero_grads(&wpe_d);
        let out = head(&cx, &wte_d, &wpe_d, &ids, &targets, &dloss, put)?;
        assert_eq!(
            bits(&out.x),
            bits(&reference.x),
            "{how}: the lookups are exact"
        );
        close(
            &out.logits,
            &reference.logits,
            1e-5,
            &format!("{how}: logits"),
        );
        for row in 0..SEQ * BATCH {
            assert!(
                out.logits[row * 16 + VOCAB..(row + 1) * 16]
                    .iter()
                    .all(|&l| l == f32::NEG_INFINITY)
            );
        }
        close(
            &out.losses,
            &reference.losses,
            1e-5,
            &format!("{how}: losses"),
        );
        close(
            &out.dlogits,
            &reference.dlogits,
            1e-5,
            &format!("{how}: dlogits"),
        );
        close(
            &out.dh,
            &reference.dh,
            1e-5,
            &format!("{how}: tied layer input grad"),
        );
        for ((spec, got), (_, want)) in out.grads.iter().zip(&reference.grads) {
            close(got, want, 1e-5, &format!("{how}: {} grad", spec.name));
        }
    }

    // The lookup's own gradient is the CPU's bit for bit (no tied product in it).
    let dy = tensor(det(SEQ * BATCH * HIDDEN, 12), &[SEQ, BATCH, HIDDEN]);
    zero_grads(&wte);
    zero_grads(&wte_d);
    let (_, s) = Lookup::forward(&wte, &cx, Site::ROOT, &ids)?;
    Lookup::backward(&wte, &cx, Site::ROOT, s, &dy)?;
    let (_, s) = Lookup::forward(&wte_d, &cx, Site::ROOT, &ids.to_gpu(&g)?)?;
    Lookup::backward(&wte_d, &cx, Site::ROOT, s, &dy.to_gpu(&g)?)?;
    assert_eq!(
        bits(&grad(wte_d.weight())),
        bits(&grad(wte.weight())),
        "lookup grad bits"
    );

    // So are the position embedding's output and gradient (summed over the batch in the CPU's
    // order).
    zero_grads(&wpe);
    zero_grads(&wpe_d);
    let (p_h, s) = Lookup::forward(&wpe, &cx, Site::ROOT, &ids)?;
    Lookup::backward(&wpe, &cx, Site::ROOT, s, &dy)?;
    let (p_d, s) = Lookup::forward(&wpe_d, &cx, Site::ROOT, &ids)?;
    Lookup::backward(&wpe_d, &cx, Site::ROOT, s, &dy.to_gpu(&g)?)?;
    assert_eq!(
        bits(&host(&p_d)),
        bits(&host(&p_h)),
        "position embedding bits"
    );
    assert_eq!(
        bits(&grad(wpe_weight(&wpe_d))),
        bits(&grad(wpe_weight(&wpe))),
        "position embedding grad bits"
    );

    // Gradients accumulate, as on the host.
    let (_, s) = Lookup::forward(&wte_d, &cx, Site::ROOT, &ids)?;
    Lookup::backward(&wte_d, &cx, Site::ROOT, s, &dy.to_gpu(&g)?)?;
    let twice: Vec<f32> = grad(wte.weight()).iter().map(|x| x + x).collect();
    close(
        &grad(wte_d.weight()),
        &twice,
        1e-6,
        "accumulated lookup grad",
    );

    // Host ids and targets are checked as on the CPU; a bad target on the device gives NaN.
    let bad = Tensor::from_slice(&[1i64, VOCAB as i64 + 5], [2])?;
    let err =
        Lookup::forward(&wte_d, &cx, Site::ROOT, &bad).expect_err("id outside the vocabulary");
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let logits = Tensor::full([2, 16], 0.5, DType::F32).to_gpu(&g)?;
    let bad = Tensor::from_slice(&[1i64, 16], [2])?;
    let err = vocab_parallel_cross_entropy(&cx, Site::ROOT, &logits, &bad).expect_err("bad target");
    assert!(err.to_string().contains("target 16 of row 1"), "{err}");
    let (losses, _) = vocab_parallel_cross_entropy(&cx, Site::ROOT, &logits, &bad.to_gpu(&g)?)?;
    let losses = host(&losses);
    assert!(
        (losses[0] - 16f32.ln()).abs() < 1e-5 && losses[1].is_nan(),
        "{losses:?}"
    );
    Ok(())
}

/// Runs `f` on both ranks of a tp-2 world sharing one GPU (each rank on its own stream).
fn on_gpu_tp2<T: Send>(g: &Gpu, f: impl Fn(&Cx, &mut Builder, &Gpu) -> R<T> + Sync) -> Vec<T> {
    let layout = ParallelLayout::new(&ParallelConfig::new(2).with_tp(2)).unwrap();
    let shared = LocalGpu::new(g);
    launch(2, |w| -> R<T> {
        let world = shared.world(Arc::new(w))?;
        let ps = ParallelState::new(&world, &layout)?;
        let cx = Cx::new(&ps, 1234);
        let mut b = Builder::for_rank(99, ps.groups());
        f(&cx, &mut b, world.gpu())
    })
    .unwrap()
}

/// This rank's `cols / tp` columns of every row of `v`.
fn columns(v: &[f32], cols: usize, rank: usize, tp: usize) -> Vec<f32> {
    let local = cols / tp;
    v.chunks(cols)
        .flat_map(|row| row[rank * local..][..local].to_vec())
        .collect()
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn the_split_of_a_gathered_output_keeps_its_dtype() -> R {
    // A bf16 output gradient split for a column-parallel product stays bf16 (no widening pass),
    // an f32 one f32; both are this rank's columns exactly.
    let g = gpu();
    let (rows, cols) = (5, 12);
    let whole = det(rows * cols, 31);
    let parts = on_gpu_tp2(&g, |cx, _, gpu| {
        let f32_whole = tensor(whole.clone(), &[rows, cols]).to_gpu(gpu)?;
        let bf16_whole = f32_whole.to_dtype(DType::BF16)?;
        let from_f32 = split_last_dim(cx, &f32_whole)?;
        let from_bf16 = split_last_dim(cx, &bf16_whole)?;
        assert_eq!(from_f32.dtype(), DType::F32);
        assert_eq!(from_bf16.dtype(), DType::BF16);
        assert_eq!(from_bf16.dims(), &[rows, cols / 2]);
        Ok((host(&from_f32), host(&from_bf16)))
    });
    for (rank, (f, b)) in parts.iter().enumerate() {
        let want = columns(&whole, cols, rank, 2);
        assert_eq!(f, &want, "f32 split, rank {rank}");
        let rounded: Vec<f32> = want
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(b, &rounded, "bf16 split, rank {rank}");
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn tensor_parallel_2_on_one_gpu_matches_the_host_at_tp_1() -> R {
    let g = gpu();
    // Attention: each rank holds its heads' columns of the fused QKV and of the output.
    let (s, b, heads, d) = (9, 2, 4, 8);
    let width = heads * 3 * d;
    let qkv = det(s * b * width, 21);
    let dy = det(s * b * heads * d, 22);
    let op = CausalSelfAttention::new(heads, 0.25);
    let ps = ParallelState::solo();
    let (y1, dx1) = attention(
        &op,
        &Cx::new(&ps, 1234),
        &tensor(qkv.clone(), &[s, b, width]),
        &tensor(dy.clone(), &[s, b, heads * d]),
    )?;
    let (y1, dx1) = (host(&y1), host(&dx1));
    let parts = on_gpu_tp2(&g, |cx, _, gpu| {
        let r = cx.tp_rank();
        let x = tensor(columns(&qkv, width, r, 2), &[s, b, width / 2]).to_gpu(gpu)?;
        let dy = tensor(columns(&dy, heads * d, r, 2), &[s, b, heads * d / 2]).to_gpu(gpu)?;
        let (y, dx) = attention(&op, cx, &x, &dy)?;
        Ok((host(&y), host(&dx)))
    });
    for (rank, (y, dx)) in parts.iter().enumerate() {
        close(
            y,
            &columns(&y1, heads * d, rank, 2),
            1e-5,
            &format!("tp 2 attention output rank {rank}"),
        );
        close(
            dx,
            &columns(&dx1, width, rank, 2),
            1e-5,
            &format!("tp 2 attention input grad rank {rank}"),
        );
    }

    // The embedding head: vocabulary split over the ranks, the loss replicated.
    let (espec, pspec) = specs();
    let (ids, targets, dloss) = inputs();
    let reference = {
        let ps = ParallelState::solo();
        let cx = Cx::new(&ps, 1234);
        let mut b = Builder::for_rank(99, ps.groups());
        let wte = Embedding::build_vocab(&espec, &mut b)?;
        let wpe = PositionEmbedding::build(&pspec, &mut b)?;
        head(&cx, &wte, &wpe, &ids, &targets, &dloss, &|t| Ok(t.clone()))?
    };
    let ranks = on_gpu_tp2(&g, |cx, b, gpu| {
        let mut wte = Embedding::build_vocab(&espec, b)?;
        let mut wpe = PositionEmbedding::build(&pspec, b)?;
        assert_eq!(wte.padded_vocab_size(), 16);
        params_to_gpu(&mut wte, gpu)?;
        params_to_gpu(&mut wpe, gpu)?;
        head(cx, &wte, &wpe, &ids, &targets, &dloss, &|t| {
            Ok(t.to_gpu(gpu)?)
        })
    });
    for (rank, out) in ranks.iter().enumerate() {
        close(
            &out.x,
            &reference.x,
            1e-6,
            &format!("tp 2 rank {rank}: lookup"),
        );
        close(
            &out.logits,
            &columns(&reference.logits, 16, rank, 2),
            1e-5,
            &format!("tp 2 rank {rank}: logits"),
        );
        close(
            &out.losses,
            &reference.losses,
            1e-5,
            &format!("tp 2 rank {rank}: losses"),
        );
        close(
            &out.dlogits,
            &columns(&reference.dlogits, 16, rank, 2),
            1e-5,
            &format!("tp 2 rank {rank}: dlogits"),
        );
        close(
            &out.dh,
            &reference.dh,
            1e-5,
            &format!("tp 2 rank {rank}: tied input grad"),
        );
    }
    for (i, (spec, want)) in reference.grads.iter().enumerate() {
        let parts: Vec<(&ParamSpec, &[f32])> = ranks
            .iter()
            .map(|r| (&r.grads[i].0, r.grads[i].1.as_slice()))
            .collect();
        let got = assemble_logical(&parts)?;
        let real = if i == 0 { VOCAB * HIDDEN } else { want.len() };
        close(
            &got[..real],
            &want[..real],
            1e-5,
            &format!("tp 2: {} grad", spec.name),
        );
    }
    Ok(())
}
