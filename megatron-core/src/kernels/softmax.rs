//! Scaled, optionally causal softmax over the last dimension of attention scores `[batches, sq, sk]`.
//!
//! `batches` folds every leading dimension (micro-batch × local heads). With a causal
//! [`KeyMask`], query row `i` sits at key position `p = i + (sk − sq)` (queries are the last `sq`
//! positions of the key sequence) and sees keys `j ≤ p`; with a sliding window of `w` also only
//! `j ≥ p − w` (the query and the `w` keys before it). Masked keys get exactly zero probability.

use rayon::prelude::*;

use super::isa::{Isa, versioned};
use super::math;
use super::parallel;
use super::reduce;
use super::shape::numel;
use super::{KernelError, check_len};

/// Which keys each query row of the scores sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyMask {
    /// Every key.
    #[default]
    All,
    /// The keys up to the query's position.
    Causal,
    /// The query's position and at most this many keys before it (sliding-window attention:
    /// Megatron-LM's `--window-size` left part, Hugging Face's `sliding_window` less one).
    Window(usize),
}

impl From<bool> for KeyMask {
    /// `true`: causal; `false`: every key.
    fn from(causal: bool) -> KeyMask {
        if causal {
            KeyMask::Causal
        } else {
            KeyMask::All
        }
    }
}

impl KeyMask {
    /// The mask with a window of `window` keys before each query (none: causal), or every key
    /// when not `causal`.
    pub fn causal_window(causal: bool, window: Option<usize>) -> KeyMask {
        match (causal, window) {
            (false, _) => KeyMask::All,
            (true, None) => KeyMask::Causal,
            (true, Some(w)) => KeyMask::Window(w),
        }
    }

    /// The keys `lo..hi` query row `i` of `sq` sees among `sk`.
    #[inline]
    pub fn visible(self, i: usize, sq: usize, sk: usize) -> std::ops::Range<usize> {
        let hi = match self {
            KeyMask::All => return 0..sk,
            KeyMask::Causal | KeyMask::Window(_) => i
                .saturating_add(1)
                .saturating_add(sk)
                .saturating_sub(sq)
                .min(sk),
        };
        let lo = match self {
            KeyMask::Window(w) => hi.saturating_sub(w.saturating_add(1)),
            _ => 0,
        };
        lo..hi
    }
}

/// Checks the dimensions and `scale`; returns `batches × sq × sk`.
fn check_dims(
    kernel: &'static str,
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
) -> Result<usize, KernelError> {
    if !scale.is_finite() {
        return Err(KernelError::Invalid {
            kernel,
            message: format!("scale must be finite, got {scale}"),
        });
    }
    numel(kernel, &[batches, sq, sk])
}

/// The dimension checks of `kernel` and the lengths of its buffers `(name, length)`, each of
/// `batches × sq × sk` elements (the GPU launchers make the same checks); returns that count.
pub(crate) fn check_buffers(
    kernel: &'static str,
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
    buffers: &[(&'static str, usize)],
) -> Result<usize, KernelError> {
    let n = check_dims(kernel, batches, sq, sk, scale)?;
    for &(name, len) in buffers {
        check_len(kernel, name, len, n, || {
            format!("batches {batches} × sq {sq} × sk {sk}")
        })?;
    }
    Ok(n)
}

versioned! {
    /// The rows of [`softmax_forward`] (`sk > 0`).
    fn softmax_rows(x: &[f32], y: &mut [f32], sq: usize, sk: usize, scale: f32, mask: KeyMask) {
        for (r, (xr, yr)) in x.chunks_exact(sk).zip(y.chunks_exact_mut(sk)).enumerate() {
            let visible = mask.visible(r % sq, sq, sk);
            let (yr, ym) = yr.split_at_mut(visible.end);
            ym.fill(0.0);
            let (yb, yv) = yr.split_at_mut(visible.start);
            yb.fill(0.0);
            for (o, &v) in yv.iter_mut().zip(&xr[visible.start..]) {
                *o = v * scale;
            }
            let m = reduce::max(yv);
            if m == f32::NEG_INFINITY {
                // Nothing visible, or every visible score is −∞ (NaN still propagates).
                for o in yv.iter_mut() {
                    *o = if o.is_nan() { f32::NAN } else { 0.0 };
                }
                continue;
            }
            for o in yv.iter_mut() {
                *o = math::exp(*o - m);
            }
            let inv = 1.0 / reduce::sum(yv);
            for o in yv.iter_mut() {
                *o *= inv;
            }
        }
    }
}

versioned! {
    /// The rows of [`softmax_backward`] (`sk > 0`).
    fn softmax_backward_rows(y: &[f32], dy: &[f32], sk: usize, scale: f32, dx: &mut [f32]) {
        let rows = y.chunks_exact(sk).zip(dy.chunks_exact(sk));
        for ((yr, dyr), dxr) in rows.zip(dx.chunks_exact_mut(sk)) {
            let s = reduce::dot(dyr, yr);
            for ((o, &p), &g) in dxr.iter_mut().zip(yr).zip(dyr) {
                *o = scale * p * (g - s);
            }
        }
    }
}

/// `y = softmax(scale·x)` over the last dimension of `x[batches, sq, sk]`, masked as `mask`
/// says (a [`KeyMask`], or `true` for causal and `false` for none).
///
/// The row maximum is subtracted before exponentiating (with the vectorised [`math::exp`]). A row whose visible scores are all `−∞`
/// (or a causal row that sees no key, when `sk < sq`) gets all-zero probabilities instead of NaN.
pub fn softmax_forward(
    x: &[f32],
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
    mask: impl Into<KeyMask>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    const K: &str = "softmax_forward";
    let mask: KeyMask = mask.into();
    check_buffers(K, batches, sq, sk, scale, &[("x", x.len()), ("y", y.len())])?;
    if sk == 0 {
        return Ok(());
    }
    let isa = Isa::detected();
    // Whole batches per part: a row's causal mask depends on its query index within the batch.
    match parallel::part_units(batches, sq * sk) {
        None => softmax_rows(isa, x, y, sq, sk, scale, mask),
        Some(units) => parallel::on_pool(|| {
            let part = units * sq * sk;
            y.par_chunks_mut(part)
                .zip(x.par_chunks(part))
                .for_each(|(y, x)| softmax_rows(isa, x, y, sq, sk, scale, mask))
        }),
    }
    Ok(())
}

/// Gradient of [`softmax_forward`] from its output: `dx = scale · y ⊙ (dy − Σ_j dy·y)` (overwrites `dx`).
///
/// Masked positions have `y = 0` and so get a zero gradient; no mask argument is needed.
pub fn softmax_backward(
    y: &[f32],
    dy: &[f32],
    batches: usize,
    sq: usize,
    sk: usize,
    scale: f32,
    dx: &mut [f32],
) -> Result<(), KernelError> {
    const K: &str = "softmax_backward";
    check_buffers(
        K,
        batches,
        sq,
        sk,
        scale,
        &[("y", y.len()), ("dy", dy.len()), ("dx", dx.len())],
    )?;
    if sk == 0 {
        return Ok(());
    }
    let isa = Isa::detected();
    match parallel::part_units(batches * sq, sk) {
        None => softmax_backward_rows(isa, y, dy, sk, scale, dx),
        Some(units) => parallel::on_pool(|| {
            let part = units * sk;
            dx.par_chunks_mut(part)
                .zip(y.par_chunks(part))
                .zip(dy.par_chunks(part))
                .for_each(|((dx, y), dy)| softmax_backward_rows(isa, y, dy, sk, scale, dx))
        }),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{Rng, check_directional, weighted_sum};
    use super::*;

    /// f64 reference with an explicit mask.
    fn reference(
        x: &[f32],
        batches: usize,
        sq: usize,
        sk: usize,
        scale: f64,
        mask: KeyMask,
    ) -> Vec<f64> {
        let mut y = vec![0.0; x.len()];
        for b in 0..batches {
            for i in 0..sq {
                let row = (b * sq + i) * sk;
                // Query i at key position p sees j ≤ p, and with a window w also j ≥ p − w.
                let p = i as i64 + sk as i64 - sq as i64;
                let sees = |j: usize| match mask {
                    KeyMask::All => true,
                    KeyMask::Causal => (j as i64) <= p,
                    KeyMask::Window(w) => (j as i64) <= p && (j as i64) >= p - w as i64,
                };
                let m = (0..sk)
                    .filter(|&j| sees(j))
                    .map(|j| scale * x[row + j] as f64)
                    .fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = (0..sk)
                    .filter(|&j| sees(j))
                    .map(|j| (scale * x[row + j] as f64 - m).exp())
                    .sum();
                for j in (0..sk).filter(|&j| sees(j)) {
                    y[row + j] = (scale * x[row + j] as f64 - m).exp() / z;
                }
            }
        }
        y
    }

    #[test]
    fn forward_matches_reference() {
        let mut rng = Rng::new(40);
        use KeyMask::{All, Causal, Window};
        for &(batches, sq, sk, mask) in &[
            (3, 5, 5, Causal),
            (2, 4, 9, Causal),
            (2, 6, 3, Causal),
            (2, 5, 7, All),
            (1, 1, 1, Causal),
            (2, 3, 33, All),
            (2, 7, 7, Window(2)),
            (2, 4, 9, Window(3)),
            (1, 5, 5, Window(0)),
            (2, 6, 3, Window(1)),
        ] {
            let n = batches * sq * sk;
            let x = rng.vec(n, -8.0, 8.0);
            let scale = 0.37;
            let mut y = vec![f32::NAN; n];
            softmax_forward(&x, batches, sq, sk, scale, mask, &mut y).unwrap();
            let want = reference(&x, batches, sq, sk, scale as f64, mask);
            for (k, (&g, &w)) in y.iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - w).abs() < 1e-6,
                    "{batches}×{sq}×{sk} {mask:?} at {k}: {g} vs {w}"
                );
                if w == 0.0 {
                    assert_eq!(g, 0.0, "masked position {k} must be exactly 0");
                }
            }
            for i in 0..batches * sq {
                let s: f32 = y[i * sk..(i + 1) * sk].iter().sum();
                let sees_any = mask == All || (i % sq) + sk >= sq;
                assert!(if sees_any {
                    (s - 1.0).abs() < 1e-5
                } else {
                    s == 0.0
                });
            }
        }
    }

    #[test]
    fn forward_is_stable_and_never_nan_on_masked_rows() {
        let x = [
            1e4f32,
            1e4 - 1.0,
            -1e4,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
        ];
        let mut y = [f32::NAN; 6];
        softmax_forward(&x, 1, 2, 3, 1.0, false, &mut y).unwrap();
        let e = (-1.0f64).exp();
        assert!((y[0] as f64 - 1.0 / (1.0 + e)).abs() < 1e-6);
        assert!((y[1] as f64 - e / (1.0 + e)).abs() < 1e-6);
        assert_eq!(y[2], 0.0);
        assert_eq!(&y[3..], &[0.0, 0.0, 0.0]);
        // sk < sq: the first causal query sees no key.
        let mut y = [f32::NAN; 6];
        softmax_forward(&[1.0; 6], 1, 3, 2, 1.0, true, &mut y).unwrap();
        assert_eq!(y, [0.0, 0.0, 1.0, 0.0, 0.5, 0.5]);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng::new(41);
        for &(batches, sq, sk, causal) in &[
            (2, 6, 6, KeyMask::Causal),
            (2, 3, 8, KeyMask::Causal),
            (3, 4, 5, KeyMask::All),
            (2, 6, 6, KeyMask::Window(2)),
        ] {
            let n = batches * sq * sk;
            let x = rng.vec(n, -3.0, 3.0);
            let w = rng.vec(n, -1.0, 1.0);
            let d = rng.vec(n, -1.0, 1.0);
            let scale = 0.7;
            let mut y = vec![0.0; n];
            softmax_forward(&x, batches, sq, sk, scale, causal, &mut y).unwrap();
            let mut dx = vec![f32::NAN; n];
            softmax_backward(&y, &w, batches, sq, sk, scale, &mut dx).unwrap();
            check_directional("softmax dx", &x, &d, 1e-2, &dx, 2e-3, |x| {
                let mut y = vec![0.0; n];
                softmax_forward(x, batches, sq, sk, scale, causal, &mut y).unwrap();
                weighted_sum(&w, &y)
            });
        }
    }

    #[test]
    fn every_compiled_version_gives_the_same_bits() {
        let mut rng = Rng::new(42);
        let (batches, sq, sk) = (3, 37, 45);
        let n = batches * sq * sk;
        let x = rng.vec(n, -6.0, 6.0);
        let dy = rng.vec(n, -1.0, 1.0);
        let run = |isa: Isa| {
            let (mut y, mut dx) = (vec![0.0f32; n], vec![0.0f32; n]);
            softmax_rows(isa, &x, &mut y, sq, sk, 0.3, KeyMask::Window(20));
            softmax_backward_rows(isa, &y, &dy, sk, 0.3, &mut dx);
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            (bits(y), bits(dx))
        };
        let want = run(Isa::BASELINE);
        for isa in Isa::supported() {
            assert!(run(isa) == want, "{}", isa.name());
        }
    }

    #[test]
    fn errors() {
        let mut y = [0.0; 12];
        let e = softmax_forward(&[0.0; 11], 1, 3, 4, 1.0, true, &mut y).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "x",
                expected: 12,
                actual: 11,
                ..
            }
        ));
        let e = softmax_forward(&[0.0; 12], 1, 3, 4, f32::NAN, true, &mut y).unwrap_err();
        assert!(matches!(e, KernelError::Invalid { .. }));
        let e = softmax_backward(&[0.0; 12], &[0.0; 12], 1, 3, 4, 1.0, &mut y[..10]).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "dx", .. }));
        let e = softmax_backward(&[0.0; 12], &[0.0; 2], 1, 3, 4, 1.0, &mut y).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "dy", .. }));
    }
}
