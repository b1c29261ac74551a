#![cfg(feature = "cuda")]
//! GPU parity of the embedding, cross-entropy and Adam kernels with the CPU kernels: the same
//! pseudo-random inputs through both, results compared (embedding and Adam bit for bit,
//! cross-entropy to f32 rounding), edge shapes and the CPU's errors included. Needs a GPU.

mod support;

use half::bf16;
use megatron_core::cuda::kernels::{adam as gadam, cross_entropy as gce, embedding as gemb};
use megatron_core::cuda::{CudaError, CudaView, CudaViewMut};
use megatron_core::kernels::KernelError;
use megatron_core::kernels::adam::{AdamConfig, adam_step};
use megatron_core::kernels::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
use megatron_core::kernels::embedding::{embedding_backward, embedding_forward};
use support::{download_at, gpu, upload_at};

/// SplitMix64: deterministic inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn f32(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }

    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32(lo, hi)).collect()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `|got − want| ≤ tol·(scale + |want|)` everywhere (NaN only where the CPU has NaN).
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64, scale: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        let err = (g as f64 - w as f64).abs();
        let bound = tol * (scale(i) + (w as f64).abs());
        assert!(
            err <= bound,
            "{what}[{i}]: got {g}, want {w} (error {err:e} > {bound:e})"
        );
    }
}

/// Ids for `n` tokens over a vocabulary of `vocab`, some outside it and some repeated a lot.
fn ids(rng: &mut Rng, n: usize, vocab: usize) -> Vec<i64> {
    let hot = rng.below(vocab as u64) as i64;
    (0..n)
        .map(|t| match t % 11 {
            3 => -1 - rng.below(5) as i64,
            5 => vocab as i64 + rng.below(3) as i64,
            7 | 8 => hot,
            9 if t % 2 == 0 => i64::MIN,
            10 if t % 3 == 0 => i64::MAX,
            _ => rng.below(vocab as u64) as i64,
        })
        .collect()
}

/// (tokens, full vocabulary, shard start, shard rows, hidden, misalignment pad).
const EMBEDDING_CASES: [(usize, usize, usize, usize, usize, usize); 10] = [
    (17, 10, 0, 10, 6, 0),
    (17, 10, 4, 6, 6, 0),
    (1, 7, 0, 7, 1, 0),
    (300, 7, 2, 3, 1, 0),
    (64, 128, 0, 128, 64, 0),
    (64, 128, 32, 32, 64, 1),
    (700, 200, 50, 100, 1024, 0),
    (513, 90, 0, 90, 2052, 0),
    (40, 50304, 12576, 12576, 12, 0),
    (2000, 1000, 0, 1000, 33, 1),
];

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn embedding_forward_matches_the_cpu_bit_for_bit() {
    let gpu = gpu();
    let mut rng = Rng(11);
    for (n, vocab, start, v_local, hidden, pad) in EMBEDDING_CASES {
        let table = rng.vec(v_local * hidden, -1.0, 1.0);
        let ids = ids(&mut rng, n, vocab);
        let mut want = vec![f32::NAN; n * hidden];
        embedding_forward(&ids, &table, start, v_local, hidden, &mut want).unwrap();
        let d_ids = gpu.upload(&ids).unwrap();
        let d_table = upload_at(&gpu, &table, pad);
        let mut d_out = upload_at(&gpu, &vec![f32::NAN; n * hidden], pad);
        gemb::embedding_forward(
            &gpu,
            &d_ids.as_view(),
            &d_table.slice(pad..),
            start,
            v_local,
            hidden,
            &mut d_out.slice_mut(pad..),
        )
        .unwrap();
        let got = download_at(&gpu, &d_out, pad);
        assert!(
            bits(&got) == bits(&want),
            "tokens {n}, shard {start}+{v_local}, hidden {hidden}, pad {pad}"
        );
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn embedding_backward_matches_the_cpu_bit_for_bit_with_repeated_ids() {
    let gpu = gpu();
    let mut rng = Rng(12);
    for (n, vocab, start, v_local, hidden, pad) in EMBEDDING_CASES {
        let ids = ids(&mut rng, n, vocab);
        let dout = rng.vec(n * hidden, -1.0, 1.0);
        let init = rng.vec(v_local * hidden, -1.0, 1.0);
        let mut want = init.clone();
        embedding_backward(&ids, &dout, start, v_local, hidden, &mut want).unwrap();
        let d_ids = gpu.upload(&ids).unwrap();
        let d_dout = upload_at(&gpu, &dout, pad);
        let mut d_table = upload_at(&gpu, &init, pad);
        gemb::embedding_backward(
            &gpu,
            &d_ids.as_view(),
            &d_dout.slice(pad..),
            start,
            v_local,
            hidden,
            &mut d_table.slice_mut(pad..),
        )
        .unwrap();
        let got = download_at(&gpu, &d_table, pad);
        assert!(
            bits(&got) == bits(&want),
            "tokens {n}, shard {start}+{v_local}, hidden {hidden}, pad {pad}"
        );
    }
    // Every token on one row: a long chain of adds, still in token order.
    let (n, hidden) = (3000, 8);
    let ids = vec![2i64; n];
    let dout = rng.vec(n * hidden, -1.0, 1.0);
    let mut want = vec![0.0f32; 4 * hidden];
    embedding_backward(&ids, &dout, 0, 4, hidden, &mut want).unwrap();
    let (d_ids, d_dout) = (gpu.upload(&ids).unwrap(), gpu.upload(&dout).unwrap());
    let mut d_table = gpu.zeros::<f32>(4 * hidden).unwrap();
    gemb::embedding_backward(
        &gpu,
        &d_ids.as_view(),
        &d_dout.as_view(),
        0,
        4,
        hidden,
        &mut d_table.as_view_mut(),
    )
    .unwrap();
    assert!(bits(&gpu.download(&d_table).unwrap()) == bits(&want));
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn embedding_checks_lengths_as_the_cpu() {
    let gpu = gpu();
    let d_ids = gpu.upload(&[0i64, 1]).unwrap();
    let five = gpu.zeros::<f32>(5).unwrap();
    let mut six = gpu.zeros::<f32>(6).unwrap();
    let e = gemb::embedding_forward(
        &gpu,
        &d_ids.as_view(),
        &five.as_view(),
        0,
        2,
        3,
        &mut six.as_view_mut(),
    )
    .unwrap_err();
    let cpu = embedding_forward(&[0, 1], &[0.0; 5], 0, 2, 3, &mut [0.0; 6]).unwrap_err();
    assert_eq!(e.to_string(), cpu.to_string());
    assert!(matches!(
        e,
        CudaError::Kernel(KernelError::Length {
            buffer: "table",
            expected: 6,
            actual: 5,
            ..
        })
    ));
    let e = gemb::embedding_backward(
        &gpu,
        &d_ids.as_view(),
        &six.slice(..5),
        0,
        2,
        3,
        &mut six.clone().as_view_mut(),
    )
    .unwrap_err();
    assert!(matches!(
        e,
        CudaError::Kernel(KernelError::Length { buffer: "dout", .. })
    ));
    let e = gemb::embedding_backward(
        &gpu,
        &d_ids.as_view(),
        &six.clone().as_view(),
        0,
        2,
        3,
        &mut six.slice_mut(..4),
    )
    .unwrap_err();
    assert!(matches!(
        e,
        CudaError::Kernel(KernelError::Length {
            buffer: "dtable",
            ..
        })
    ));
    // Ids outside the shard are no error: zero rows, as on the CPU.
    let far = gpu.upload(&[-1i64, i64::MAX]).unwrap();
    let table = gpu.upload(&[1.0f32; 6]).unwrap();
    let mut out = gpu.upload(&[f32::NAN; 6]).unwrap();
    gemb::embedding_forward(
        &gpu,
        &far.as_view(),
        &table.as_view(),
        0,
        2,
        3,
        &mut out.as_view_mut(),
    )
    .unwrap();
    assert_eq!(gpu.download(&out).unwrap(), vec![0.0; 6]);
}

/// Logits for `rows × vocab` with the CPU tests' hard rows: large offsets and masked entries.
fn logits(rng: &mut Rng, rows: usize, vocab: usize) -> Vec<f32> {
    let mut x = rng.vec(rows * vocab, -5.0, 5.0);
    for (r, row) in x.chunks_exact_mut(vocab).enumerate() {
        match r % 4 {
            1 => row.iter_mut().for_each(|v| *v += 1e4),
            2 => row.iter_mut().for_each(|v| *v -= 1e4),
            // Masked (padded) vocabulary entries, as a vocab-parallel shard may hold.
            3 if vocab > 1 => row
                .iter_mut()
                .step_by(3)
                .for_each(|v| *v = f32::NEG_INFINITY),
            _ => {}
        }
    }
    x
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn cross_entropy_matches_the_cpu() {
    let gpu = gpu();
    let mut rng = Rng(21);
    // (rows, vocab, misalignment pad)
    for (rows, vocab, pad) in [
        (7, 53, 0),
        (1, 8, 0),
        (1, 1, 0),
        (5, 1, 0),
        (9, 4, 0),
        (4, 1000, 0),
        (4, 1000, 1),
        (6, 50304, 0),
        (3, 50304, 1),
        (2, 50257, 0),
        (300, 256, 0),
    ] {
        let x = logits(&mut rng, rows, vocab);
        let targets: Vec<i64> = (0..rows)
            .map(|r| {
                let t = rng.below(vocab as u64) as i64;
                // Keep masked rows' targets on finite logits.
                if r % 4 == 3 && t % 3 == 0 && vocab > 1 {
                    t + 1 - (t + 1 == vocab as i64) as i64 * 2
                } else {
                    t
                }
            })
            .collect();
        let dloss = rng.vec(rows, 0.1, 2.0);
        let (mut loss, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        cross_entropy_forward(&x, &targets, rows, vocab, &mut loss, &mut lse).unwrap();
        let mut dx = vec![0.0; rows * vocab];
        cross_entropy_backward(&x, &targets, &lse, &dloss, rows, vocab, &mut dx).unwrap();

        let d_x = upload_at(&gpu, &x, pad);
        let d_t = gpu.upload(&targets).unwrap();
        let (mut d_loss, mut d_lse) = (gpu.zeros::<f32>(rows).unwrap(), gpu.zeros(rows).unwrap());
        gce::cross_entropy_forward(
            &gpu,
            &d_x.slice(pad..),
            &d_t.as_view(),
            rows,
            vocab,
            &mut d_loss.as_view_mut(),
            &mut d_lse.as_view_mut(),
        )
        .unwrap();
        let what = format!("rows {rows} × vocab {vocab}, pad {pad}");
        let got_loss = gpu.download(&d_loss).unwrap();
        let got_lse = gpu.download(&d_lse).unwrap();
        assert_close(&format!("loss, {what}"), &got_loss, &loss, 1e-5, |_| 1.0);
        // The log-sum-exp of the shifted rows is ±1e4: relative to that.
        assert_close(&format!("lse, {what}"), &got_lse, &lse, 1e-6, |_| 1.0);

        // The backward from the CPU's log-sum-exp, so only the backward is compared.
        let d_lse_cpu = gpu.upload(&lse).unwrap();
        let d_g = gpu.upload(&dloss).unwrap();
        let mut d_dx = upload_at(&gpu, &vec![f32::NAN; rows * vocab], pad);
        gce::cross_entropy_backward(
            &gpu,
            &d_x.slice(pad..),
            &d_t.as_view(),
            &d_lse_cpu.as_view(),
            &d_g.as_view(),
            rows,
            vocab,
            &mut d_dx.slice_mut(pad..),
        )
        .unwrap();
        let got = download_at(&gpu, &d_dx, pad);
        assert_close(&format!("dlogits, {what}"), &got, &dx, 1e-5, |i| {
            dloss[i / vocab] as f64 * 0.1
        });
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn cross_entropy_rows_of_only_minus_infinity_are_nan_as_on_the_cpu() {
    let gpu = gpu();
    let x = [f32::NEG_INFINITY; 8];
    let (mut loss, mut lse) = ([0.0f32], [0.0f32]);
    cross_entropy_forward(&x, &[1], 1, 8, &mut loss, &mut lse).unwrap();
    let (d_x, d_t) = (gpu.upload(&x).unwrap(), gpu.upload(&[1i64]).unwrap());
    let (mut d_loss, mut d_lse) = (gpu.zeros::<f32>(1).unwrap(), gpu.zeros::<f32>(1).unwrap());
    gce::cross_entropy_forward(
        &gpu,
        &d_x.as_view(),
        &d_t.as_view(),
        1,
        8,
        &mut d_loss.as_view_mut(),
        &mut d_lse.as_view_mut(),
    )
    .unwrap();
    assert!(loss[0].is_nan() && lse[0].is_nan());
    assert!(gpu.download(&d_loss).unwrap()[0].is_nan());
    assert!(gpu.download(&d_lse).unwrap()[0].is_nan());
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn cross_entropy_targets_outside_the_vocabulary_are_the_cpus_error() {
    let gpu = gpu();
    let (rows, vocab) = (3, 4);
    let x = [0.5f32; 12];
    let d_x = gpu.upload(&x).unwrap();
    for bad in [4i64, -1, i64::MIN, i64::MAX] {
        let targets = [0, bad, 5];
        let cpu = cross_entropy_forward(&x, &targets, rows, vocab, &mut [0.0; 3], &mut [0.0; 3])
            .unwrap_err();
        let d_t = gpu.upload(&targets).unwrap();
        let (mut d_loss, mut d_lse) = (gpu.upload(&[7.0f32; 3]).unwrap(), gpu.zeros(3).unwrap());
        let e = gce::cross_entropy_forward(
            &gpu,
            &d_x.as_view(),
            &d_t.as_view(),
            rows,
            vocab,
            &mut d_loss.as_view_mut(),
            &mut d_lse.as_view_mut(),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), cpu.to_string());
        let msg = e.to_string();
        assert!(
            msg.contains("cross_entropy_forward")
                && msg.contains("row 1")
                && msg.contains(&format!("target {bad}")),
            "{msg}"
        );
        // The outputs are untouched, as on the CPU.
        assert_eq!(gpu.download(&d_loss).unwrap(), vec![7.0; 3]);

        let cpu = cross_entropy_backward(&x, &targets, &[0.0; 3], &[1.0; 3], 3, 4, &mut [0.0; 12])
            .unwrap_err();
        let (d_s, d_g) = (gpu.zeros::<f32>(3).unwrap(), gpu.zeros::<f32>(3).unwrap());
        let mut d_dx = gpu.upload(&[7.0f32; 12]).unwrap();
        let e = gce::cross_entropy_backward(
            &gpu,
            &d_x.as_view(),
            &d_t.as_view(),
            &d_s.as_view(),
            &d_g.as_view(),
            rows,
            vocab,
            &mut d_dx.as_view_mut(),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), cpu.to_string());
        assert_eq!(gpu.download(&d_dx).unwrap(), vec![7.0; 12]);
    }
    // A vocabulary of 0 makes every target bad, row 0 first.
    let d_t = gpu.upload(&[0i64]).unwrap();
    let e = gce::cross_entropy_forward(
        &gpu,
        &d_x.slice(..0),
        &d_t.as_view(),
        1,
        0,
        &mut gpu.zeros::<f32>(1).unwrap().as_view_mut(),
        &mut gpu.zeros::<f32>(1).unwrap().as_view_mut(),
    )
    .unwrap_err();
    let cpu = cross_entropy_forward(&[], &[0], 1, 0, &mut [0.0], &mut [0.0]).unwrap_err();
    assert_eq!(e.to_string(), cpu.to_string());
    // Lengths are checked before anything runs.
    let e = gce::cross_entropy_forward(
        &gpu,
        &d_x.as_view(),
        &d_t.as_view(),
        3,
        4,
        &mut gpu.zeros::<f32>(3).unwrap().as_view_mut(),
        &mut gpu.zeros::<f32>(3).unwrap().as_view_mut(),
    )
    .unwrap_err();
    assert!(matches!(
        e,
        CudaError::Kernel(KernelError::Length {
            buffer: "targets",
            ..
        })
    ));
}

fn adam_config(decoupled: bool, step: u64) -> AdamConfig {
    AdamConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step,
        decoupled,
        grad_scale: 1.0,
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn adam_matches_the_cpu_bit_for_bit_over_several_steps() {
    let gpu = gpu();
    let mut rng = Rng(31);
    for (n, pad) in [(1, 0), (3, 0), (101, 0), (1001, 1), (4096, 0), (1 << 20, 0)] {
        for decoupled in [true, false] {
            let mut p = rng.vec(n, -1.0, 1.0);
            let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
            let mut d_p = upload_at(&gpu, &p, pad);
            let mut d_m = upload_at(&gpu, &m, pad);
            let mut d_v = upload_at(&gpu, &v, pad);
            let mut d_copy = gpu.zeros::<bf16>(n + pad).unwrap();
            for step in 1..=5 {
                let g = rng.vec(n, -1.0, 1.0);
                // Every other step clipped (a gradient scale), and then the bf16 copies written.
                let clipped = step % 2 == 0;
                let c = AdamConfig {
                    lr: 1e-2 / step as f64,
                    grad_scale: if clipped { 0.37 } else { 1.0 },
                    ..adam_config(decoupled, step)
                };
                adam_step(&mut p, &g, &mut m, &mut v, &c).unwrap();
                let d_g = upload_at(&gpu, &g, pad);
                let mut copy = d_copy.slice_mut(pad..);
                gadam::adam_step(
                    &gpu,
                    &mut d_p.slice_mut(pad..),
                    &d_g.slice(pad..),
                    &mut d_m.slice_mut(pad..),
                    &mut d_v.slice_mut(pad..),
                    clipped.then_some(&mut copy),
                    &c,
                )
                .unwrap();
                let what = format!("n {n}, pad {pad}, decoupled {decoupled}, step {step}");
                if clipped {
                    let copies: Vec<u16> = gpu.download(&d_copy).unwrap()[pad..]
                        .iter()
                        .map(|x| x.to_bits())
                        .collect();
                    let want: Vec<u16> = p.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
                    assert!(copies == want, "bf16 copies, {what}");
                }
                assert!(
                    bits(&download_at(&gpu, &d_p, pad)) == bits(&p),
                    "param, {what}"
                );
                assert!(
                    bits(&download_at(&gpu, &d_m, pad)) == bits(&m),
                    "exp_avg, {what}"
                );
                assert!(
                    bits(&download_at(&gpu, &d_v, pad)) == bits(&v),
                    "exp_avg_sq, {what}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn adam_checks_as_the_cpu() {
    let gpu = gpu();
    let mut p = gpu.zeros::<f32>(3).unwrap();
    let mut m = gpu.zeros::<f32>(3).unwrap();
    let mut v = gpu.zeros::<f32>(3).unwrap();
    let g2 = gpu.zeros::<f32>(2).unwrap();
    let g3 = gpu.zeros::<f32>(3).unwrap();
    let mut short = gpu.zeros::<bf16>(2).unwrap();
    // One step whose gradient, first moment or copy has the wrong length: the error's buffer
    // and lengths.
    let mut step =
        |grad: &CudaView<f32>, m: &mut CudaViewMut<f32>, copy: Option<&mut CudaViewMut<bf16>>| {
            let e = gadam::adam_step(
                &gpu,
                &mut p.as_view_mut(),
                grad,
                m,
                &mut v.as_view_mut(),
                copy,
                &adam_config(true, 1),
            )
            .unwrap_err();
            match e {
                CudaError::Kernel(KernelError::Length {
                    buffer,
                    expected,
                    actual,
                    ..
                }) => (buffer, expected, actual),
                other => panic!("{other}"),
            }
        };
    assert_eq!(
        step(&g2.as_view(), &mut m.as_view_mut(), None),
        ("grad", 3, 2)
    );
    assert_eq!(
        step(&g3.as_view(), &mut m.slice_mut(..2), None),
        ("exp_avg", 3, 2)
    );
    assert_eq!(
        step(
            &g3.as_view(),
            &mut m.as_view_mut(),
            Some(&mut short.as_view_mut())
        ),
        ("copy", 3, 2)
    );
    for bad in [
        adam_config(true, 0),
        AdamConfig {
            beta1: 1.0,
            ..adam_config(true, 1)
        },
        AdamConfig {
            lr: f64::NAN,
            ..adam_config(true, 1)
        },
        AdamConfig {
            weight_decay: f64::INFINITY,
            ..adam_config(false, 1)
        },
    ] {
        let cpu =
            adam_step(&mut [0.0; 3], &[0.0; 3], &mut [0.0; 3], &mut [0.0; 3], &bad).unwrap_err();
        let e = gadam::adam_step(
            &gpu,
            &mut p.as_view_mut(),
            &g3.as_view(),
            &mut m.as_view_mut(),
            &mut v.as_view_mut(),
            None,
            &bad,
        )
        .unwrap_err();
        assert_eq!(e.to_string(), cpu.to_string(), "{bad:?}");
    }
}
