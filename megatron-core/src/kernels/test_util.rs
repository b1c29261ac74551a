//! Test support for the kernels: a seeded PRNG and a directional finite-difference check.

/// SplitMix64 generator: deterministic test data, never seeded from the clock.
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator with the given seed.
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[lo, hi)`.
    pub(crate) fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit() as f32
    }

    /// `n` values uniform in `[lo, hi)`.
    pub(crate) fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    /// Uniform integer in `[0, n)` (`n > 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// `Σ w·y` in f64: the scalar loss whose gradient with respect to `y` is `w`.
pub(crate) fn weighted_sum(w: &[f32], y: &[f32]) -> f64 {
    assert_eq!(w.len(), y.len());
    w.iter().zip(y).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// Checks `grad` against a central difference of `loss` at `x` along direction `d` with step `h`.
///
/// The perturbed points are rounded to f32 first and the analytic side uses the rounded
/// difference `x⁺ − x⁻`, so only the truncation error of the central difference and the f32
/// rounding of the forward remain. Panics (with both values) when the relative error exceeds `rtol`.
pub(crate) fn check_directional(
    what: &str,
    x: &[f32],
    d: &[f32],
    h: f32,
    grad: &[f32],
    rtol: f64,
    mut loss: impl FnMut(&[f32]) -> f64,
) {
    assert_eq!(x.len(), d.len());
    assert_eq!(x.len(), grad.len());
    let xp: Vec<f32> = x.iter().zip(d).map(|(&a, &b)| a + h * b).collect();
    let xm: Vec<f32> = x.iter().zip(d).map(|(&a, &b)| a - h * b).collect();
    let numeric = loss(&xp) - loss(&xm);
    let analytic: f64 = grad
        .iter()
        .zip(xp.iter().zip(&xm))
        .map(|(&g, (&p, &m))| g as f64 * (p as f64 - m as f64))
        .sum();
    let err = (numeric - analytic).abs();
    let scale = analytic.abs().max(numeric.abs()).max(1e-12);
    assert!(
        err <= rtol * scale,
        "{what}: finite difference {numeric:e} vs analytic {analytic:e} (relative error {:e} > {rtol:e})",
        err / scale
    );
}
