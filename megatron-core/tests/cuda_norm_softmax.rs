#![cfg(feature = "cuda")]
//! GPU parity of layer norm and softmax: the CUDA launchers give the CPU kernels' results within
//! f32 tolerance (exact zeros where masked, the same NaNs) and the CPU's argument errors; the
//! fused softmax-and-dropout kernels of attention give the CPU's softmax and dropout composed,
//! with the same dropped elements, in f32 and rounded to bf16. Needs
//! a CUDA device:
//! `cargo test -p megatron-core --features cuda --test cuda_norm_softmax -- --ignored`.

mod support;

use half::bf16;
use megatron_core::cuda::kernels::operand::{In, Out};
use megatron_core::cuda::kernels::{layer_norm as gpu_ln, softmax as gpu_sm};
use megatron_core::cuda::{CudaSlice, Gpu};
use megatron_core::kernels::dropout::{self as cpu_dropout, LogicalIndex};
use megatron_core::kernels::{layer_norm as cpu_ln, softmax as cpu_sm};
use megatron_core::rng::DropoutStream;
use support::{download_at, gpu, upload_at};

/// A deterministic 64-bit LCG (Knuth's MMIX constants), uniform floats from its top 24 bits.
struct Lcg(u64);

impl Lcg {
    fn unit(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }

    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
}

/// Asserts `|got − want| ≤ atol + rtol·|want|` everywhere, NaN where `want` is NaN, exact
/// zeros where `want` is exactly zero if `exact_zeros`; returns the largest absolute error.
fn assert_close(
    what: &str,
    got: &[f32],
    want: &[f32],
    rtol: f32,
    atol: f32,
    exact_zeros: bool,
) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0.0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        if exact_zeros && w == 0.0 {
            assert_eq!(g, 0.0, "{what}[{i}]: want exactly 0");
        }
        let err = (g - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{what}[{i}]: got {g}, want {w} (error {err})"
        );
        worst = worst.max(err);
    }
    worst
}

/// Largest magnitude of `v` (at least 1e-30): the absolute tolerances' scale.
fn magnitude(v: &[f32]) -> f32 {
    v.iter()
        .filter(|x| x.is_finite())
        .fold(1e-30f32, |m, x| m.max(x.abs()))
}

/// (rows, hidden): single rows, widths not a multiple of 4 or 32, GPT sizes, many rows (several
/// chunks of the partial column sums).
const LN_SHAPES: [(usize, usize); 12] = [
    (1, 1),
    (1, 3),
    (4, 1),
    (5, 37),
    (4, 768),
    (3, 1600),
    (2, 4100),
    (1, 8),
    (300, 64),
    (130, 37),
    (3000, 96),
    (70, 1024),
];

struct LnCase {
    x: Vec<f32>,
    gamma: Vec<f32>,
    beta: Vec<f32>,
}

fn ln_case(rng: &mut Lcg, rows: usize, hidden: usize) -> LnCase {
    // Rows with different means and spreads.
    let x = (0..rows * hidden)
        .map(|i| {
            let r = i / hidden;
            rng.uniform(-1.0, 1.0) * (1 + r % 3) as f32 + (r % 5) as f32 * 0.25
        })
        .collect();
    LnCase {
        x,
        gamma: rng.vec(hidden, 0.5, 1.5),
        beta: rng.vec(hidden, -0.5, 0.5),
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn layer_norm_forward_matches_cpu() {
    let gpu = gpu();
    let mut rng = Lcg(1);
    let eps = 1e-5;
    for (rows, hidden) in LN_SHAPES {
        let c = ln_case(&mut rng, rows, hidden);
        let n = rows * hidden;
        let (mut y, mut mean, mut rstd) = (vec![0.0; n], vec![0.0; rows], vec![0.0; rows]);
        cpu_ln::layer_norm_forward(
            &c.x, &c.gamma, &c.beta, rows, hidden, eps, &mut y, &mut mean, &mut rstd,
        )
        .unwrap();
        for offset in [0, 1] {
            let x_d = upload_at(&gpu, &c.x, offset);
            let g_d = upload_at(&gpu, &c.gamma, offset);
            let b_d = upload_at(&gpu, &c.beta, offset);
            let mut y_d = upload_at(&gpu, &vec![f32::NAN; n], offset);
            let mut m_d = upload_at(&gpu, &vec![f32::NAN; rows], offset);
            let mut r_d = upload_at(&gpu, &vec![f32::NAN; rows], offset);
            gpu_ln::layer_norm_forward(
                &gpu,
                &x_d.slice(offset..),
                &g_d.slice(offset..),
                &b_d.slice(offset..),
                rows,
                hidden,
                eps,
                Out::F32(&mut y_d.slice_mut(offset..)),
                &mut m_d.slice_mut(offset..),
                &mut r_d.slice_mut(offset..),
            )
            .unwrap();
            let what = format!("rows {rows} hidden {hidden} offset {offset}");
            let tol = 1e-5;
            assert_close(
                &format!("{what} y"),
                &download_at(&gpu, &y_d, offset),
                &y,
                tol,
                tol * magnitude(&y),
                false,
            );
            assert_close(
                &format!("{what} mean"),
                &download_at(&gpu, &m_d, offset),
                &mean,
                tol,
                tol * magnitude(&mean).max(1.0),
                false,
            );
            assert_close(
                &format!("{what} rstd"),
                &download_at(&gpu, &r_d, offset),
                &rstd,
                tol,
                0.0,
                false,
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn layer_norm_backward_matches_cpu() {
    let gpu = gpu();
    let mut rng = Lcg(2);
    let eps = 1e-5;
    for (rows, hidden) in LN_SHAPES {
        let c = ln_case(&mut rng, rows, hidden);
        let n = rows * hidden;
        let (mut y, mut mean, mut rstd) = (vec![0.0; n], vec![0.0; rows], vec![0.0; rows]);
        cpu_ln::layer_norm_forward(
            &c.x, &c.gamma, &c.beta, rows, hidden, eps, &mut y, &mut mean, &mut rstd,
        )
        .unwrap();
        let dy = rng.vec(n, -1.0, 1.0);
        // Parameter gradients start non-zero: the kernels accumulate.
        let g0 = rng.vec(hidden, -1.0, 1.0);
        let b0 = rng.vec(hidden, -1.0, 1.0);
        let (mut dx, mut dgamma, mut dbeta) = (vec![0.0; n], g0.clone(), b0.clone());
        cpu_ln::layer_norm_backward(
            &dy,
            &c.x,
            &mean,
            &rstd,
            &c.gamma,
            rows,
            hidden,
            &mut dx,
            &mut dgamma,
            &mut dbeta,
        )
        .unwrap();
        // Another gradient of x, which `layer_norm_backward_plus` adds to dx in its pass.
        let plus = rng.vec(n, -2.0, 2.0);
        let dx_plus: Vec<f32> = plus.iter().zip(&dx).map(|(p, d)| p + d).collect();
        for offset in [0, 1] {
            let dy_d = upload_at(&gpu, &dy, offset);
            let x_d = upload_at(&gpu, &c.x, offset);
            let m_d = upload_at(&gpu, &mean, offset);
            let r_d = upload_at(&gpu, &rstd, offset);
            let g_d = upload_at(&gpu, &c.gamma, offset);
            let mut dx_d = upload_at(&gpu, &vec![f32::NAN; n], offset);
            let mut dg_d = upload_at(&gpu, &g0, offset);
            let mut db_d = upload_at(&gpu, &b0, offset);
            gpu_ln::layer_norm_backward(
                &gpu,
                &dy_d.slice(offset..),
                &x_d.slice(offset..),
                &m_d.slice(offset..),
                &r_d.slice(offset..),
                &g_d.slice(offset..),
                rows,
                hidden,
                &mut dx_d.slice_mut(offset..),
                &mut dg_d.slice_mut(offset..),
                &mut db_d.slice_mut(offset..),
            )
            .unwrap();
            let what = format!("rows {rows} hidden {hidden} offset {offset}");
            let tol = 1e-5;
            assert_close(
                &format!("{what} dx"),
                &download_at(&gpu, &dx_d, offset),
                &dx,
                tol,
                tol * magnitude(&dx),
                false,
            );
            // f64 column sums on both sides, rounded once: nearly bit-identical.
            assert_close(
                &format!("{what} dgamma"),
                &download_at(&gpu, &dg_d, offset),
                &dgamma,
                tol,
                tol * magnitude(&dgamma),
                false,
            );
            assert_close(
                &format!("{what} dbeta"),
                &download_at(&gpu, &db_d, offset),
                &dbeta,
                tol,
                tol * magnitude(&dbeta),
                false,
            );
            let plus_d = upload_at(&gpu, &plus, offset);
            let mut dx_d = upload_at(&gpu, &vec![f32::NAN; n], offset);
            let mut dg_d = upload_at(&gpu, &g0, offset);
            let mut db_d = upload_at(&gpu, &b0, offset);
            let (x, m, r, g) = (
                x_d.slice(offset..),
                m_d.slice(offset..),
                r_d.slice(offset..),
                g_d.slice(offset..),
            );
            gpu_ln::layer_norm_backward_plus(
                &gpu,
                &dy_d.slice(offset..),
                (&x, &m, &r, &g),
                rows,
                hidden,
                Some(&plus_d.slice(offset..)),
                &mut dx_d.slice_mut(offset..),
                &mut dg_d.slice_mut(offset..),
                &mut db_d.slice_mut(offset..),
            )
            .unwrap();
            let got = download_at(&gpu, &dx_d, offset);
            let scale = tol * magnitude(&dx_plus);
            assert_close(
                &format!("{what} dx plus"),
                &got,
                &dx_plus,
                tol,
                scale,
                false,
            );
            let got = download_at(&gpu, &dg_d, offset);
            let scale = tol * magnitude(&dgamma);
            assert_close(
                &format!("{what} dgamma, plus"),
                &got,
                &dgamma,
                tol,
                scale,
                false,
            );
        }
    }
}

/// RMSNorm (the layer-norm kernels without mean and bias): forward and backward (with another
/// gradient added to dx) give the CPU kernels' results; the saved mean is 0.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn rms_norm_matches_cpu() {
    let gpu = gpu();
    let mut rng = Lcg(7);
    let eps = 1e-6;
    for (rows, hidden) in LN_SHAPES {
        let c = ln_case(&mut rng, rows, hidden);
        let n = rows * hidden;
        let (mut y, mut mean, mut rstd) = (vec![0.0; n], vec![0.0; rows], vec![0.0; rows]);
        cpu_ln::rms_norm_forward(
            &c.x, &c.gamma, rows, hidden, eps, &mut y, &mut mean, &mut rstd,
        )
        .unwrap();
        let dy = rng.vec(n, -1.0, 1.0);
        let plus = rng.vec(n, -1.0, 1.0);
        let g0 = rng.vec(hidden, -1.0, 1.0);
        let (mut dx, mut dgamma) = (vec![0.0; n], g0.clone());
        let kept = (&c.x[..], &mean[..], &rstd[..], &c.gamma[..]);
        cpu_ln::rms_norm_backward_plus(&dy, kept, rows, hidden, Some(&plus), &mut dx, &mut dgamma)
            .unwrap();
        for offset in [0, 1] {
            let x_d = upload_at(&gpu, &c.x, offset);
            let g_d = upload_at(&gpu, &c.gamma, offset);
            let mut y_d = upload_at(&gpu, &vec![f32::NAN; n], offset);
            let mut m_d = upload_at(&gpu, &vec![f32::NAN; rows], offset);
            let mut r_d = upload_at(&gpu, &vec![f32::NAN; rows], offset);
            gpu_ln::rms_norm_forward(
                &gpu,
                &x_d.slice(offset..),
                &g_d.slice(offset..),
                rows,
                hidden,
                eps,
                Out::F32(&mut y_d.slice_mut(offset..)),
                &mut m_d.slice_mut(offset..),
                &mut r_d.slice_mut(offset..),
            )
            .unwrap();
            let what = format!("RMSNorm rows {rows} hidden {hidden} offset {offset}");
            let tol = 1e-5;
            let got_y = download_at(&gpu, &y_d, offset);
            assert_close(
                &format!("{what} y"),
                &got_y,
                &y,
                tol,
                tol * magnitude(&y),
                false,
            );
            let got_mean = download_at(&gpu, &m_d, offset);
            assert!(
                got_mean.iter().all(|&m| m == 0.0),
                "{what}: mean {got_mean:?}"
            );
            let got_rstd = download_at(&gpu, &r_d, offset);
            assert_close(&format!("{what} rstd"), &got_rstd, &rstd, tol, 0.0, false);

            let dy_d = upload_at(&gpu, &dy, offset);
            let p_d = upload_at(&gpu, &plus, offset);
            let mut dx_d = upload_at(&gpu, &vec![f32::NAN; n], offset);
            let mut dg_d = upload_at(&gpu, &g0, offset);
            gpu_ln::rms_norm_backward_plus(
                &gpu,
                &dy_d.slice(offset..),
                (
                    &x_d.slice(offset..),
                    &m_d.slice(offset..),
                    &r_d.slice(offset..),
                    &g_d.slice(offset..),
                ),
                rows,
                hidden,
                Some(&p_d.slice(offset..)),
                &mut dx_d.slice_mut(offset..),
                &mut dg_d.slice_mut(offset..),
            )
            .unwrap();
            let got_dx = download_at(&gpu, &dx_d, offset);
            assert_close(
                &format!("{what} dx"),
                &got_dx,
                &dx,
                1e-4,
                1e-4 * magnitude(&dx),
                false,
            );
            let got_dg = download_at(&gpu, &dg_d, offset);
            let scale = magnitude(&dgamma);
            assert_close(
                &format!("{what} dgamma"),
                &got_dg,
                &dgamma,
                1e-4,
                1e-4 * scale,
                false,
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn layer_norm_with_no_rows_leaves_parameter_gradients() {
    let gpu = gpu();
    let hidden = 5;
    let g0 = [1.0f32, 2.0, 3.0, 4.0, 5.0];
    let gamma = gpu.upload(&g0).unwrap();
    let empty = gpu.upload::<f32>(&[0.0]).unwrap();
    let mut dg = gpu.upload(&g0).unwrap();
    let mut db = gpu.upload(&g0).unwrap();
    let mut dx = gpu.upload::<f32>(&[0.0]).unwrap();
    let e = empty.slice(0..0);
    gpu_ln::layer_norm_backward(
        &gpu,
        &e,
        &e,
        &e,
        &e,
        &gamma.as_view(),
        0,
        hidden,
        &mut dx.slice_mut(0..0),
        &mut dg.as_view_mut(),
        &mut db.as_view_mut(),
    )
    .unwrap();
    assert_eq!(gpu.download(&dg).unwrap(), g0);
    assert_eq!(gpu.download(&db).unwrap(), g0);
}

/// (batches, sq, sk, causal): square and rectangular, sk < sq (causal rows that see no key),
/// widths not a multiple of 4 or 32, long rows.
const SM_SHAPES: [(usize, usize, usize, bool); 16] = [
    (1, 1, 1, true),
    (1, 1, 1, false),
    (3, 5, 5, true),
    (2, 4, 9, true),
    (2, 6, 3, true),
    (2, 5, 7, false),
    (2, 3, 37, true),
    (2, 3, 37, false),
    (2, 16, 768, true),
    (2, 7, 768, false),
    (1, 4, 1600, true),
    (1, 3, 4100, true),
    (1, 2, 4100, false),
    (2, 64, 64, true),
    (1, 40, 32, true),
    (4, 129, 130, true),
];

/// Scores in [−8, 8] with some −∞ (masked-out keys from an upstream mask) and, in every fifth
/// row, only −∞.
fn scores(rng: &mut Lcg, batches: usize, sq: usize, sk: usize) -> Vec<f32> {
    let mut x = rng.vec(batches * sq * sk, -8.0, 8.0);
    for (r, row) in x.chunks_mut(sk).enumerate() {
        for v in row.iter_mut() {
            if r % 5 == 4 || rng.unit() < 0.1 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    x
}

fn gpu_softmax(
    gpu: &Gpu,
    x: &[f32],
    (batches, sq, sk): (usize, usize, usize),
    scale: f32,
    causal: bool,
    offset: usize,
) -> Vec<f32> {
    let x_d = upload_at(gpu, x, offset);
    let mut y_d = upload_at(gpu, &vec![f32::NAN; x.len()], offset);
    gpu_sm::softmax_forward(
        gpu,
        &x_d.slice(offset..),
        batches,
        sq,
        sk,
        scale,
        causal,
        &mut y_d.slice_mut(offset..),
    )
    .unwrap();
    download_at(gpu, &y_d, offset)
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn softmax_forward_matches_cpu() {
    let gpu = gpu();
    let mut rng = Lcg(3);
    for (batches, sq, sk, causal) in SM_SHAPES {
        let x = scores(&mut rng, batches, sq, sk);
        let scale = 0.37;
        let mut y = vec![f32::NAN; x.len()];
        cpu_sm::softmax_forward(&x, batches, sq, sk, scale, causal, &mut y).unwrap();
        for offset in [0, 1] {
            let got = gpu_softmax(&gpu, &x, (batches, sq, sk), scale, causal, offset);
            let what = format!("{batches}×{sq}×{sk} causal {causal} offset {offset}");
            assert_close(&what, &got, &y, 1e-5, 1e-7, true);
        }
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn softmax_forward_keeps_the_cpus_infinity_and_nan_rules() {
    let gpu = gpu();
    let (ninf, nan) = (f32::NEG_INFINITY, f32::NAN);
    // [rows of 4]: all −∞; −∞ and NaN; a NaN among finite scores; huge and −∞ scores; +∞.
    let x = [
        ninf,
        ninf,
        ninf,
        ninf, //
        ninf,
        nan,
        ninf,
        ninf, //
        1.0,
        nan,
        2.0,
        3.0, //
        1e4,
        1e4 - 1.0,
        -1e4,
        ninf, //
        1.0,
        f32::INFINITY,
        2.0,
        ninf, //
        0.5,
        0.25,
        -0.5,
        4.0,
    ];
    for causal in [false, true] {
        for (sq, scale) in [(6, 1.0), (3, 1.0), (2, -0.5), (6, 0.0), (1, 0.0)] {
            let batches = x.len() / 4 / sq;
            let mut want = [0.0f32; 24];
            cpu_sm::softmax_forward(&x, batches, sq, 4, scale, causal, &mut want).unwrap();
            for offset in [0, 1] {
                let got = gpu_softmax(&gpu, &x, (batches, sq, 4), scale, causal, offset);
                let what = format!("sq {sq} scale {scale} causal {causal} offset {offset}");
                assert_close(&what, &got, &want, 1e-5, 1e-7, true);
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn softmax_backward_matches_cpu() {
    let gpu = gpu();
    let mut rng = Lcg(4);
    for (batches, sq, sk, causal) in SM_SHAPES {
        let x = scores(&mut rng, batches, sq, sk);
        let n = x.len();
        let scale = 0.7;
        let mut y = vec![0.0; n];
        cpu_sm::softmax_forward(&x, batches, sq, sk, scale, causal, &mut y).unwrap();
        let dy = rng.vec(n, -1.0, 1.0);
        let mut dx = vec![f32::NAN; n];
        cpu_sm::softmax_backward(&y, &dy, batches, sq, sk, scale, &mut dx).unwrap();
        for offset in [0, 1] {
            let y_d = upload_at(&gpu, &y, offset);
            let dy_d = upload_at(&gpu, &dy, offset);
            let mut dx_d = upload_at(&gpu, &vec![f32::NAN; n], offset);
            gpu_sm::softmax_backward(
                &gpu,
                &y_d.slice(offset..),
                &dy_d.slice(offset..),
                batches,
                sq,
                sk,
                scale,
                &mut dx_d.slice_mut(offset..),
            )
            .unwrap();
            let what = format!("{batches}×{sq}×{sk} causal {causal} offset {offset}");
            let got = download_at(&gpu, &dx_d, offset);
            assert_close(&what, &got, &dx, 1e-5, 1e-5 * magnitude(&dx), true);
        }
    }
}

/// The dropout of a fused-kernel case: `heads` of `all_heads` heads starting at head `first`
/// (the tensor-parallel layout of attention probabilities `[b, heads, sq, sk]`).
fn head_mask(
    batches: usize,
    sq: usize,
    sk: usize,
    (heads, all_heads, first): Heads,
) -> LogicalIndex {
    LogicalIndex::heads(batches / heads, sq * sk, heads, all_heads, first)
}

/// A device buffer of `n` bf16 NaNs after `offset` leading ones.
fn bf16_buffer(gpu: &Gpu, n: usize, offset: usize) -> CudaSlice<bf16> {
    gpu.upload(&vec![bf16::NAN; offset + n]).unwrap()
}

/// `host` rounded to bf16 on the device after `offset` leading NaNs.
fn upload_bf16(gpu: &Gpu, host: &[f32], offset: usize) -> CudaSlice<bf16> {
    let mut padded = vec![bf16::NAN; offset];
    padded.extend(host.iter().map(|&v| bf16::from_f32(v)));
    gpu.upload(&padded).unwrap()
}

fn download_bf16(gpu: &Gpu, dev: &CudaSlice<bf16>, offset: usize) -> Vec<f32> {
    gpu.download(dev).unwrap()[offset..]
        .iter()
        .map(|v| v.to_f32())
        .collect()
}

/// `v` rounded to bf16 and back (the fused kernels' bf16 outputs round once, to nearest even).
fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Local heads, all heads, the first local head.
type Heads = (usize, usize, usize);

/// (batches, sq, sk, heads): aligned runs (one Philox block per 4 elements) and odd ones,
/// widths not a multiple of 4, a tensor-parallel shard of heads.
const FUSED_SHAPES: [(usize, usize, usize, Heads); 5] = [
    (4, 8, 8, (2, 4, 2)),
    (3, 5, 5, (1, 1, 0)),
    (2, 3, 37, (2, 2, 0)),
    (6, 16, 768, (3, 6, 3)),
    (2, 7, 9, (1, 3, 1)),
];

/// Asserts that exactly the elements `want` drops (zeros where `reference` is not zero) are
/// zero in `got`.
fn assert_same_drops(what: &str, got: &[f32], want: &[f32], reference: &[f32]) {
    for (i, ((g, w), r)) in got.iter().zip(want).zip(reference).enumerate() {
        if *r != 0.0 {
            assert_eq!(
                *g == 0.0,
                *w == 0.0,
                "{what}: element {i} dropped differently"
            );
        }
    }
}

/// The CPU's softmax of `x` and its dropout.
fn cpu_forward(
    x: &[f32],
    (batches, sq, sk): (usize, usize, usize),
    scale: f32,
    dropout: (f32, &DropoutStream, LogicalIndex),
) -> (Vec<f32>, Vec<f32>) {
    let mut probs = vec![0.0; x.len()];
    cpu_sm::softmax_forward(x, batches, sq, sk, scale, true, &mut probs).unwrap();
    let mut dropped = vec![0.0; x.len()];
    let (p, stream, index) = dropout;
    cpu_dropout::dropout_forward(&probs, &mut dropped, p, stream, index).unwrap();
    (probs, dropped)
}

/// [`gpu_sm::softmax_dropout_forward`] over causal `(batches, sq, sk)` scores.
fn fused_forward(
    gpu: &Gpu,
    (batches, sq, sk): (usize, usize, usize),
    scale: f32,
    x: In<'_, '_>,
    (y, dropped): (Out<'_, '_>, Option<Out<'_, '_>>),
    dropout: Option<(f32, &DropoutStream, LogicalIndex)>,
) {
    gpu_sm::softmax_dropout_forward(gpu, x, batches, sq, sk, scale, true, y, dropped, dropout)
        .unwrap();
}

/// [`gpu_sm::dropout_softmax_backward`] over `(batches, sq, sk)` causal probabilities (the
/// keys a query does not see skipped).
fn fused_backward(
    gpu: &Gpu,
    (batches, sq, sk): (usize, usize, usize),
    scale: f32,
    (y, dy): (In<'_, '_>, In<'_, '_>),
    (dx, dropped): (Out<'_, '_>, Option<Out<'_, '_>>),
    dropout: Option<(f32, &DropoutStream, LogicalIndex)>,
) {
    gpu_sm::dropout_softmax_backward(
        gpu, y, dy, batches, sq, sk, scale, true, dx, dropped, dropout,
    )
    .unwrap();
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn softmax_dropout_forward_matches_the_cpus_softmax_then_dropout() {
    let gpu = gpu();
    let mut rng = Lcg(5);
    let stream = DropoutStream::new(1234, &[7, 3]);
    for (batches, sq, sk, heads) in FUSED_SHAPES {
        let x = scores(&mut rng, batches, sq, sk);
        let n = x.len();
        let (scale, p) = (0.41, 0.3);
        let index = head_mask(batches, sq, sk, heads);
        let dims = (batches, sq, sk);
        let (probs, dropped) = cpu_forward(&x, dims, scale, (p, &stream, index));
        // bf16 scores: the CPU's results from the rounded scores, rounded.
        let (probs16, dropped16) = cpu_forward(&round_bf16(&x), dims, scale, (p, &stream, index));
        for offset in [0, 1] {
            let what = format!("{batches}×{sq}×{sk} heads {heads:?} offset {offset}");
            let x_d = upload_at(&gpu, &x, offset);
            // f32 in and out: the CPU's values and exactly its dropped elements.
            let mut y_d = upload_at(&gpu, &vec![f32::NAN; n], offset);
            let mut d_d = upload_at(&gpu, &vec![f32::NAN; n], offset);
            fused_forward(
                &gpu,
                dims,
                scale,
                In::F32(&x_d.slice(offset..)),
                (
                    Out::F32(&mut y_d.slice_mut(offset..)),
                    Some(Out::F32(&mut d_d.slice_mut(offset..))),
                ),
                Some((p, &stream, index)),
            );
            assert_close(
                &what,
                &download_at(&gpu, &y_d, offset),
                &probs,
                1e-5,
                1e-7,
                true,
            );
            let got = download_at(&gpu, &d_d, offset);
            assert_close(&what, &got, &dropped, 1e-5, 1e-7, true);
            assert_same_drops(&what, &got, &dropped, &probs);
            // f32 scores, a bf16 copy of the probabilities without dropout.
            let mut c_d = bf16_buffer(&gpu, n, offset);
            fused_forward(
                &gpu,
                dims,
                scale,
                In::F32(&x_d.slice(offset..)),
                (
                    Out::F32(&mut y_d.slice_mut(offset..)),
                    Some(Out::Bf16(&mut c_d.slice_mut(offset..))),
                ),
                None,
            );
            let got = download_bf16(&gpu, &c_d, offset);
            assert_close(&what, &got, &round_bf16(&probs), 1e-2, 1e-7, true);
            // bf16 in and out.
            let x16 = upload_bf16(&gpu, &x, offset);
            let mut y16 = bf16_buffer(&gpu, n, offset);
            let mut d16 = bf16_buffer(&gpu, n, offset);
            fused_forward(
                &gpu,
                dims,
                scale,
                In::Bf16(&x16.slice(offset..)),
                (
                    Out::Bf16(&mut y16.slice_mut(offset..)),
                    Some(Out::Bf16(&mut d16.slice_mut(offset..))),
                ),
                Some((p, &stream, index)),
            );
            let what = format!("{what} bf16");
            let got = download_bf16(&gpu, &y16, offset);
            assert_close(&what, &got, &round_bf16(&probs16), 1e-2, 1e-7, true);
            let got = download_bf16(&gpu, &d16, offset);
            assert_close(&what, &got, &round_bf16(&dropped16), 1e-2, 1e-7, true);
            assert_same_drops(&what, &got, &dropped16, &probs16);
        }
    }
}

/// The CPU's gradient through dropout and softmax: (dx, the dropped probabilities).
fn cpu_backward(
    y: &[f32],
    dy: &[f32],
    (batches, sq, sk): (usize, usize, usize),
    scale: f32,
    (p, stream, index): (f32, &DropoutStream, LogicalIndex),
) -> (Vec<f32>, Vec<f32>) {
    let n = y.len();
    let (mut dropped, mut d_probs) = (vec![0.0; n], vec![0.0; n]);
    cpu_dropout::dropout_pair(y, &mut dropped, dy, &mut d_probs, p, stream, index).unwrap();
    let mut dx = vec![0.0; n];
    cpu_sm::softmax_backward(y, &d_probs, batches, sq, sk, scale, &mut dx).unwrap();
    (dx, dropped)
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn dropout_softmax_backward_matches_the_cpus_dropout_then_softmax_backward() {
    let gpu = gpu();
    let mut rng = Lcg(6);
    let stream = DropoutStream::new(99, &[1, 2, 3]);
    for (batches, sq, sk, heads) in FUSED_SHAPES {
        let x = scores(&mut rng, batches, sq, sk);
        let n = x.len();
        let (scale, p) = (0.8, 0.25);
        let index = head_mask(batches, sq, sk, heads);
        let dims = (batches, sq, sk);
        let mut y = vec![0.0; n];
        cpu_sm::softmax_forward(&x, batches, sq, sk, scale, true, &mut y).unwrap();
        let d_dropped = rng.vec(n, -1.0, 1.0);
        let (dx, dropped) = cpu_backward(&y, &d_dropped, dims, scale, (p, &stream, index));
        let (y16, dy16) = (round_bf16(&y), round_bf16(&d_dropped));
        let (dx16, dropped16) = cpu_backward(&y16, &dy16, dims, scale, (p, &stream, index));
        let atol = 1e-5 * magnitude(&dx);
        for offset in [0, 1] {
            let what = format!("{batches}×{sq}×{sk} heads {heads:?} offset {offset}");
            let y_d = upload_at(&gpu, &y, offset);
            let dy_d = upload_at(&gpu, &d_dropped, offset);
            let mut dx_d = upload_at(&gpu, &vec![f32::NAN; n], offset);
            let mut dr_d = upload_at(&gpu, &vec![f32::NAN; n], offset);
            fused_backward(
                &gpu,
                dims,
                scale,
                (
                    In::F32(&y_d.slice(offset..)),
                    In::F32(&dy_d.slice(offset..)),
                ),
                (
                    Out::F32(&mut dx_d.slice_mut(offset..)),
                    Some(Out::F32(&mut dr_d.slice_mut(offset..))),
                ),
                Some((p, &stream, index)),
            );
            assert_close(
                &what,
                &download_at(&gpu, &dx_d, offset),
                &dx,
                1e-5,
                atol,
                true,
            );
            let got = download_at(&gpu, &dr_d, offset);
            assert_close(&what, &got, &dropped, 1e-6, 0.0, true);
            // bf16 in and out: the CPU's results from the rounded inputs, rounded once.
            let y_b = upload_bf16(&gpu, &y, offset);
            let dy_b = upload_bf16(&gpu, &d_dropped, offset);
            let mut dx_b = bf16_buffer(&gpu, n, offset);
            let mut dr_b = bf16_buffer(&gpu, n, offset);
            fused_backward(
                &gpu,
                dims,
                scale,
                (
                    In::Bf16(&y_b.slice(offset..)),
                    In::Bf16(&dy_b.slice(offset..)),
                ),
                (
                    Out::Bf16(&mut dx_b.slice_mut(offset..)),
                    Some(Out::Bf16(&mut dr_b.slice_mut(offset..))),
                ),
                Some((p, &stream, index)),
            );
            let what = format!("{what} bf16");
            let got = download_bf16(&gpu, &dx_b, offset);
            assert_close(&what, &got, &round_bf16(&dx16), 1e-2, 2.0 * atol, true);
            let got = download_bf16(&gpu, &dr_b, offset);
            assert_close(&what, &got, &round_bf16(&dropped16), 0.0, 0.0, true);
        }
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn fused_softmax_kernels_check_their_mask_and_outputs() {
    let gpu = gpu();
    let stream = DropoutStream::new(1, &[1]);
    let x = gpu.upload(&[0.0f32; 12]).unwrap();
    let mut y = gpu.zeros::<f32>(12).unwrap();
    let mut short = gpu.zeros::<bf16>(11).unwrap();
    // A dropped output one element short.
    let err = gpu_sm::softmax_dropout_forward(
        &gpu,
        In::F32(&x.slice(..)),
        1,
        3,
        4,
        1.0,
        true,
        Out::F32(&mut y.slice_mut(..)),
        Some(Out::Bf16(&mut short.slice_mut(..))),
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("`dropped` has 11 elements, expected 12"),
        "{err}"
    );
    // A mask over 8 elements for 12, and a drop probability of 1.
    for (p, index, want) in [
        (
            0.1,
            LogicalIndex::contiguous(8),
            "`dropout mask` has 8 elements, expected 12",
        ),
        (
            1.0,
            LogicalIndex::contiguous(12),
            "drop probability must be in [0, 1), got 1",
        ),
    ] {
        let err = gpu_sm::dropout_softmax_backward(
            &gpu,
            In::F32(&x.slice(..)),
            In::F32(&x.slice(..)),
            1,
            3,
            4,
            1.0,
            true,
            Out::F32(&mut y.slice_mut(..)),
            None,
            Some((p, &stream, index)),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(want), "{err}");
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn wrong_lengths_and_arguments_give_the_cpus_errors() {
    let gpu = gpu();
    let buf = |n: usize| gpu.upload(&vec![0.0f32; n]).unwrap();

    // layer_norm_forward: gamma too short; mean too short; negative eps; hidden 0.
    let (x, g3, g4, b) = (buf(8), buf(3), buf(4), buf(4));
    let (mut y, mut m, mut r) = (buf(8), buf(2), buf(2));
    let (hx, hg, hb) = (vec![0.0f32; 8], vec![0.0f32; 4], vec![0.0f32; 4]);
    let (mut hy, mut hm, mut hr) = (vec![0.0f32; 8], vec![0.0f32; 2], vec![0.0f32; 2]);
    for (gamma_len, mean_len, eps, hidden) in [(3, 2, 1e-5, 4), (4, 1, 1e-5, 4), (4, 2, -1.0, 4)] {
        let want = cpu_ln::layer_norm_forward(
            &hx,
            &hg[..gamma_len],
            &hb,
            2,
            hidden,
            eps,
            &mut hy,
            &mut hm[..mean_len],
            &mut hr,
        )
        .unwrap_err()
        .to_string();
        let gamma = if gamma_len == 3 {
            g3.as_view()
        } else {
            g4.as_view()
        };
        let got = gpu_ln::layer_norm_forward(
            &gpu,
            &x.as_view(),
            &gamma,
            &b.as_view(),
            2,
            hidden,
            eps,
            Out::F32(&mut y.as_view_mut()),
            &mut m.slice_mut(..mean_len),
            &mut r.as_view_mut(),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(got, want);
    }
    let want = cpu_ln::layer_norm_forward(&[], &[], &[], 2, 0, 1e-5, &mut [], &mut hm, &mut hr)
        .unwrap_err()
        .to_string();
    let got = gpu_ln::layer_norm_forward(
        &gpu,
        &x.slice(0..0),
        &x.slice(0..0),
        &x.slice(0..0),
        2,
        0,
        1e-5,
        Out::F32(&mut y.slice_mut(0..0)),
        &mut m.as_view_mut(),
        &mut r.as_view_mut(),
    )
    .unwrap_err()
    .to_string();
    assert_eq!(got, want);

    // layer_norm_backward: dbeta too short.
    let (mut dx, mut dg, mut db) = (buf(8), buf(4), buf(3));
    let (mut hdx, mut hdg, mut hdb) = (vec![0.0f32; 8], vec![0.0f32; 4], vec![0.0f32; 3]);
    let want =
        cpu_ln::layer_norm_backward(&hy, &hx, &hm, &hr, &hg, 2, 4, &mut hdx, &mut hdg, &mut hdb)
            .unwrap_err()
            .to_string();
    let got = gpu_ln::layer_norm_backward(
        &gpu,
        &y.as_view(),
        &x.as_view(),
        &m.as_view(),
        &r.as_view(),
        &g4.as_view(),
        2,
        4,
        &mut dx.as_view_mut(),
        &mut dg.as_view_mut(),
        &mut db.as_view_mut(),
    )
    .unwrap_err()
    .to_string();
    assert!(got.contains("`dbeta` has 3 elements, expected 4"), "{got}");
    assert_eq!(got, want);
    // layer_norm_backward_plus: plus too short.
    let (mut db4, mut hdb4, p7) = (buf(4), vec![0.0f32; 4], buf(7));
    let saved = (&hx[..], &hm[..], &hr[..], &hg[..]);
    let want = cpu_ln::layer_norm_backward_plus(
        &hy,
        saved,
        2,
        4,
        Some(&[0.0; 7]),
        &mut hdx,
        &mut hdg,
        &mut hdb4,
    )
    .unwrap_err()
    .to_string();
    let (xv, mv, rv, gv) = (x.as_view(), m.as_view(), r.as_view(), g4.as_view());
    let got = gpu_ln::layer_norm_backward_plus(
        &gpu,
        &y.as_view(),
        (&xv, &mv, &rv, &gv),
        2,
        4,
        Some(&p7.as_view()),
        &mut dx.as_view_mut(),
        &mut dg.as_view_mut(),
        &mut db4.as_view_mut(),
    )
    .unwrap_err()
    .to_string();
    assert!(got.contains("`plus` has 7 elements, expected 8"), "{got}");
    assert_eq!(got, want);

    // softmax_forward: x too short; NaN scale. softmax_backward: dx too short.
    let (x11, x12) = (buf(11), buf(12));
    let mut y12 = buf(12);
    let mut hy12 = [0.0f32; 12];
    let want = cpu_sm::softmax_forward(&[0.0; 11], 1, 3, 4, 1.0, true, &mut hy12)
        .unwrap_err()
        .to_string();
    let got = gpu_sm::softmax_forward(
        &gpu,
        &x11.as_view(),
        1,
        3,
        4,
        1.0,
        true,
        &mut y12.as_view_mut(),
    )
    .unwrap_err()
    .to_string();
    assert_eq!(got, want);
    let want = cpu_sm::softmax_forward(&[0.0; 12], 1, 3, 4, f32::NAN, true, &mut hy12)
        .unwrap_err()
        .to_string();
    let got = gpu_sm::softmax_forward(
        &gpu,
        &x12.as_view(),
        1,
        3,
        4,
        f32::NAN,
        true,
        &mut y12.as_view_mut(),
    )
    .unwrap_err()
    .to_string();
    assert_eq!(got, want);
    let want = cpu_sm::softmax_backward(&[0.0; 12], &[0.0; 12], 1, 3, 4, 1.0, &mut hy12[..10])
        .unwrap_err()
        .to_string();
    let got = gpu_sm::softmax_backward(
        &gpu,
        &x12.as_view(),
        &x12.as_view(),
        1,
        3,
        4,
        1.0,
        &mut y12.slice_mut(..10),
    )
    .unwrap_err()
    .to_string();
    assert_eq!(got, want);
}
