//! Softmax cross-entropy over the last dimension of `logits[rows, vocab]` with integer targets.
//!
//! The forward shifts each row by its maximum and sums the exponentials ([`math::exp`]) in f64
//! partial sums; it saves the per-row log-sum-exp so the backward recomputes the softmax without
//! storing it.

use super::isa::{Isa, versioned};
use super::math;
use super::reduce::{self, LANES};
use super::shape::numel;
use super::{KernelError, check_len};

/// Checks the lengths shared by both directions and every target; returns `rows × vocab`.
fn check_inputs(
    kernel: &'static str,
    logits: &[f32],
    targets: &[i64],
    rows: usize,
    vocab: usize,
) -> Result<usize, KernelError> {
    let n = numel(kernel, &[rows, vocab])?;
    let dims = || format!("rows {rows} × vocab {vocab}");
    check_len(kernel, "logits", logits.len(), n, dims)?;
    check_len(kernel, "targets", targets.len(), rows, dims)?;
    if let Some((r, &t)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| usize::try_from(t).map_or(true, |t| t >= vocab))
    {
        return Err(KernelError::Invalid {
            kernel,
            message: format!("row {r}: target {t} is outside the vocabulary [0, {vocab})"),
        });
    }
    Ok(n)
}

/// `Σ exp(v − m)` over `row`, in f64, with [`LANES`] partial sums combined in a fixed order.
#[inline(always)]
fn sum_exp(row: &[f32], m: f32) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(math::exp(v - m));
        }
    }
    for &v in tail {
        acc[0] += f64::from(math::exp(v - m));
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

versioned! {
    /// The rows of [`cross_entropy_forward`] (`vocab > 0`, targets checked).
    fn forward_rows(
        logits: &[f32],
        targets: &[i64],
        vocab: usize,
        losses: &mut [f32],
        logsumexp: &mut [f32],
    ) {
        let outs = losses.iter_mut().zip(logsumexp.iter_mut());
        for ((row, &t), (loss, lse_out)) in logits.chunks_exact(vocab).zip(targets).zip(outs) {
            let m = reduce::max(row);
            let lse = f64::from(m) + sum_exp(row, m).ln();
            *lse_out = lse as f32;
            *loss = (lse - f64::from(row[t as usize])) as f32;
        }
    }
}

versioned! {
    /// The rows of [`cross_entropy_backward`] (`vocab > 0`, targets checked).
    fn backward_rows(
        logits: &[f32],
        targets: &[i64],
        logsumexp: &[f32],
        dloss: &[f32],
        vocab: usize,
        dlogits: &mut [f32],
    ) {
        let per_row = targets.iter().zip(logsumexp).zip(dloss);
        for ((row, drow), ((&t, &lse), &g)) in logits
            .chunks_exact(vocab)
            .zip(dlogits.chunks_exact_mut(vocab))
            .zip(per_row)
        {
            for (o, &v) in drow.iter_mut().zip(row) {
                *o = math::exp(v - lse) * g;
            }
            drow[t as usize] -= g;
        }
    }
}

/// Per-row loss `logsumexp(logits[r]) − logits[r, targets[r]]`, saving `logsumexp[rows]`.
pub fn cross_entropy_forward(
    logits: &[f32],
    targets: &[i64],
    rows: usize,
    vocab: usize,
    losses: &mut [f32],
    logsumexp: &mut [f32],
) -> Result<(), KernelError> {
    const K: &str = "cross_entropy_forward";
    check_inputs(K, logits, targets, rows, vocab)?;
    let dims = || format!("rows {rows} × vocab {vocab}");
    check_len(K, "losses", losses.len(), rows, dims)?;
    check_len(K, "logsumexp", logsumexp.len(), rows, dims)?;
    if vocab == 0 {
        return Ok(()); // then rows == 0: every target would be out of range.
    }
    forward_rows(Isa::detected(), logits, targets, vocab, losses, logsumexp);
    Ok(())
}

/// Gradient of [`cross_entropy_forward`]: `dlogits[r] = (softmax(logits[r]) − onehot(targets[r]))·dloss[r]` (overwrites).
pub fn cross_entropy_backward(
    logits: &[f32],
    targets: &[i64],
    logsumexp: &[f32],
    dloss: &[f32],
    rows: usize,
    vocab: usize,
    dlogits: &mut [f32],
) -> Result<(), KernelError> {
    const K: &str = "cross_entropy_backward";
    let n = check_inputs(K, logits, targets, rows, vocab)?;
    let dims = || format!("rows {rows} × vocab {vocab}");
    check_len(K, "logsumexp", logsumexp.len(), rows, dims)?;
    check_len(K, "dloss", dloss.len(), rows, dims)?;
    check_len(K, "dlogits", dlogits.len(), n, dims)?;
    if vocab == 0 {
        return Ok(());
    }
    backward_rows(
        Isa::detected(),
        logits,
        targets,
        logsumexp,
        dloss,
        vocab,
        dlogits,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{Rng, check_directional};
    use super::*;

    fn loss_ref(row: &[f32], t: usize) -> f64 {
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
        let s: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        m + s.ln() - row[t] as f64
    }

    #[test]
    fn forward_matches_reference() {
        let mut rng = Rng::new(70);
        let (rows, vocab) = (7, 53);
        let mut logits = rng.vec(rows * vocab, -5.0, 5.0);
        // Large offsets must not overflow.
        for v in &mut logits[vocab..2 * vocab] {
            *v += 1e4;
        }
        for v in &mut logits[2 * vocab..3 * vocab] {
            *v -= 1e4;
        }
        let targets: Vec<i64> = (0..rows).map(|_| rng.below(vocab as u64) as i64).collect();
        let (mut losses, mut lse) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
        cross_entropy_forward(&logits, &targets, rows, vocab, &mut losses, &mut lse).unwrap();
        for r in 0..rows {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let want = loss_ref(row, targets[r] as usize);
            assert!(
                (losses[r] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()),
                "row {r}"
            );
            let want_lse = want + row[targets[r] as usize] as f64;
            assert!((lse[r] as f64 - want_lse).abs() <= 1e-6 * (1.0 + want_lse.abs()));
        }
        // Uniform logits: loss ln(vocab).
        let mut l = [0.0];
        cross_entropy_forward(&[2.5; 8], &[3], 1, 8, &mut l, &mut [0.0]).unwrap();
        assert!((l[0] as f64 - 8f64.ln()).abs() < 1e-6);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng::new(71);
        let (rows, vocab) = (5, 31);
        let logits = rng.vec(rows * vocab, -3.0, 3.0);
        let targets: Vec<i64> = (0..rows).map(|_| rng.below(vocab as u64) as i64).collect();
        let dloss = rng.vec(rows, 0.1, 2.0);
        let (mut losses, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        cross_entropy_forward(&logits, &targets, rows, vocab, &mut losses, &mut lse).unwrap();
        let mut dlogits = vec![f32::NAN; rows * vocab];
        cross_entropy_backward(&logits, &targets, &lse, &dloss, rows, vocab, &mut dlogits).unwrap();
        // Each row's gradient sums to zero.
        for r in 0..rows {
            let s: f32 = dlogits[r * vocab..(r + 1) * vocab].iter().sum();
            assert!(s.abs() < 1e-5);
        }
        let d = rng.vec(rows * vocab, -1.0, 1.0);
        check_directional(
            "cross entropy dlogits",
            &logits,
            &d,
            1e-2,
            &dlogits,
            2e-3,
            |x| {
                let (mut l, mut s) = (vec![0.0; rows], vec![0.0; rows]);
                cross_entropy_forward(x, &targets, rows, vocab, &mut l, &mut s).unwrap();
                l.iter()
                    .zip(&dloss)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum()
            },
        );
    }

    #[test]
    fn every_compiled_version_gives_the_same_bits() {
        let mut rng = Rng::new(72);
        let (rows, vocab) = (6, 259);
        let logits = rng.vec(rows * vocab, -9.0, 9.0);
        let targets: Vec<i64> = (0..rows).map(|_| rng.below(vocab as u64) as i64).collect();
        let dloss = rng.vec(rows, 0.1, 2.0);
        let run = |isa: Isa| {
            let (mut l, mut s) = (vec![0.0f32; rows], vec![0.0f32; rows]);
            forward_rows(isa, &logits, &targets, vocab, &mut l, &mut s);
            let mut d = vec![0.0f32; rows * vocab];
            backward_rows(isa, &logits, &targets, &s, &dloss, vocab, &mut d);
            [l, s, d].map(|v| v.into_iter().map(f32::to_bits).collect::<Vec<_>>())
        };
        let want = run(Isa::BASELINE);
        for isa in Isa::supported() {
            assert!(run(isa) == want, "{}", isa.name());
        }
    }

    #[test]
    fn errors_name_row_and_target() {
        let logits = [0.0; 8];
        let (mut l, mut s) = ([0.0; 2], [0.0; 2]);
        for bad in [4i64, -1, i64::MIN] {
            let e = cross_entropy_forward(&logits, &[0, bad], 2, 4, &mut l, &mut s).unwrap_err();
            assert!(matches!(e, KernelError::Invalid { .. }));
            let msg = e.to_string();
            assert!(
                msg.contains("row 1") && msg.contains(&format!("target {bad}")),
                "{msg}"
            );
        }
        let mut dl = [0.0; 8];
        let e = cross_entropy_backward(&logits, &[0, 9], &s, &l, 2, 4, &mut dl).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Invalid {
                kernel: "cross_entropy_backward",
                ..
            }
        ));
        let e = cross_entropy_forward(&logits, &[0], 2, 4, &mut l, &mut s).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "targets",
                ..
            }
        ));
        let e = cross_entropy_forward(&logits, &[0, 1], 2, 4, &mut l, &mut s[..1]).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "logsumexp",
                ..
            }
        ));
        let e = cross_entropy_backward(&logits, &[0, 1], &s, &l, 2, 4, &mut dl[..7]).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "dlogits",
                ..
            }
        ));
        let e = cross_entropy_backward(&logits, &[0, 1], &s, &l[..1], 2, 4, &mut dl).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "dloss",
                ..
            }
        ));
    }
}
